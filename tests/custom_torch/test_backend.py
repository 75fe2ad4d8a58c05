"""CustomTorchBackend end to end: the core contract suite, greedy parity with transformers, any interleaving
of requests through ContinuousBatchScheduler, sampling semantics, plugin/probe/selection, settings, tokenizer."""

from __future__ import annotations

import json
import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fixtures_backend import assert_matches_hf_generate, assert_no_leaks, contiguous_greedy, make_backend, run_scheduler
from fixtures_backend import one_torch_thread  # noqa: F401  (autouse)
from gemmaserve.engine.request import FinishReason
from gemmaserve.engine.sampling_cpu import sample_row
from gemmaserve.errors import ConfigurationError, InvalidRequestError
from gemmaserve.registry import BackendRegistry
from gemmaserve.sampling_params import RowSampling
from gemmaserve.selection import select_backend
from gemmaserve.settings import CoreSettings
from gemmaserve.testing.backend_contract import BackendContractTests
from gemmaserve.testing.row_driver import solo_greedy
from gemmaserve_custom_torch import plugin
from gemmaserve_custom_torch.backend import create_backend
from gemmaserve_custom_torch.probe import unavailable_reason
from gemmaserve_custom_torch.sampling import sample_tokens
from gemmaserve_custom_torch.settings import load_custom_settings, resolve_attention


class TestCustomTorchContract(BackendContractTests):
    property_examples = 10

    @pytest.fixture
    def backend(self, tiny_gemma4_dir):
        backend = make_backend(tiny_gemma4_dir)
        yield backend
        backend.close()

    def fresh_prefix_cache(self, backend):
        """The suite attaches a *fresh* core cache here; this backend caches internally (set_cache_adapter is
        a no-op), so the equivalent is emptying its own prefix cache."""
        backend.prefix_cache.clear()
        assert len(backend.prefix_cache.radix) == 0
        return None


class TestCustomTorchSeparateStepsContract(TestCustomTorchContract):
    """The same suite with CUSTOM_BACKEND_MIXED_STEP=0 (prefill_chunks and decode as separate calls)."""

    @pytest.fixture
    def backend(self, tiny_gemma4_dir):
        backend = make_backend(tiny_gemma4_dir, mixed_step=False)
        yield backend
        backend.close()


@pytest.mark.parametrize("name", ["gemma4", "gemma3", "gemma4_k_eq_v", "gemma4_moe"])
def test_greedy_through_primitives_equals_transformers_generate(tiny_checkpoint, hf_reference, name):
    path = tiny_checkpoint(name)
    backend = make_backend(path)
    hf = hf_reference(path, torch.float32)
    for prompt in ([2, 40, 41, 42], [(5 * i + 9) % 500 + 4 for i in range(29)]):  # short; several windows
        assert_matches_hf_generate(hf, prompt, solo_greedy(backend, prompt, 12))
    assert_no_leaks(backend)


_ALPHABET = [4, 5, 6]


@settings(max_examples=12, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(
    requests=st.lists(
        st.tuples(
            st.lists(st.sampled_from(_ALPHABET), min_size=1, max_size=22).map(tuple),  # repeats -> prefix hits
            st.integers(0, 6),  # arrival tick
            st.integers(1, 7),  # max_tokens
        ),
        min_size=1,
        max_size=6,
    ),
    chunk=st.sampled_from([2, 5, 64]),
    max_batch_size=st.integers(1, 4),
    kv_blocks=st.sampled_from([14, 40]),
)
def test_any_interleaving_gives_every_request_its_solo_tokens(
    tiny_gemma4_dir, requests, chunk, max_batch_size, kv_blocks
):
    backend = make_backend(tiny_gemma4_dir, kv_blocks=kv_blocks, sliding_blocks=8)
    done = run_scheduler(backend, requests, max_batch_size=max_batch_size, prefill_chunk_tokens=chunk)
    for rid, (prompt, _, max_tokens) in zip(done, requests):
        request = done[rid]
        assert request.finish_reason is FinishReason.LENGTH, (request.error_type, request.error)
        assert request.output_token_ids == _solo(tiny_gemma4_dir, prompt, 7)[:max_tokens]
    assert_no_leaks(backend)


_SOLO: dict[tuple, list[int]] = {}


def _solo(path, prompt, n):
    key = (str(path), tuple(prompt), n)
    if key not in _SOLO:
        _SOLO[key] = contiguous_greedy(make_backend(path).model, prompt, n)
    return _SOLO[key]


def test_sampling_matches_the_core_reference_semantics():
    rng = random.Random(0)
    logits = torch.randn(64, 50, generator=torch.Generator().manual_seed(0)) * 3
    logits[5, :] = 0.0  # all ties
    rows = [
        RowSampling(rng.choice([0.0, 0.3, 0.9, 1.7]), rng.choice([1.0, 0.9, 0.5, 0.05]), rng.choice([0, 1, 5, 50]),
                    rng.randrange(2**63), rng.randrange(100))
        for _ in range(64)
    ]
    got = sample_tokens(logits, rows, want_logprobs=True)
    for i, row in enumerate(rows):
        token, logprob = sample_row(logits[i].double().tolist(), row, want_logprob=True)
        assert got.token_ids[i] == token, (i, row)
        assert abs(got.logprobs[i] - logprob) < 1e-9
    alone = sample_tokens(logits[7:8], rows[7:8])  # a row's token ignores the rest of the batch
    assert alone.token_ids == got.token_ids[7:8]


def test_plugin_registers_three_device_specs():
    specs = {}
    plugin.gemmaserve_register_backends(lambda spec: specs.__setitem__(spec.name, spec))
    assert {n: (s.devices, s.priority) for n, s in specs.items()} == {
        "custom-cuda": (("cuda",), 10), "custom-mps": (("mps",), 30), "custom-cpu": (("cpu",), 60)
    }
    assert {s.factory for s in specs.values()} == {"gemmaserve_custom_torch.backend:create_backend"}
    assert {s.probe for s in specs.values()} == {"gemmaserve_custom_torch.probe:unavailable_reason"}


def test_explicit_backend_picks_its_device(tiny_gemma4_dir):
    registry = BackendRegistry()
    for spec in plugin.SPECS:
        registry.add(spec, "gemmaserve-custom-torch")  # first-party names are reserved for their distribution
    selection = select_backend(CoreSettings(backend="custom-cpu", model=str(tiny_gemma4_dir)), registry)
    assert (selection.spec.name, selection.device) == ("custom-cpu", "cpu")
    assert select_backend(CoreSettings(backend="auto", device="cpu"), registry).spec.name == "custom-cpu"


def test_probe_reports_architecture_device_and_missing_config(tiny_gemma4_dir, tiny_gemma3_dir, tmp_path):
    assert unavailable_reason(CoreSettings(model=str(tiny_gemma4_dir)), "cpu") is None
    assert unavailable_reason(CoreSettings(model=str(tiny_gemma3_dir)), "cpu") is None
    assert unavailable_reason(CoreSettings(), "cpu") is None  # the default model is a Gemma 3
    assert "no config.json" in unavailable_reason(CoreSettings(model=str(tmp_path)), "cpu")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    reason = unavailable_reason(CoreSettings(model=str(tmp_path)), "cpu")
    assert "unsupported architecture 'llama'" in reason and "gemma4_text" in reason
    if not torch.cuda.is_available():
        assert "CUDA" in unavailable_reason(CoreSettings(), "cuda")


def test_settings_from_env_and_validation(monkeypatch):
    monkeypatch.setenv("CUSTOM_BACKEND_KV_BLOCKS", "123")
    monkeypatch.setenv("CUSTOM_BACKEND_ATTENTION", "gather")
    monkeypatch.setenv("CUSTOM_BACKEND_CUDA_GRAPH", "0")
    s = load_custom_settings()
    assert (s.kv_blocks, s.attention, s.cuda_graph, s.block_size) == (123, "gather", False, None)
    assert not s.compile and not s.explain
    monkeypatch.setenv("CUSTOM_BACKEND_KV_MEMORY_GB", "1.5")
    with pytest.raises(ConfigurationError, match="only one of"):
        load_custom_settings()
    monkeypatch.delenv("CUSTOM_BACKEND_KV_MEMORY_GB")
    for name, value in (("ATTENTION", "flash"), ("KV_BLOCKS", "0"), ("BLOCK_SIZE", "4096"), ("SLIDING_BLOCKS", "-1")):
        monkeypatch.setenv(f"CUSTOM_BACKEND_{name}", value)
        with pytest.raises(ConfigurationError, match=f"CUSTOM_BACKEND_{name}="):
            load_custom_settings()
        monkeypatch.delenv(f"CUSTOM_BACKEND_{name}")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert resolve_attention("auto", "cpu", True) == "gather"
    assert resolve_attention("auto", "cuda", True) == "triton"
    assert resolve_attention("auto", "cuda", False) == "gather"
    with pytest.raises(ConfigurationError, match="needs a CUDA device"):
        resolve_attention("triton", "cpu", True)


def test_a_misspelt_custom_backend_variable_is_refused_with_the_closest_name(monkeypatch, tmp_path):
    """A CUSTOM_BACKEND_* variable that names no setting (in the environment or the .env file) is refused, naming
    it and the setting it was probably meant to be, instead of being ignored (the graphs would stay on)."""
    monkeypatch.setenv("CUSTOM_BACKEND_CUDA_GRAPHS", "0")
    with pytest.raises(ConfigurationError, match=r"CUSTOM_BACKEND_CUDA_GRAPHS is not a setting \(did you mean "
                                                 r"CUSTOM_BACKEND_CUDA_GRAPH\?\)"):
        load_custom_settings()
    monkeypatch.delenv("CUSTOM_BACKEND_CUDA_GRAPHS")
    monkeypatch.setenv("custom_backend_cuda_graph", "0")  # names are case-insensitive, as pydantic-settings reads
    assert load_custom_settings().cuda_graph is False
    monkeypatch.delenv("custom_backend_cuda_graph")
    monkeypatch.chdir(tmp_path)
    (tmp_path / ".env").write_text("CUSTOM_BACKEND_KV_BLOKS=12\n")
    with pytest.raises(ConfigurationError, match="CUSTOM_BACKEND_KV_BLOKS is not a setting .*CUSTOM_BACKEND_KV_BLOCKS"):
        load_custom_settings()
    (tmp_path / ".env").write_text("CUSTOM_BACKEND_KV_BLOCKS=12\n")
    assert load_custom_settings().kv_blocks == 12


def test_an_override_that_names_no_setting_is_refused() -> None:
    """``load_custom_settings(**overrides)`` (and every settings loader: one construction path) refuses a keyword
    that names no field, listing the accepted ones, instead of the settings class dropping it (a removed setting
    such as ``in_place_reduce`` passed from a script would do nothing)."""
    with pytest.raises(ConfigurationError, match=r"no setting named in_place_reduce; accepted: .*pdl.*skinny_max_rows"):
        load_custom_settings(in_place_reduce=True)
    assert load_custom_settings(pdl=None, skinny_max_rows=4).skinny_max_rows == 4  # None: not given


@pytest.mark.parametrize("field, value", [("vocab_size", 600), ("hidden_size", 40)])
def test_a_config_that_disagrees_with_the_weights_is_a_load_error_naming_both(tiny_gemma4_dir, tmp_path, field, value):
    """config.json edited away from the weights (a size the tensors do not have): ModelLoadError naming the weight,
    its shape in the checkpoint and the shape config.json implies, not load_state_dict's RuntimeError."""
    import shutil

    from gemmaserve.errors import ModelLoadError

    folder = tmp_path / "edited"
    shutil.copytree(tiny_gemma4_dir, folder)
    config = json.loads((folder / "config.json").read_text())
    target = config.get("text_config", config)
    target[field] = value
    (folder / "config.json").write_text(json.dumps(config))
    settings = CoreSettings(model=str(folder), device="cpu", dtype="float32", max_batch_size=2)
    with pytest.raises(ModelLoadError, match=r"config.json disagrees with the weights \(.* in the checkpoint but .* by "
                                             r"config.json"):
        create_backend(str(folder), "cpu", settings)


def test_factory_reads_env_and_budget_errors_are_clear(tiny_gemma4_dir, monkeypatch):
    monkeypatch.setenv("CUSTOM_BACKEND_KV_BLOCKS", "10")
    monkeypatch.setenv("CUSTOM_BACKEND_BLOCK_SIZE", "8")
    settings = CoreSettings(model=str(tiny_gemma4_dir), device="cpu", dtype="float32", max_batch_size=2)
    backend = create_backend(str(tiny_gemma4_dir), "cpu", settings)
    assert backend.block_size == 8 and backend.capabilities.kv_reservation
    assert not backend.capabilities.uses_core_cache_manager and backend.capabilities.logprobs
    assert backend.model_info.eos_token_ids == (1,) and backend.model_info.device == "cpu"
    # 10 uniform blocks cannot hold MAX_ACTIVE_KV_TOKENS (65536), so the default split balances the pools at the
    # longest request 2 rows fit: their windows, 2 x (ceil(8/8) + 1), no chunk headroom; the full pool the rest
    assert backend.pools.managers["sliding_attention"].num_blocks == 4
    assert backend.pool_reference_tokens > 8
    backend.set_cache_adapter(None)  # no-op: it caches internally
    assert backend.kv_stats()["blocks_total"] > 0
    monkeypatch.setenv("CUSTOM_BACKEND_SLIDING_BLOCKS", "1000")
    with pytest.raises(ConfigurationError, match="SLIDING_BLOCKS=1000 uses the whole KV budget"):
        create_backend(str(tiny_gemma4_dir), "cpu", settings)


def test_tokenizer_wrapper(tiny_gemma4_dir):
    backend = make_backend(tiny_gemma4_dir)
    tok = backend.tokenizer
    ids = tok.encode("the quick brown fox", add_special_tokens=False)
    assert tok.decode(ids) == "the quick brown fox"
    assert not tok.has_chat_template
    with pytest.raises(InvalidRequestError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])
    with pytest.raises(InvalidRequestError, match="empty"):
        backend.prefill_lookup([])


@pytest.mark.parametrize("name", ["gemma4", "gemma3"])
def test_bf16_greedy_through_paged_backend_equals_transformers_bf16(tiny_checkpoint, hf_reference, name):
    """The portable path (eager prefill, paged pools, gathered decode) in bf16 gives transformers'
    bf16 eager greedy tokens, for short and several-windows-long prompts."""
    from gemmaserve_custom_torch.backend import CustomTorchBackend
    from gemmaserve_custom_torch.models.gemma import GemmaForCausalLM
    from gemmaserve_custom_torch.tokenizer import HFTokenizer

    path = tiny_checkpoint(name)
    model = GemmaForCausalLM.from_hf(path, dtype=torch.bfloat16)
    core = CoreSettings(model=str(path), device="cpu", dtype="bfloat16", kv_block_size=4, prefill_chunk_tokens=16)
    backend = CustomTorchBackend(model, HFTokenizer.from_pretrained(path), core, load_custom_settings(kv_blocks=96))
    hf = hf_reference(path, torch.bfloat16)
    for prompt in ([2, 40, 41, 42], [(5 * i + 9) % 500 + 4 for i in range(29)]):
        assert_matches_hf_generate(hf, prompt, solo_greedy(backend, prompt, 12))
    assert_no_leaks(backend)


@pytest.mark.parametrize("native_bf16", [False, True])
def test_auto_dtype_is_bfloat16_except_on_cpus_without_bfloat16_instructions(
    monkeypatch: pytest.MonkeyPatch, native_bf16: bool
) -> None:
    from gemmaserve_custom_torch.backend import auto_dtype

    monkeypatch.setattr("gemmaserve_custom_torch.backend.cpu_has_native_bfloat16", lambda: native_bf16)
    assert auto_dtype("cpu") == (torch.bfloat16 if native_bf16 else torch.float32)
    assert auto_dtype("cuda") == torch.bfloat16 and auto_dtype("mps") == torch.bfloat16


def test_offline_text_equals_the_streamed_text_when_a_reply_ends_inside_a_character(tiny_gemma4_dir) -> None:
    """``LLM.generate`` without stop strings detokenizes as streaming does (one U+FFFD for a character the last
    tokens leave unfinished, the prompt's last tokens as context), so its text equals ``LLM.stream``'s and that of
    ``generate`` with a stop string that never matches (a byte-level decode of the whole reply wrote one U+FFFD per
    byte)."""
    from gemmaserve import LLM, SamplingParams

    with LLM(str(tiny_gemma4_dir), backend="custom-cpu", device="cpu", dtype="float32") as model:
        unfinished = 0
        for max_tokens in range(14, 24):
            params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
            plain = model.generate("The quick brown fox", params)[0]
            stopped = model.generate("The quick brown fox", SamplingParams(max_tokens=max_tokens, ignore_eos=True,
                                                                           stop=["\u2603"]))[0]
            streamed = "".join(chunk.text for chunk in model.stream("The quick brown fox", params))
            assert plain.text == stopped.text == streamed, max_tokens
            unfinished += plain.text.endswith("\ufffd")
        assert unfinished, "no reply ended inside a character: the case this test is for did not occur"
