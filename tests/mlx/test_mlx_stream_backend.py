"""BACKEND=mlx-stream: greedy parity with mlx_lm, the streaming-only contract, KV reuse across
streams, seeded sampling shared with BACKEND=mlx, and the scheduler's streaming path."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from mlx_helpers import Arrival, batch_backend, mlx_lm_greedy, run_scheduled, settings_for, stream_backend

from gemmaserve.errors import GemmaserveError, InvalidRequestError
from gemmaserve.sampling_params import SamplingParams
from gemmaserve.testing.row_driver import solo_greedy

from gemmaserve_mlx.stream_backend import StreamingOnlyError

TEXT = "Once upon a time, in a small village by the sea, there lived an old fisherman and his dog."


def test_greedy_equals_mlx_lm_generate_through_the_scheduler(checkpoint: Callable[[str], Path]) -> None:
    for name in ("gemma4", "llama"):
        backend = stream_backend(checkpoint(name))
        prompts = [tuple(backend.tokenizer.encode(t)) for t in ("hello there", TEXT)]
        params = SamplingParams(max_tokens=14)
        arrivals = [Arrival(i, f"r{i}", p, params) for i, p in enumerate(prompts)]
        outputs = run_scheduled(backend, arrivals, settings=settings_for(backend="mlx-stream"))
        for i, prompt in enumerate(prompts):
            assert outputs[f"r{i}"].token_ids == mlx_lm_greedy(checkpoint(name), prompt, 14), (name, i)
        backend.check_integrity()
        assert backend.kv_stats()["streams_active"] == 0


def test_stream_ignores_eos_and_matches_the_batched_backend(gemma4_dir: Path) -> None:
    stream = stream_backend(gemma4_dir)
    prompt = stream.tokenizer.encode(TEXT)
    tokens = list(stream.generate_stream(prompt, SamplingParams(max_tokens=30, ignore_eos=True)))
    assert tokens == mlx_lm_greedy(gemma4_dir, prompt, 30, stop_at_eos=False)
    assert tokens == solo_greedy(batch_backend(gemma4_dir), prompt, 30)


def test_seeded_sampling_matches_the_batched_backend(gemma4_dir: Path) -> None:
    """Both backends draw token ``step`` of a seeded row from the same (seed, step) key."""
    stream = stream_backend(gemma4_dir, prompt_caches=0)
    prompt = tuple(stream.tokenizer.encode(TEXT))
    for seed in (3, 4):
        params = SamplingParams(max_tokens=10, temperature=0.8, top_k=50, top_p=0.95, seed=seed, ignore_eos=True)
        streamed = list(stream.generate_stream(prompt, params))
        assert streamed == list(stream.generate_stream(prompt, params))
        batched = run_scheduled(batch_backend(gemma4_dir), [Arrival(0, "s", prompt, params)])["s"].token_ids
        assert streamed == batched


def test_batch_primitives_say_streaming_only(gemma4_dir: Path) -> None:
    backend = stream_backend(gemma4_dir)
    assert not backend.capabilities.continuous_batching
    for call in (
        lambda: backend.prefill_lookup([1, 2]),
        lambda: backend.decode_step_batched(None, [1]),
        lambda: backend.splice_into_batched(None, None, 0),
        lambda: backend.kv_length(None),
    ):
        with pytest.raises(StreamingOnlyError, match="streaming-only") as info:
            call()
        assert isinstance(info.value, NotImplementedError) and isinstance(info.value, GemmaserveError)
    with pytest.raises(InvalidRequestError):
        backend.generate_stream([backend.model_info.vocab_size], SamplingParams())


@pytest.mark.parametrize("name", ["llama", "gemma4"])
def test_follow_up_requests_reuse_the_previous_kv(checkpoint: Callable[[str], Path], name: str) -> None:
    """A follow-up that extends prompt + answer reuses all of it; a diverging prompt reuses the common
    prefix when every cache can be trimmed (Llama), else nothing once Gemma's sliding caches
    rotated. Tokens always equal a fresh stream's."""
    model_dir = checkpoint(name)
    backend, fresh = stream_backend(model_dir), stream_backend(model_dir, prompt_caches=0)
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    first_prompt = tuple(backend.tokenizer.encode(TEXT))
    first = list(backend.generate_stream(first_prompt, params, session_id="chat"))
    assert backend.last_cache_hit_tokens == 0

    follow_up = (*first_prompt, *first, *backend.tokenizer.encode(" and then"))
    second = list(backend.generate_stream(follow_up, params, session_id="chat-2"))
    assert backend.last_cache_hit_tokens == len(first_prompt) + len(first)
    assert second == list(fresh.generate_stream(follow_up, params))

    diverging = (*first_prompt[:10], *backend.tokenizer.encode(" a cat"))
    third = list(backend.generate_stream(diverging, params, session_id="other"))
    assert backend.last_cache_hit_tokens == (10 if name == "llama" else 0)
    assert third == list(fresh.generate_stream(diverging, params))
    backend.check_integrity()
    kept = 1 if name == "llama" else 2  # Llama's third stream took (and trimmed) the second one's KV
    assert backend.kv_stats()["prompt_caches"] == kept and fresh.kv_stats()["prompt_caches"] == 0


def test_abandoned_stream_keeps_consistent_kv(gemma4_dir: Path) -> None:
    """A client that stops after three tokens leaves KV for exactly prompt + those tokens."""
    backend, fresh = stream_backend(gemma4_dir), stream_backend(gemma4_dir, prompt_caches=0)
    prompt = tuple(backend.tokenizer.encode("the quick brown fox"))
    stream = backend.generate_stream(prompt, SamplingParams(max_tokens=20, ignore_eos=True), session_id="s")
    head = [next(stream) for _ in range(3)]
    stream.close()
    backend.check_integrity()
    assert backend.kv_stats() == {"prompt_caches": 1, "streams_active": 0}
    follow_up = (*prompt, *head, *backend.tokenizer.encode(" jumps"))
    params = SamplingParams(max_tokens=5, ignore_eos=True)
    resumed = list(backend.generate_stream(follow_up, params, session_id="s"))
    assert backend.last_cache_hit_tokens == len(prompt) + 3
    assert resumed == list(fresh.generate_stream(follow_up, params))
