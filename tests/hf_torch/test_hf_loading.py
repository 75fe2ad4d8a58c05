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


def test_models_whose_cache_does_not_continue_a_prompt_are_refused_at_load() -> None:
    """Continuous batching needs one cached position per token and a prompt continued through the cache exactly as
    in one forward: CPM-Ant (which prepends positions of its own) and XLM (bidirectional by default, and its
    ``cache`` argument is not transformers' cache) loaded and then failed or answered wrongly; now refused."""
    from transformers import CpmAntConfig, CpmAntForCausalLM, XLMConfig, XLMWithLMHeadModel

    torch.manual_seed(0)
    cpmant = CpmAntForCausalLM(CpmAntConfig(vocab_size=512, hidden_size=64, num_attention_heads=4, dim_head=16,
                                            dim_ff=128, num_hidden_layers=2, max_position_embeddings=256))
    with pytest.raises(ModelLoadError, match=r"holds \d+ cached positions after a 2-token test forward"):
        HFTorchBackend.from_model(cpmant, max_model_len=64)
    for causal in (False, True):
        xlm = XLMWithLMHeadModel(XLMConfig(vocab_size=64, emb_dim=32, n_layers=2, n_heads=2,
                                           max_position_embeddings=128, causal=causal))
        with pytest.raises(ModelLoadError, match="unsupported architecture for the hf backend"):
            HFTorchBackend.from_model(xlm, max_model_len=64)


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


def _save_tiny(model: torch.nn.Module, path: Path) -> Path:
    from tiny_checkpoints import save_tiny_tokenizer

    model.save_pretrained(str(path))
    save_tiny_tokenizer(path)
    return path


def test_a_model_that_counts_positions_itself_is_refused(tmp_path: Path) -> None:
    """Bart-style causal LMs take no ``position_ids`` and count positions from the sequence, so a left-padded row
    of a batch would decode at shifted positions (wrong tokens): refused at load, naming the reason. ALiBi models,
    which take no ``position_ids`` either but read positions from the attention mask, still load."""
    from transformers import BartConfig, BartForCausalLM, BloomConfig, BloomForCausalLM

    torch.manual_seed(0)
    bart = BartForCausalLM(BartConfig(vocab_size=512, d_model=32, decoder_layers=1, encoder_layers=1,
                                      decoder_attention_heads=2, encoder_attention_heads=2, decoder_ffn_dim=64,
                                      encoder_ffn_dim=64, max_position_embeddings=64, is_decoder=True,
                                      is_encoder_decoder=False))
    with torch.no_grad():  # large enough weights that a shifted position changes the logits
        for tensor in bart.state_dict().values():
            if tensor.is_floating_point() and tensor.dim() > 1:
                tensor.normal_(0.0, 0.2)
    with pytest.raises(ModelLoadError, match="takes no position_ids: it counts positions itself"):
        load_model(str(_save_tiny(bart, tmp_path / "bart")), "cpu", cpu_settings(), hf_settings())
    bloom = BloomForCausalLM(BloomConfig(vocab_size=512, hidden_size=32, n_layer=1, n_head=2))
    loaded = load_model(str(_save_tiny(bloom, tmp_path / "bloom")), "cpu", cpu_settings(max_model_len=64),
                        hf_settings(hf_attn_implementation="eager"))
    assert type(loaded.model).__name__ == "BloomForCausalLM"


def test_the_default_sdpa_falls_back_to_eager_where_an_architecture_lacks_it(tmp_path: Path) -> None:
    """Gemma 2 has no sdpa attention in transformers: with the default setting it loads with eager attention; asked
    for sdpa explicitly, the error says to set HF_ATTN_IMPLEMENTATION=eager."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    gemma2 = Gemma2ForCausalLM(Gemma2Config(vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                            num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                            max_position_embeddings=64))
    path = _save_tiny(gemma2, tmp_path / "gemma2")
    try:
        explicit = hf_settings(hf_attn_implementation="sdpa")
        load_model(str(path), "cpu", cpu_settings(), explicit)
    except ModelLoadError as exc:
        assert "set HF_ATTN_IMPLEMENTATION=eager" in str(exc)
    else:
        pytest.skip("this transformers runs Gemma 2 with sdpa attention")
    from gemmaserve_hf_torch.settings import HFTorchSettings

    loaded = load_model(str(path), "cpu", cpu_settings(), HFTorchSettings(compile_model=False))  # the default
    assert loaded.model.config._attn_implementation == "eager"


def _phi3_longrope(path: Path) -> Path:
    """A tiny Phi-3 with a longrope RoPE switching at 16 positions (real Phi-3 / 3.5 / 4-mini: 4,096)."""
    from tiny_checkpoints import save_tiny_tokenizer
    from transformers import Phi3Config, Phi3ForCausalLM

    torch.manual_seed(0)
    config = Phi3Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                        original_max_position_embeddings=16, sliding_window=None, pad_token_id=0, eos_token_id=1,
                        bos_token_id=2, rope_parameters={
                            "rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 8,
                            "long_factor": [1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0],
                            "original_max_position_embeddings": 16})
    model = Phi3ForCausalLM(config)
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            tensor.normal_(1.0 if "norm" in name else 0.0, 0.15)
    model.save_pretrained(str(path))
    save_tiny_tokenizer(path)
    return path


def test_position_factors_chosen_per_forward_call_bound_the_context(tmp_path: Path,
                                                                    caplog: pytest.LogCaptureFixture) -> None:
    """A longrope (or dynamic) RoPE picks its factors from the largest position of each forward call, which the hf
    backend shares between rows and splits into prefill chunks: beyond the original length a short row beside a
    long one, a chunked prompt and a prefix-cache hit each got other factors than ``generate`` (wrong tokens). The
    context is bounded to the original length (a warning says why; a larger MAX_MODEL_LEN is refused), and within
    it a row's tokens are ``generate``'s however it is batched."""
    from gemmaserve.errors import ConfigurationError
    from gemmaserve.engine.request import Request
    from gemmaserve.engine.scheduler import ContinuousBatchScheduler

    path = _phi3_longrope(tmp_path / "phi3")
    with caplog.at_level("WARNING"):
        loaded = load_model(str(path), "cpu", cpu_settings(), hf_settings())
    assert loaded.max_model_len == 16 and "'longrope' RoPE" in caplog.text
    with pytest.raises(ConfigurationError, match="longrope.*at most 16"):
        load_model(str(path), "cpu", cpu_settings(max_model_len=64), hf_settings())
    backend = HFTorchBackend(loaded)
    prompts = {"a": [7, 8, 9, 10, 11], "b": list(range(100, 111))}
    scheduler = ContinuousBatchScheduler(backend, cpu_settings(max_batch_size=4, prefill_chunk_tokens=3))
    for rid, prompt in prompts.items():
        scheduler.add_request(Request(rid, tuple(prompt), SamplingParams(max_tokens=4, ignore_eos=True)))
    done = {}
    while scheduler.has_work:
        for event in scheduler.step():
            if event.finished:
                done[event.request_id] = list(event.output.token_ids)
    assert done == {rid: hf_greedy(loaded.model, prompt, 4) for rid, prompt in prompts.items()}


def test_llama4_temperature_tuning_bounds_the_context() -> None:
    """Llama 4's attention-temperature tuning on NoPE layers reads the padded batch length: the context stops
    below ``floor_scale``, where it scales nothing."""
    from transformers import Llama4TextConfig

    config = Llama4TextConfig(attn_temperature_tuning=True, no_rope_layers=[1, 0], num_hidden_layers=2,
                              floor_scale=64, max_position_embeddings=1024)
    assert loader._batch_invariant_length(config)[0] == 63
    assert loader._batch_invariant_length(Llama4TextConfig(attn_temperature_tuning=False)) is None


@pytest.mark.parametrize("family, value", [("gemma4", "all"), ("gemma3", True)])
def test_an_embedding_style_gemma_is_refused(tmp_path: Path, family: str, value: object) -> None:
    """Gemma 4 with use_bidirectional_attention "all" (Gemma 3: true) attends over the whole sequence both ways:
    served causally its tokens would not be the model's, so it is refused by name ("vision" is served)."""
    from tiny_checkpoints import build_tiny_gemma3, build_tiny_gemma4

    build = build_tiny_gemma4 if family == "gemma4" else build_tiny_gemma3
    path = build(tmp_path / "ckpt", use_bidirectional_attention=value)
    with pytest.raises(ModelLoadError, match="embedding model") as caught:
        create_backend(str(path), "cpu", cpu_settings())
    assert "cannot run on" not in str(caught.value)
    from gemmaserve import LLM

    with pytest.raises(ModelLoadError, match="embedding model") as caught:  # through backend selection too
        LLM(str(path), backend="hf", device="cpu")
    assert "cannot run on" not in str(caught.value)  # a model problem, not the device's
