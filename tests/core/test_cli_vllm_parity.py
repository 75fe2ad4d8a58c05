"""`gemmaserve serve` takes common `vllm serve` launch lines: the positional MODEL, vLLM's aliases, and vLLM flags
without a gemmaserve setting accepted at the value that changes nothing or refused with the reason; CORS lists as
vLLM's JSON lists; unknown flags get a did-you-mean; `generate --token-ids` takes ASCII digits only."""

from __future__ import annotations

import argparse
import os

import pytest
from gemmaserve.cli import _parse_token_ids, _replica_flags, build_parser, main
from gemmaserve.errors import ConfigurationError, InvalidRequestError
from gemmaserve.server.serve import _cors_lists
from gemmaserve.settings import split_list
from gemmaserve.settings import CoreSettings, load_settings


@pytest.fixture
def served(monkeypatch: pytest.MonkeyPatch) -> list[CoreSettings]:
    """`serve` stubbed: the settings it would have served with are recorded instead."""
    seen: list[CoreSettings] = []
    monkeypatch.setattr("gemmaserve.server.serve.serve", seen.append)
    monkeypatch.setenv("TRUST_REMOTE_CODE", "0")  # restored after the test (--trust-remote-code sets it)
    return seen


def test_a_vllm_serve_line_is_accepted(served: list[CoreSettings]) -> None:
    assert main(["serve", "/models/gemma", "--enable-prefix-caching", "--enable-auto-tool-choice",
                 "--generation-config", "vllm", "--max-num-seqs", "8", "-tp", "1", "--kv-cache-dtype", "auto",
                 "--pipeline-parallel-size", "1", "--trust-remote-code", "--max-num-batched-tokens", "512",
                 "--allowed-origins", '["https://a.com", "https://b.com"]', "--allowed-methods", '["GET"]']) == 0
    (settings,) = served
    assert settings.model == "/models/gemma" and settings.max_batch_size == 8 and settings.tensor_parallel_size == 1
    assert settings.max_num_batched_tokens == 512
    assert settings.allowed_origins == "https://a.com,https://b.com" and settings.allowed_methods == "GET"
    assert os.environ["TRUST_REMOTE_CODE"] == "1"  # what the hf plugin reads


def test_positional_model_and_model_flag(served: list[CoreSettings], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "/m", "--model", "/m"]) == 0 and served[-1].model == "/m"
    assert main(["serve", "/a", "--model", "/b"]) == 2
    assert "serve /a and --model /b name two models" in capsys.readouterr().err and len(served) == 1


@pytest.mark.parametrize(("argv", "message"), [
    (["--no-enable-prefix-caching"], "--no-enable-prefix-caching: vLLM's flag is not implemented: prefix caching is "
     "always on with the custom backends; PREFIX_CACHE_BLOCKS=0"),
    (["--gpu-memory-utilization", "0.9"], "--gpu-memory-utilization 0.9: vLLM's flag is not implemented: KV memory is "
     "sized by --max-active-kv-tokens"),
    (["--seed", "0"], "send `seed` in each request"),
    (["--generation-config", "auto"], "--generation-config auto: vLLM's flag is not implemented: "
     "generation_config.json's sampling defaults are not applied"),
    (["--generation-config", "auto"], "(accepted: vllm, which changes nothing)"),
    (["--enforce-eager"], "CUSTOM_BACKEND_CUDA_GRAPH=0"),
    (["--tokenizer", "x"], "the tokenizer is the checkpoint's own"),
    (["--pipeline-parallel-size", "2"], "use --tensor-parallel-size N"),
    (["--kv-cache-dtype", "fp8"], "model's dtype"),
    (["--allowed-origins", "[https://a.com]"], "--allowed-origins='[https://a.com]' starts with '[' but is not a JSON "
     "list"),
])
def test_vllm_flags_without_a_setting_are_refused_with_the_reason(
        argv: list[str], message: str, served: list[CoreSettings], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", *argv]) == 2
    assert message in capsys.readouterr().err and not served


def test_accepted_vllm_flags_do_not_reach_the_replicas() -> None:
    args = build_parser().parse_args(["serve", "/m", "--enable-prefix-caching", "--max-num-seqs", "4", "-tp", "1",
                                      "--generation-config", "vllm", "--data-parallel-size", "2"])
    args.model = args.model_tag  # as cmd_serve resolves it
    flags = _replica_flags(args)
    assert "--model=/m" in flags and "--max-batch-size=4" in flags and "--tensor-parallel-size=1" in flags
    assert not any("prefix" in flag or "generation" in flag for flag in flags)


def test_unknown_flags_get_a_did_you_mean(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["serve", "--uvicorn-log-level", "info"])
    assert "unrecognized arguments: --uvicorn-log-level (did you mean --log-level?)" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["bench", "--num-promts", "3"])
    assert "--num-promts (did you mean --num-prompts?)" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["serve", "--disable-log-requests"])
    assert "unrecognized arguments: --disable-log-requests" in capsys.readouterr().err


@pytest.mark.parametrize("text", ["2,²", "١٢", "2 ³"])
def test_token_ids_take_ascii_digits_only(text: str) -> None:
    with pytest.raises(InvalidRequestError, match="digits 0-9"):
        _parse_token_ids(text)
    assert _parse_token_ids("[2, 651 6037]") == [2, 651, 6037]


def test_generate_refuses_non_ascii_token_ids(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", "--token-ids", "2,²", "--log-level", "warning"]) == 2
    assert "digits 0-9" in capsys.readouterr().err


def test_split_takes_vllms_json_lists() -> None:
    assert split_list("https://a.com, https://b.com,") == ["https://a.com", "https://b.com"]
    assert split_list(' ["https://a.com", " https://b.com "] ') == ["https://a.com", "https://b.com"]
    assert split_list("[]") == [] and split_list("") == []
    for bad in ('["a", 1]', "[a", '["a,b"]', '[{"a": 1}]'):
        with pytest.raises(ConfigurationError, match="ALLOWED_ORIGINS=.* JSON list"):
            split_list(bad, "ALLOWED_ORIGINS")


def test_env_json_lists_reach_cors(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ALLOWED_ORIGINS", '["https://a.com"]')
    monkeypatch.setenv("ALLOWED_HEADERS", '["x-a", "x-b"]')
    assert _cors_lists(load_settings()) == {"allowed_origins": ["https://a.com"],
                                            "allowed_headers": ["x-a", "x-b"], "allowed_methods": ["GET", "POST"]}


def test_parser_is_argparse() -> None:
    assert isinstance(build_parser(), argparse.ArgumentParser)


def test_env_json_star_with_credentials_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ALLOWED_ORIGINS", '["*"]')
    monkeypatch.setenv("ALLOW_CREDENTIALS", "1")
    with pytest.raises(ConfigurationError, match="ALLOW_CREDENTIALS=1 with ALLOWED_ORIGINS='\\*'"):
        load_settings()  # the settings' own check reads the JSON list too


def test_serve_rewrites_env_json_lists_comma_separated(served: list[CoreSettings],
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ALLOWED_ORIGINS", '["https://a.com", "https://b.com"]')  # the router's launcher splits commas
    monkeypatch.setenv("ALLOWED_HOSTS", '["h.example"]')
    assert main(["serve"]) == 0
    assert served[0].allowed_origins == "https://a.com,https://b.com" and served[0].allowed_hosts == "h.example"


def test_max_model_len_takes_vllms_human_readable_counts(capsys: pytest.CaptureFixture[str]) -> None:
    parse = build_parser().parse_args
    for text, count in (("8192", 8192), ("32k", 32000), ("32K", 32768), ("25.6k", 25600), ("1.1k", 1100)):
        assert parse(["serve", "--max-model-len", text]).max_model_len == count
    for bad in ("1.5K", "1.5", "8x", "²", "1.0001k"):
        with pytest.raises(SystemExit):
            parse(["generate", "hi", "--max-model-len", bad])
        assert "expected a whole number of tokens such as 8192, 8k" in capsys.readouterr().err


def test_api_key_takes_vllms_list_form_with_one_key(served: list[CoreSettings],
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "/m", "--api-key", "k1"]) == 0 and served[-1].api_key == "k1"
    assert main(["serve", "--api-key", "k1", "k2", "--port", "8001"]) == 2
    err = capsys.readouterr().err
    assert "--api-key got 2 keys; gemmaserve's server checks one key" in err and "('k2' here?)" in err
    assert main(["serve", "--api-key", "k1", "/m"]) == 2  # vLLM's parse too: the model after the flag is a key
    assert "put the model first (serve MODEL --api-key KEY) or use --model" in capsys.readouterr().err
    assert len(served) == 1


def test_the_two_spellings_of_a_flag_with_different_values_are_refused(served: list[CoreSettings],
                                                                       capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["serve", "/m", "--max-batch-size", "8", "--max-num-seqs", "4"])
    assert info.value.code == 2 and not served
    assert ("--max-batch-size 8 and --max-num-seqs 4 set the same setting (MAX_BATCH_SIZE) to different values: give "
            "one of them") in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["generate", "hi", "-tp", "2", "--tensor-parallel-size", "1"])
    assert "-tp 2 and --tensor-parallel-size 1" in capsys.readouterr().err
    assert main(["serve", "/m", "--max-num-seqs", "4", "--max-batch-size", "4"]) == 0 and served[-1].max_batch_size == 4
    assert main(["serve", "/m", "--max-num-seqs", "4", "--max-num-seqs", "6"]) == 0 and served[-1].max_batch_size == 6


def test_enable_prefix_caching_with_the_cache_off_is_refused(served: list[CoreSettings],
                                                             monkeypatch: pytest.MonkeyPatch,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("PREFIX_CACHE_BLOCKS", "0")
    assert main(["serve", "/m", "--enable-prefix-caching"]) == 2 and not served
    assert ("--enable-prefix-caching asks for prefix caching, but PREFIX_CACHE_BLOCKS is 0, which turns the prefix "
            "cache off") in capsys.readouterr().err
    assert main(["serve", "/m"]) == 0 and served[-1].prefix_cache_blocks == 0  # without the flag: off, as asked
    monkeypatch.setenv("PREFIX_CACHE_BLOCKS", "16")
    assert main(["serve", "/m", "--enable-prefix-caching"]) == 0 and served[-1].prefix_cache_blocks == 16
