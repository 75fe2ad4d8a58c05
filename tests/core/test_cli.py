"""CLI argument handling that must fail fast and clearly, before any model loads."""

from __future__ import annotations

import argparse
import json

import pytest

from gemmaserve.cli import _parse_token_ids, build_parser, main
from gemmaserve.engine.engine import Engine
from gemmaserve.engine.request import FinishReason
from gemmaserve.errors import InvalidRequestError
from gemmaserve.sampling_params import SamplingParams
from gemmaserve.settings import load_settings
from gemmaserve.testing.reference_backend import ReferenceBackend


@pytest.mark.parametrize("text", ["2,651,6037", "2 651 6037", "[2, 651, 6037]", " 2,651 ,6037 "])
def test_token_ids_accepts_common_spellings(text: str) -> None:
    assert _parse_token_ids(text) == [2, 651, 6037]


@pytest.mark.parametrize("text", ["2,abc", "", "[]", "-1,2", "1.5"])
def test_token_ids_rejects_garbage_with_the_expected_format(text: str) -> None:
    with pytest.raises(InvalidRequestError, match="--token-ids expects"):
        _parse_token_ids(text)


def test_backends_exits_nonzero_for_an_unknown_backend(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["backends", "--backend", "no-such-backend"]) == 2
    assert "unknown BACKEND" in capsys.readouterr().out


def test_cancel_with_stop_reason_is_recorded_as_stop() -> None:
    backend = ReferenceBackend(vocab_size=64, max_model_len=512, eos_token_id=2, decode_delay_s=0.01)
    with Engine(backend, load_settings(max_batch_size=4)) as engine:
        handle = engine.submit([5, 6, 7], SamplingParams(max_tokens=400, ignore_eos=True))
        next(iter(handle))  # running
        assert handle.cancel(reason=FinishReason.STOP)
        output = handle.result(timeout=30)
        assert output.finish_reason == FinishReason.STOP
        assert engine.stats().finished.get("stop") == 1
        with pytest.raises(ValueError, match="cancel reason"):
            engine.cancel("x", reason=FinishReason.ERROR)


def test_sampling_params_accepts_vllm_top_k_minus_one() -> None:
    assert SamplingParams(top_k=-1).top_k == 0
    with pytest.raises(InvalidRequestError, match="top_k"):
        SamplingParams(top_k=-2)


def test_generate_rejects_an_empty_prompt_before_loading_the_model(monkeypatch: pytest.MonkeyPatch,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    def no_model(*args: object, **kwargs: object) -> None:
        raise AssertionError("the model was loaded for an empty prompt")

    monkeypatch.setattr("gemmaserve.api.LLM", no_model)
    assert main(["generate", ""]) == 2
    assert "the prompt is empty" in capsys.readouterr().err


def test_generate_refuses_sampling_flags_without_a_temperature(monkeypatch: pytest.MonkeyPatch,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    """--top-k / --top-p / --seed without --temperature would decode greedily (the default) and change nothing: the
    command says so before loading the model; with a temperature they sample."""
    from gemmaserve.cli import sampling_from_args

    def no_model(*args: object, **kwargs: object) -> None:
        raise AssertionError("the model was loaded")

    monkeypatch.setattr("gemmaserve.api.LLM", no_model)
    assert main(["generate", "hi", "--top-k", "5", "--seed", "3"]) == 2
    assert "temperature" in capsys.readouterr().err
    parser = _subcommands()["generate"]
    params = sampling_from_args(parser.parse_args(["hi", "--top-k", "5", "--temperature", "0.7"]))
    assert (params.top_k, params.temperature) == (5, 0.7)
    assert sampling_from_args(parser.parse_args(["hi"])).temperature == 0.0


def _subcommands() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(sub.choices)


@pytest.mark.parametrize("command", sorted(_subcommands()))
def test_help_shows_every_options_default(command: str) -> None:
    parser = _subcommands()[command]
    text = " ".join(parser.format_help().split())
    for action in parser._actions:
        if not action.option_strings or action.nargs == 0:  # positionals, --help, on/off flags
            continue
        help_text = " ".join((action.help or "").split()) % {"default": action.default}
        assert "default" in help_text and help_text in text, (command, action.option_strings, action.help)
    if command == "generate":
        assert "(env BACKEND; default: auto)" in text and "(default: 64)" in text


@pytest.mark.parametrize("temperature", [0.0, 1e-9, 2.0, 2.5, 100.0, 100.5, -0.1, float("inf"), float("nan")])
def test_temperature_range_is_the_same_offline_and_over_http(temperature: float) -> None:
    from gemmaserve.server.errors import APIError
    from gemmaserve.server.protocol import CompletionRequest, parse_body

    try:
        SamplingParams(temperature=temperature)
        offline = True
    except InvalidRequestError:
        offline = False
    raw = json.dumps({"prompt": "x", "temperature": temperature}).encode()
    try:
        parse_body(CompletionRequest, raw)
        http = True
    except APIError as exc:
        assert exc.param == "temperature"
        http = False
    assert offline == http, (temperature, offline, http)
    assert offline == (0 <= temperature <= 100)


def test_a_misspelt_backend_gets_a_suggestion(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["backends", "--backend", "custom-cpuu"]) == 2
    assert "(did you mean 'custom-cpu'?)" in capsys.readouterr().out
