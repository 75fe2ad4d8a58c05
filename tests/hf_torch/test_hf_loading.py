"""Loading: model facts, dtypes, tokenizer wrapper, and the user errors of loading and prefill."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from hf_support import cpu_settings, hf_settings
from hf_checkpoints import hf_greedy

from gemmaserve.errors import InvalidRequestError, ModelLoadError, PromptTooLongError
from gemmaserve.sampling_params import SamplingParams
from gemmaserve_hf_torch import loader
from gemmaserve_hf_torch.backend import HFTorchBackend, create_backend
from gemmaserve_hf_torch.loader import load_model, resolve_dtype


def test_model_info(gemma4_backend: HFTorchBackend, llama_backend: HFTorchBackend) -> None:
    info = gemma4_backend.model_info
    assert (info.vocab_size, info.max_model_len, info.eos_token_ids) == (512, 1024, (1,))
    assert (info.architecture, info.dtype, info.device) == ("Gemma4ForCausalLM", "float32", "cpu")
    assert llama_backend.model_info.max_model_len == 128
    assert llama_backend.model_info.architecture == "LlamaForCausalLM"


def test_settings_max_model_len_caps_the_model_limit(llama_dir: Path) -> None:
    loaded = load_model(str(llama_dir), "cpu", cpu_settings(max_model_len=40), hf_settings())
    assert loaded.max_model_len == 40


@pytest.mark.parametrize("native_bf16", [False, True])
def test_auto_dtype_off_cuda_is_bfloat16_only_on_cpus_with_bfloat16_instructions(
    monkeypatch: pytest.MonkeyPatch, native_bf16: bool
) -> None:
    monkeypatch.setattr("gemmaserve_hf_torch.loader.cpu_has_native_bfloat16", lambda: native_bf16)
    assert resolve_dtype("auto", "cpu") == (torch.bfloat16 if native_bf16 else torch.float32)
    assert resolve_dtype("auto", "mps") == torch.float32
    assert resolve_dtype("bfloat16", "cpu") == torch.bfloat16
    assert resolve_dtype("float32", "cpu") == torch.float32


def test_bfloat16_model_runs_with_bfloat16_kv(llama_dir: Path) -> None:
    backend = create_backend(str(llama_dir), "cpu", cpu_settings(dtype="bfloat16"))
    assert backend.model_info.dtype == "bfloat16" and backend.layout.dtype == torch.bfloat16
    prompt = list(range(3, 20))
    tokens = list(backend.generate_stream(prompt, SamplingParams(max_tokens=4, ignore_eos=True)))
    assert len(tokens) == 4 and all(0 <= t < 512 for t in tokens)
    backend.close()


def test_dtype_the_device_cannot_run(llama_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(dtype: torch.dtype, device: torch.device) -> None:
        raise RuntimeError('"addmm_impl_cpu_" not implemented for \'Half\'')

    monkeypatch.setattr(loader, "_run_dtype_probe", refuse)
    with pytest.raises(ModelLoadError, match=r"DTYPE=float16 does not run on cpu.*addmm.*DTYPE=float32"):
        create_backend(str(llama_dir), "cpu", cpu_settings(dtype="float16"))


def test_load_errors_name_the_problem(llama_dir: Path, tmp_path: Path) -> None:
    settings = cpu_settings()
    with pytest.raises(ModelLoadError, match="does not exist"):
        create_backend(str(tmp_path / "missing"), "cpu", settings)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelLoadError, match="no config.json"):
        create_backend(str(tmp_path / "empty"), "cpu", settings)
    no_weights = tmp_path / "no_weights"
    no_weights.mkdir()
    shutil.copy(llama_dir / "config.json", no_weights / "config.json")
    with pytest.raises(ModelLoadError, match="no weights"):
        create_backend(str(no_weights), "cpu", settings)
    unsupported = tmp_path / "unsupported"
    shutil.copytree(llama_dir, unsupported)
    raw = json.loads((unsupported / "config.json").read_text())
    (unsupported / "config.json").write_text(json.dumps({**raw, "model_type": "vit", "architectures": ["ViTModel"]}))
    with pytest.raises(ModelLoadError, match=r"unsupported architecture.*'vit'.*e\.g\. .*gemma4"):
        create_backend(str(unsupported), "cpu", settings)
    no_tokenizer = tmp_path / "no_tokenizer"
    no_tokenizer.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(llama_dir / name, no_tokenizer / name)
    with pytest.raises(ModelLoadError, match="tokenizer"):
        create_backend(str(no_tokenizer), "cpu", settings)


def test_tokenizer_wrapper(gemma4_backend: HFTorchBackend, llama_backend: HFTorchBackend) -> None:
    tokenizer = gemma4_backend.tokenizer
    ids = tokenizer.encode("the quick brown fox", add_special_tokens=False)
    assert tokenizer.decode(ids) == "the quick brown fox"
    assert tokenizer.has_chat_template and not llama_backend.tokenizer.has_chat_template
    messages = [{"role": "user", "content": "hello there"}]
    expected = tokenizer.hf.encode("<bos>user: hello there\nmodel:", add_special_tokens=False)
    assert tokenizer.apply_chat_template(messages) == expected
    with pytest.raises(InvalidRequestError, match="role"):
        tokenizer.apply_chat_template([{"content": "no role"}])
    with pytest.raises(InvalidRequestError, match="no chat template"):
        llama_backend.tokenizer.apply_chat_template(messages)


def test_prefill_rejects_bad_prompts(llama_backend: HFTorchBackend) -> None:
    with llama_backend.lock:
        with pytest.raises(PromptTooLongError, match="129 tokens.*context is 128"):
            llama_backend.prefill_lookup([5] * 129)
        with pytest.raises(InvalidRequestError, match="empty"):
            llama_backend.prefill_lookup([])
        with pytest.raises(InvalidRequestError, match=r"512 .*\[0, 512\)"):
            llama_backend.prefill_lookup([5, 512])
        result = llama_backend.prefill([5] * 128)  # exactly the context fits
        assert llama_backend.kv_length(result.kv) == 128
        llama_backend.free_row_kv(result.kv)
        with pytest.raises(RuntimeError, match="freed twice"):
            llama_backend.free_row_kv(result.kv)


def test_greedy_equals_generate_for_one_request(any_backend: HFTorchBackend) -> None:
    model = any_backend.loaded.model
    for prompt in ([7, 8, 9], list(range(40, 67))):  # the second is longer than the sliding window (8)
        params = SamplingParams(max_tokens=16, ignore_eos=True)
        assert list(any_backend.generate_stream(prompt, params)) == hf_greedy(model, prompt, 16)


def test_a_truncated_weight_file_is_a_clear_model_load_error(llama_dir: Path, tmp_path: Path) -> None:
    truncated = tmp_path / "truncated"
    shutil.copytree(llama_dir, truncated)
    weights = truncated / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(ModelLoadError, match="truncated or corrupt"):
        create_backend(str(truncated), "cpu", cpu_settings())
