"""CLI argument handling that must fail fast and clearly, before any model loads."""

from __future__ import annotations

import pytest

from gemmaserve.cli import _parse_token_ids, main
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
