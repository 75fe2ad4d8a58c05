"""BACKEND=mlx through the core scheduler: parity with mlx_lm and transformers, batch invariance,
prefix reuse, ownership and failure handling."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import mlx.core as mx
import pytest
from mlx_helpers import Arrival, batch_backend, hf_greedy, mlx_lm_greedy, run_scheduled, settings_for

from gemmaserve.errors import InvalidRequestError
from gemmaserve.kv.cache_manager import CacheManager
from gemmaserve.sampling_params import SamplingParams
from gemmaserve.testing.row_driver import solo_greedy

TEXTS = (
    "hello there",
    "the quick brown fox jumps over the lazy dog",
    "Once upon a time, in a small village by the sea, there lived an old fisherman and his dog.",
)
GREEDY = SamplingParams(max_tokens=12)


def _prompts(backend: object) -> list[tuple[int, ...]]:
    return [tuple(backend.tokenizer.encode(text)) for text in TEXTS]  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("name", "mlx_lm_reference"),
    [
        ("gemma4", "gemma4"),
        ("gemma4_per_layer_config", "gemma4"),  # mlx_lm cannot read this config.json by itself
        ("gemma4_multimodal", "gemma4"),  # same weights as gemma4, wrapped as Gemma4ForConditionalGeneration
        ("gemma3_multimodal", "gemma3"),  # gemma3's weights under transformers 5's names, which mlx_lm cannot read
        ("gemma4_k_eq_v", "gemma4_k_eq_v"),
        ("gemma3", "gemma3"),
        ("llama", "llama"),
    ],
)
def test_greedy_matches_mlx_lm_and_transformers(
    checkpoint: Callable[[str], Path], name: str, mlx_lm_reference: str
) -> None:
    model_dir = checkpoint(name)
    backend = batch_backend(model_dir, kv_growth=2)
    prompts = _prompts(backend)
    arrivals = [Arrival(i, f"r{i}", prompt, GREEDY) for i, prompt in enumerate(prompts)]
    # prompts of 3..25 tokens, prefilled in chunks of 5, decoded together; sliding window is 8
    outputs = run_scheduled(backend, arrivals, settings=settings_for(prefill_chunk_tokens=5))
    hf_dir = checkpoint(name.removesuffix("_multimodal")) if name.endswith("_multimodal") else model_dir
    for i, prompt in enumerate(prompts):
        got = outputs[f"r{i}"].token_ids
        assert got == mlx_lm_greedy(checkpoint(mlx_lm_reference), prompt, GREEDY.max_tokens), f"prompt {i}"
        assert got == hf_greedy(hf_dir, prompt, GREEDY.max_tokens), f"prompt {i}"
    backend.check_integrity()
    assert backend.kv_stats()["rows_in_flight"] == 0


@pytest.mark.parametrize("name", ["gemma4_without_layer_types", "gemma3_legacy_rope_type"])
def test_configs_mlx_lm_reads_differently_from_transformers_match_transformers(
    checkpoint: Callable[[str], Path], name: str
) -> None:
    """Sparse or legacy configs whose omitted fields mlx_lm defaults differently from transformers (Gemma 4's
    layer types; a Gemma 3 ``rope_scaling`` with ``type`` only) give transformers' greedy tokens."""
    model_dir = checkpoint(name)
    backend = batch_backend(model_dir, kv_growth=2)
    prompts = _prompts(backend)
    arrivals = [Arrival(i, f"r{i}", prompt, GREEDY) for i, prompt in enumerate(prompts)]
    outputs = run_scheduled(backend, arrivals, settings=settings_for(prefill_chunk_tokens=5))
    for i, prompt in enumerate(prompts):
        assert outputs[f"r{i}"].token_ids == hf_greedy(model_dir, prompt, GREEDY.max_tokens), f"prompt {i}"


def test_eight_requests_joining_and_leaving_match_their_solo_runs(gemma4_dir: Path) -> None:
    backend = batch_backend(gemma4_dir, kv_growth=2)
    encode = backend.tokenizer.encode
    texts = [
        "hi",
        "the lazy dog",
        "Sliding window attention lets each token see only a fixed number of previous tokens.",
        "A key value cache stores",
        "Gemma is a family of lightweight open models built from the same research as Gemini.",
        "Numbers like 1234567890",
        "def forward(self, x):",
        "Once upon a time",
    ]
    arrivals = []
    for i, text in enumerate(texts):
        params = (
            SamplingParams(max_tokens=4 + 3 * (i % 4), temperature=0.9, top_p=0.9, top_k=40, seed=100 + i)
            if i % 3 == 1
            else SamplingParams(max_tokens=4 + 3 * (i % 4), ignore_eos=True)
        )
        arrivals.append(Arrival((i * 3) % 7, f"r{i}", tuple(encode(text)), params))
    settings = settings_for(prefill_chunk_tokens=6, max_batch_size=8)
    together = run_scheduled(backend, arrivals, settings=settings)
    for arrival in arrivals:
        alone = run_scheduled(backend, [Arrival(0, "solo", arrival.prompt, arrival.params)], settings=settings)
        assert together[arrival.request_id].token_ids == alone["solo"].token_ids, arrival.request_id
    assert len({len(out.token_ids) for out in together.values()}) > 1, "rows should leave at different ticks"
    backend.check_integrity()
    assert backend.kv_stats()["rows_in_flight"] == 0


def test_prefix_cache_hits_keep_tokens_identical(gemma4_dir: Path) -> None:
    backend = batch_backend(gemma4_dir)
    long_prompt, other = _prompts(backend)[2], _prompts(backend)[1]
    sibling = (*long_prompt[:9], *other)  # shares two 4-token blocks with long_prompt
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    truth = run_scheduled(backend, [Arrival(0, "a", long_prompt, params), Arrival(0, "b", sibling, params)])

    cache = CacheManager(num_blocks=32, block_size=4)
    backend.set_cache_adapter(cache)
    first = run_scheduled(backend, [Arrival(0, "a", long_prompt, params)], cache=cache)
    again = run_scheduled(
        backend, [Arrival(0, "a", long_prompt, params), Arrival(1, "b", sibling, params)], cache=cache
    )
    assert first["a"].cached_tokens == 0
    assert again["a"].cached_tokens == len(long_prompt) - 1  # a full hit recomputes the last token
    assert again["b"].cached_tokens == 8
    for rid in ("a", "b"):
        assert again[rid].token_ids == truth[rid].token_ids
    assert first["a"].token_ids == truth["a"].token_ids
    cache.check_integrity()
    backend.check_integrity()
    stats = cache.stats()
    assert stats.pinned_blocks == 0 and stats.hit_tokens > 0
    assert backend.kv_stats()["rows_in_flight"] == 0 and backend.kv_stats()["blocks_used"] == stats.used_blocks


def test_prefix_cache_under_eviction_pressure(gemma4_dir: Path) -> None:
    """A pool smaller than the prompts stores what fits, evicts, and never changes tokens."""
    backend = batch_backend(gemma4_dir)
    prompts = _prompts(backend)
    params = SamplingParams(max_tokens=5, ignore_eos=True)
    truth = {p: solo_greedy(backend, p, 5) for p in prompts}
    cache = CacheManager(num_blocks=5, block_size=4)
    backend.set_cache_adapter(cache)
    for round_ in range(2):
        arrivals = [Arrival(i, f"{round_}-{i}", p, params) for i, p in enumerate(prompts)]
        outputs = run_scheduled(backend, arrivals, cache=cache)
        for arrival in arrivals:
            assert outputs[arrival.request_id].token_ids == truth[arrival.prompt]
        cache.check_integrity()
        backend.check_integrity()
    assert cache.stats().evictions > 0 and cache.stats().pinned_blocks == 0


def test_seeded_sampling_is_reproducible_and_seed_dependent(gemma4_dir: Path) -> None:
    backend = batch_backend(gemma4_dir)
    prompt = _prompts(backend)[1]

    def sampled(seed: int) -> list[int]:
        params = SamplingParams(max_tokens=10, temperature=1.0, seed=seed, ignore_eos=True)
        return run_scheduled(backend, [Arrival(0, "s", prompt, params)])["s"].token_ids

    assert sampled(7) == sampled(7)
    assert sampled(7) != sampled(8)


def test_logprobs_are_the_model_log_softmax(gemma4_dir: Path) -> None:
    backend = batch_backend(gemma4_dir)
    prompt = _prompts(backend)[0]
    with backend.lock:
        result = backend.prefill(prompt)
        logits = result.last_logits
        from gemmaserve.sampling_params import RowSampling

        out = backend.sample(logits, [RowSampling(0.0, 1.0, 0, 0, 0)], want_logprobs=True)
        backend.free_row_kv(result.kv)
    expected = (logits - mx.logsumexp(logits, axis=-1, keepdims=True))[0, out.token_ids[0]].item()
    assert out.logprobs is not None and out.logprobs[0] == pytest.approx(expected, abs=1e-5)


def test_sliding_layers_keep_a_bounded_window(gemma4_dir: Path) -> None:
    """Decode past the window: sliding layers hold at most window - 1 + growth columns, full layers
    every token, and the tokens still match mlx_lm's rotating caches."""
    backend = batch_backend(gemma4_dir, kv_growth=2)
    prompt = _prompts(backend)[2]
    window = next(spec.window for spec in backend.layout.layers if spec.window is not None)
    tokens = solo_greedy(backend, prompt, 30)
    assert tokens == mlx_lm_greedy(gemma4_dir, prompt, 30, stop_at_eos=False)
    with backend.lock:
        result = backend.prefill(prompt)
        batch = backend.splice_into_batched(None, result.kv, len(prompt))
        for token in tokens[:20]:
            backend.decode_step_batched(batch, [token])
            for layer in batch.layers:
                limit = backend.kv_length(batch, 0) if layer.window is None else window - 1 + 2 + 1
                assert layer.width <= limit
        assert any(layer.width < backend.kv_length(batch, 0) for layer in batch.layers)
        backend.check_integrity()
        backend.remove_row_from_cache(batch, 0)


def test_invalid_prompts_are_user_errors(gemma4_dir: Path) -> None:
    backend = batch_backend(gemma4_dir)
    with backend.lock:
        with pytest.raises(InvalidRequestError, match="empty"):
            backend.prefill_lookup([])
        with pytest.raises(InvalidRequestError, match="not a token ID"):
            backend.prefill_lookup([5, backend.model_info.vocab_size])
    assert backend.kv_stats()["rows_in_flight"] == 0


def test_kv_handles_have_one_owner(gemma4_dir: Path) -> None:
    backend = batch_backend(gemma4_dir)
    prompt = _prompts(backend)[1]
    with backend.lock:
        row = backend.prefill(prompt).kv
        batch = backend.splice_into_batched(None, row, len(prompt))
        with pytest.raises(RuntimeError, match="consumed"):
            backend.kv_length(row)
        with pytest.raises(RuntimeError, match="spliced"):
            backend.free_row_kv(row)
        spare = backend.prefill(prompt).kv
        backend.free_row_kv(spare)
        backend.free_row_kv(spare)  # idempotent
        with pytest.raises(RuntimeError, match="freed"):
            backend.splice_into_batched(batch, spare, len(prompt))
        with pytest.raises(IndexError):
            backend.remove_row_from_cache(batch, 1)
        backend.remove_row_from_cache(batch, 0)
    backend.check_integrity()
    assert backend.kv_stats()["rows_in_flight"] == 0


def test_failed_decode_leaves_rows_removable(gemma4_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    backend = batch_backend(gemma4_dir)
    prompts = _prompts(backend)
    with backend.lock:
        batch = None
        for prompt in prompts:
            result = backend.prefill(prompt)
            batch = backend.splice_into_batched(batch, result.kv, len(prompt))
        real_decode = backend._runner.decode

        def failing(tokens: mx.array, cache: list) -> mx.array:
            cache[0].update_and_fetch(*(2 * [mx.zeros((len(prompts), 2, 1, 16))]))  # one layer advanced
            raise RuntimeError("simulated device failure")

        monkeypatch.setattr(backend._runner, "decode", failing)
        with pytest.raises(RuntimeError, match="simulated"):
            backend.decode_step_batched(batch, [p[-1] for p in prompts])
        monkeypatch.setattr(backend._runner, "decode", real_decode)
        with pytest.raises(RuntimeError, match="broken"):
            backend.decode_step_batched(batch, [p[-1] for p in prompts])
        for index in (1, 1, 0):
            backend.remove_row_from_cache(batch, index)
    backend.check_integrity()
    assert backend.kv_stats()["rows_in_flight"] == 0
    assert solo_greedy(backend, prompts[0], 3) == mlx_lm_greedy(gemma4_dir, prompts[0], 3)


@pytest.mark.parametrize("name", ["gemma4", "gemma3", "llama", "gemma4_multimodal"])
def test_prefill_projects_only_the_last_position(checkpoint: Callable[[str], Path], name: str) -> None:
    """The runner's decoder/head split (last position only) is in use and equals the full forward."""
    from mlx_lm.models.cache import make_prompt_cache

    backend = batch_backend(checkpoint(name))
    runner = backend._runner
    assert runner.uses_split
    tokens = mx.array([list(_prompts(backend)[1])])
    full = runner.model(tokens, cache=make_prompt_cache(runner.model))[:, -1, :]
    last = runner.prefill(tokens, make_prompt_cache(runner.model), want_logits=True)
    assert last is not None and mx.allclose(full, last, atol=1e-4).item()
