"""The hf backend under the real core scheduler: concurrent requests admitted at different ticks,
chunked prefill, prefix-cache hits on a second pass, seeded sampling independent of the batch."""

from __future__ import annotations

from collections.abc import Sequence

from hf_support import cpu_settings
from hf_checkpoints import SLIDING_WINDOW, hf_greedy

from gemmaserve.engine.request import FinishReason, Request, RequestOutput
from gemmaserve.engine.scheduler import ContinuousBatchScheduler
from gemmaserve.kv.cache_manager import CacheManager
from gemmaserve.sampling_params import SamplingParams
from gemmaserve.testing.row_driver import solo_greedy
from gemmaserve_hf_torch.backend import HFTorchBackend

BLOCK = 4
# (arrival tick, prompt, max_tokens): 8 requests, lengths 3..40 (most longer than the window of 8)
PROMPTS: list[tuple[int, list[int], int]] = [
    (0, [5, 6, 7], 10),
    (0, list(range(100, 140)), 6),
    (1, list(range(200, 213)), 12),
    (2, [9] * 9, 5),
    (4, list(range(300, 327)), 9),
    (5, list(range(150, 167)), 7),
    (7, [42, 43, 44, 45, 46], 11),
    (9, list(range(400, 431)), 8),
]


def run(backend: HFTorchBackend, arrivals: Sequence[tuple[int, Request]], **settings: object) -> dict[str, RequestOutput]:
    """Feed requests at their arrival ticks and step until all finish; integrity checked every tick."""
    scheduler = ContinuousBatchScheduler(
        backend,
        cpu_settings(**{"max_batch_size": 8, "prefill_chunk_tokens": 7, **settings}),
        backend.cache_manager,
    )
    pending = sorted(arrivals, key=lambda item: item[0])
    outputs: dict[str, RequestOutput] = {}
    tick = 0
    while pending or scheduler.has_work:
        while pending and pending[0][0] <= tick:
            scheduler.add_request(pending.pop(0)[1])
        for event in scheduler.step():
            if event.finished:
                assert event.output is not None
                outputs[event.request_id] = event.output
        scheduler.check_integrity()
        backend.check_integrity()
        tick += 1
        assert tick < 500, "scheduler made no progress"
    return outputs


def greedy_requests(tag: str, prompts: Sequence[tuple[int, list[int], int]]) -> list[tuple[int, Request]]:
    return [
        (tick, Request(f"{tag}{i}", tuple(prompt), SamplingParams(max_tokens=n, ignore_eos=True)))
        for i, (tick, prompt, n) in enumerate(prompts)
    ]


def test_eight_concurrent_requests_equal_solo_runs_and_generate(any_backend: HFTorchBackend) -> None:
    assert sum(len(p) > SLIDING_WINDOW for _, p, _ in PROMPTS) >= 6
    outputs = run(any_backend, greedy_requests("r", PROMPTS))
    model = any_backend.loaded.model
    for i, (_, prompt, n) in enumerate(PROMPTS):
        output = outputs[f"r{i}"]
        assert output.finish_reason is FinishReason.LENGTH
        assert output.token_ids == hf_greedy(model, prompt, n), f"request {i} differs from model.generate"
        assert output.token_ids == solo_greedy(any_backend, prompt, n), f"request {i} differs from its solo run"


def test_second_pass_hits_the_prefix_cache_with_the_same_tokens(gemma4_backend: HFTorchBackend) -> None:
    backend = gemma4_backend
    backend.set_cache_adapter(CacheManager(num_blocks=128, block_size=BLOCK))
    first = run(backend, greedy_requests("a", PROMPTS))
    assert all(output.cached_tokens == 0 for output in first.values())
    # second pass: the same prompts (full hits) plus variants sharing a prefix (partial hits)
    variants = [
        (0, PROMPTS[1][1][:22] + [7, 7, 7], 6),  # shares 22 tokens -> 5 whole blocks = 20
        (1, PROMPTS[4][1] + [1, 2, 3, 4, 5], 6),  # extends a stored 27-token prompt -> 6 blocks = 24
        (2, PROMPTS[2][1][:10], 6),  # a strict prefix of a stored prompt -> 2 blocks = 8
    ]
    second = run(backend, greedy_requests("b", [(tick % 3, p, n) for tick, p, n in PROMPTS] + variants))
    for i, (_, prompt, _) in enumerate(PROMPTS):
        assert second[f"b{i}"].cached_tokens == len(prompt) - 1, "a full hit recomputes only the last token"
        assert second[f"b{i}"].token_ids == first[f"a{i}"].token_ids
    assert [second[f"b{len(PROMPTS) + j}"].cached_tokens for j in range(3)] == [20, 24, 8]
    model = backend.loaded.model
    for j, (_, prompt, n) in enumerate(variants):
        assert second[f"b{len(PROMPTS) + j}"].token_ids == hf_greedy(model, prompt, n)
    stats = backend.cache_manager.stats()
    assert stats.full_hits == len(PROMPTS) and stats.pinned_blocks == 0


def test_tiny_prefix_pool_stores_what_fits_and_stays_exact(llama_backend: HFTorchBackend) -> None:
    llama_backend.set_cache_adapter(CacheManager(num_blocks=5, block_size=BLOCK))
    prompts = PROMPTS[:5]  # together they need 27 blocks; every store evicts, some store only a prefix
    first = run(llama_backend, greedy_requests("a", prompts))
    # second pass in reverse, so the prompt stored last (index 4, 27 tokens) is looked up first
    second = run(llama_backend, greedy_requests("b", [(4 - tick, p, n) for tick, p, n in prompts]))
    model = llama_backend.loaded.model
    for i, (_, prompt, n) in enumerate(prompts):
        assert first[f"a{i}"].token_ids == second[f"b{i}"].token_ids == hf_greedy(model, prompt, n)
    assert 0 < second["b4"].cached_tokens < len(prompts[4][1]) - 1, "a partial (prefix-only) store hits"
    assert llama_backend.cache_manager.stats().used_blocks <= 5


def test_seeded_sampling_does_not_depend_on_the_batch(gemma4_backend: HFTorchBackend) -> None:
    params = SamplingParams(max_tokens=8, temperature=0.9, top_p=0.9, top_k=50, seed=1234, ignore_eos=True)

    def target_tokens(others: int) -> RequestOutput:
        target = Request("target", tuple(range(60, 80)), params, want_logprobs=True)
        noise = [
            (i % 3, Request(f"n{i}", tuple(range(200 + i, 215 + 2 * i)), SamplingParams(max_tokens=10, temperature=1.2, seed=i)))
            for i in range(others)
        ]
        return run(gemma4_backend, [(1, target), *noise])["target"]

    alone, crowded = target_tokens(0), target_tokens(7)
    assert alone.token_ids == crowded.token_ids
    assert alone.token_ids != hf_greedy(gemma4_backend.loaded.model, list(range(60, 80)), 8), "not actually sampled"
    assert alone.logprobs is not None and len(alone.logprobs) == 8 and all(lp <= 0.0 for lp in alone.logprobs)
    other_seed = SamplingParams(max_tokens=8, temperature=0.9, top_p=0.9, top_k=50, seed=99, ignore_eos=True)
    reseeded = run(gemma4_backend, [(0, Request("t2", tuple(range(60, 80)), other_seed))])["t2"]
    assert reseeded.token_ids != alone.token_ids, "the seed has no effect"
