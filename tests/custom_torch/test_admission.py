"""Window-aware admission: per-pool footprints, the equal-memory demonstration (more concurrent long
requests than uniform pools), rejections, and pool exhaustion that never takes the engine down."""

from __future__ import annotations

import pytest

from fixtures_backend import FULL, SLIDING, assert_no_leaks, contiguous_greedy, make_backend, run_scheduler
from fixtures_backend import one_torch_thread  # noqa: F401  (autouse)
from gemmaserve.errors import InvalidRequestError, KVCapacityError
from gemmaserve.engine.request import FinishReason
from gemmaserve_custom_torch.kv import GroupGeometry, KVAdmission, kv_groups, plan_pool_sizes
from gemmaserve_custom_torch.models import GemmaTextConfig

E2B_TEXT = {  # Gemma 4 E2B geometry (gemma4-spec.md §4); only the KV layout matters here
    "model_type": "gemma4_text", "hidden_size": 1536, "num_hidden_layers": 35, "num_attention_heads": 8,
    "num_key_value_heads": 1, "head_dim": 256, "global_head_dim": 512, "intermediate_size": 6144,
    "layer_types": ["sliding_attention"] * 4 + ["full_attention"], "num_kv_shared_layers": 20,
    "sliding_window": 512, "use_double_wide_mlp": True,
}


def _admitted(capacity, geometry, num_tokens):
    admission = KVAdmission(geometry, capacity)
    count = 0
    while admission.reserve(f"r{count}", num_tokens):
        count += 1
    admission.check_integrity()
    return count


def test_e2b_equal_memory_window_aware_admits_more_long_requests():
    config = GemmaTextConfig.from_dict({**E2B_TEXT, "layer_types": E2B_TEXT["layer_types"] * 7})
    groups = kv_groups(config)
    assert [(g.name, len(g.layers)) for g in groups] == [(SLIDING, 12), (FULL, 3)]
    bs, itemsize, num_tokens = 16, 2, 1000  # bf16, 1000-token requests (prompt + max_tokens)
    per_block = sum(g.bytes_per_block(bs, itemsize) for g in groups)
    budget = 1386 * per_block  # ~389 MiB: uniform pools of 1386 blocks each
    geometry = {g.name: GroupGeometry(bs, g.window) for g in groups}
    assert KVAdmission(geometry, {SLIDING: 1, FULL: 1}).footprint(num_tokens) == {SLIDING: 33, FULL: 63}
    limits = {"max_rows": 32, "max_active_tokens": 32 * num_tokens, "max_len": num_tokens}
    uniform = plan_pool_sizes(groups, bs, itemsize, budget, sliding_blocks=1386, **limits)
    aware = plan_pool_sizes(groups, bs, itemsize, budget, sliding_blocks=None, **limits)
    for sizes in (uniform, aware):
        assert sum(sizes[g.name] * g.bytes_per_block(bs, itemsize) for g in groups) <= budget
    n_uniform, n_aware = _admitted(uniform, geometry, num_tokens), _admitted(aware, geometry, num_tokens)
    print(f"\nE2B-like, {budget / 2**20:.0f} MiB of KV, {num_tokens}-token requests: uniform pools {uniform} "
          f"admit {n_uniform}; window-aware {aware} admit {n_aware}")
    assert (n_uniform, n_aware) == (22, 32)


def test_tiny_model_equal_memory_runs_more_requests_concurrently(tiny_gemma4_dir):
    """End to end through ContinuousBatchScheduler: same KV memory, 8 requests of 40 + 20 tokens."""
    prompts = [[(19 * i + 5 * j) % 500 + 4 for i in range(40)] for j in range(8)]
    model = make_backend(tiny_gemma4_dir).model
    expected = {f"r{j}": contiguous_greedy(model, p, 20) for j, p in enumerate(prompts)}
    peaks = {}
    for label, sliding in (("uniform", 60), ("window-aware", None)):
        backend = make_backend(tiny_gemma4_dir, kv_blocks=60, sliding_blocks=sliding)
        peak = 0
        original = backend.kv_reserve

        def reserve(request_id, num_tokens, _orig=original, _b=backend):
            nonlocal peak
            ok = _orig(request_id, num_tokens)
            peak = max(peak, len(_b.admission))
            return ok

        backend.kv_reserve = reserve  # type: ignore[method-assign]
        done = run_scheduler(backend, [(p, 0, 20) for p in prompts], prefill_chunk_tokens=64)
        assert all(r.finish_reason is FinishReason.LENGTH for r in done.values())
        assert {rid: r.output_token_ids for rid, r in done.items()} == expected
        assert_no_leaks(backend)
        peaks[label] = (peak, {g: m.num_blocks for g, m in backend.pools.managers.items()})
    print(f"\ntiny Gemma 4 (W=8, bs=4), 60 uniform blocks of KV, 60-token requests: {peaks}")
    # the memory is tight (MAX_ACTIVE_KV_TOKENS is 100k), so the default split balances the pools at the longest
    # request length at which MAX_BATCH_SIZE = 8 requests fit (plan_pool_sizes): 8 windows of 3 blocks in the
    # sliding pool, no chunk headroom (the old default kept one per row and ran 5), the rest in the full pool
    assert peaks["window-aware"][1] == {SLIDING: 24, FULL: 96}
    assert peaks["uniform"][0] == 4 and peaks["window-aware"][0] == 96 // 15 == 6


def test_footprints_and_reservation_bookkeeping(tiny_gemma4_dir):
    backend = make_backend(tiny_gemma4_dir, kv_blocks=40, sliding_blocks=12)
    admission = backend.admission
    assert admission.capacity == {SLIDING: 12, FULL: 68}
    assert admission.footprint(5) == {SLIDING: 2, FULL: 2}
    assert admission.footprint(100) == {SLIDING: 3, FULL: 25}  # sliding capped at ceil(8/4) + 1
    with backend.lock:
        assert [backend.kv_reserve(f"a{i}", 100) for i in range(3)] == [True, True, False]  # 3 x 25 > 68 full
        assert backend.kv_stats()["full_blocks_reserved"] == 50
        backend.kv_release("a0")
        backend.kv_release("a0")  # idempotent
        assert backend.kv_reserve("a3", 100) is True
        assert backend.kv_reserve("a3", 20) is True  # re-reserving replaces
        assert backend.kv_stats()["reserved_tokens"] == 120
        for rid in ("a1", "a3"):
            backend.kv_release(rid)
        assert [backend.kv_reserve(f"s{i}", 12) for i in range(5)] == [True] * 4 + [False]  # sliding binds
        assert backend.kv_stats()["admission_rejections"] == 2
        for i in range(4):
            backend.kv_release(f"s{i}")
    backend.check_integrity()


def test_the_token_budget_lives_in_the_core_alone(tiny_gemma4_dir):
    """MAX_ACTIVE_KV_TOKENS is enforced once, by the core (a request over it is refused at submit; admission
    waits while running requests hold the budget); the backend's reservations count blocks only."""
    from gemmaserve.engine.request import Request
    from gemmaserve.engine.scheduler import ContinuousBatchScheduler
    from gemmaserve.errors import PromptTooLongError
    from gemmaserve.sampling_params import SamplingParams
    from gemmaserve.settings import CoreSettings

    backend = make_backend(tiny_gemma4_dir, kv_blocks=200, max_active_kv_tokens=60)
    with backend.lock:
        assert backend.kv_reserve("over-the-token-budget", 100)  # blocks fit: the backend does not count tokens
        backend.kv_release("over-the-token-budget")
    sched = ContinuousBatchScheduler(backend, CoreSettings(max_active_kv_tokens=60, max_batch_size=4))
    with pytest.raises(PromptTooLongError, match="MAX_ACTIVE_KV_TOKENS"):
        sched.add_request(Request("big", tuple([5] * 50), SamplingParams(max_tokens=11)))
    for i in range(2):
        sched.add_request(Request(f"r{i}", tuple([5 + i] * 20), SamplingParams(max_tokens=20, ignore_eos=True)))
    sched.step()
    assert sched.stats().num_waiting == 1 and sched.stats().reserved_kv_tokens == 40  # the core's budget waits r1
    while sched.has_work:
        sched.step()
    assert_no_leaks(backend)


def test_requests_that_can_never_fit_are_rejected_clearly(tiny_gemma4_dir):
    backend = make_backend(tiny_gemma4_dir, kv_blocks=20, max_active_kv_tokens=500)
    with backend.lock:
        full_total = backend.pools.managers[FULL].num_blocks
        with pytest.raises(KVCapacityError, match=f"full_attention KV pool .* has {full_total} in total"):
            backend.kv_reserve("big", 4 * full_total + 1)
        with pytest.raises(InvalidRequestError):
            backend.kv_reserve("zero", 0)
    assert len(backend.admission) == 0
    # the most one request can hold: its blocks fit, one token more does not (footprints grow with the count)
    most = backend.max_request_tokens()
    with backend.lock:
        assert backend.kv_reserve("most", most)
        backend.kv_release("most")
        with pytest.raises(KVCapacityError):
            backend.kv_reserve("one-more", most + 1)
    # a request that fits MAX_ACTIVE_KV_TOKENS but never the pool is refused at submit, naming the pool (it was
    # accepted, waited at the head of the queue and failed there)
    from gemmaserve.engine.request import Request
    from gemmaserve.engine.scheduler import ContinuousBatchScheduler
    from gemmaserve.sampling_params import SamplingParams
    from gemmaserve.settings import CoreSettings

    sched = ContinuousBatchScheduler(backend, CoreSettings(max_active_kv_tokens=500, max_batch_size=4))
    huge = tuple([7] * (most - 3))
    with pytest.raises(KVCapacityError, match=rf"exceeds what one request can hold in the backend's KV pool \({most}\)"):
        sched.add_request(Request("huge", huge, SamplingParams(max_tokens=4)))
    done = run_scheduler(backend, [(list(huge), 0, 3), ([5, 6, 7], 0, 4)])  # exactly the most: served
    assert done["r0"].finish_reason is FinishReason.LENGTH and done["r1"].finish_reason is FinishReason.LENGTH
    assert_no_leaks(backend)


def test_pool_exhaustion_without_reservations_raises_and_keeps_state(tiny_gemma4_dir):
    backend = make_backend(tiny_gemma4_dir, kv_blocks=8, sliding_blocks=6)
    assert backend.pools.managers[FULL].num_blocks == 10
    with backend.lock:
        with pytest.raises(KVCapacityError, match="exhausted"):
            backend.prefill([9] * 41)  # needs 11 full blocks
        for row in list(backend.pools.live_rows):
            row.free_all()  # what the scheduler does with a failed prefill
        backend.check_integrity()
        rows = [backend.prefill([5 + i] * 20).kv for i in range(2)]  # 5 + 5 full blocks: pool full
        batch = backend.stack_caches_left_padded(rows)
        with pytest.raises(KVCapacityError):
            backend.decode_step_batched(batch, [1, 2])  # both rows need a 6th block
        assert [r.length for r in batch.rows] == [20, 20]
        backend.check_integrity()
        backend.remove_row_from_cache(batch, 1)
        backend.decode_step_batched(batch, [1])  # the survivor continues
        backend.remove_row_from_cache(batch, 0)
    assert_no_leaks(backend)


def test_a_request_that_can_never_fit_names_the_setting_of_its_pool() -> None:
    """The sliding pool's refusal names CUSTOM_BACKEND_SLIDING_BLOCKS (the setting that sized it, when given);
    the full pool's, the budget settings only."""
    from gemmaserve.errors import KVCapacityError
    from gemmaserve_custom_torch.kv import GroupGeometry, KVAdmission
    from gemmaserve_custom_torch.models.config import FULL, SLIDING

    geometry = {SLIDING: GroupGeometry(4, 8), FULL: GroupGeometry(4, None)}
    admission = KVAdmission(geometry, {SLIDING: 1, FULL: 100})
    with pytest.raises(KVCapacityError, match="raise CUSTOM_BACKEND_SLIDING_BLOCKS \\(if set\\) or CUSTOM_BACKEND_KV"):
        admission.reserve("r", 20)
    admission = KVAdmission(geometry, {SLIDING: 100, FULL: 2})
    with pytest.raises(KVCapacityError, match="raise CUSTOM_BACKEND_KV_MEMORY_GB") as refused:
        admission.reserve("r", 20)
    assert "SLIDING_BLOCKS" not in str(refused.value)


@pytest.mark.parametrize("block_size,prompt_len,max_tokens", [(4, 6, 1), (4, 7, 1), (4, 9, 2), (4, 8, 1),
                                                              (16, 20, 12), (16, 17, 15)])
def test_an_exact_repeat_fits_its_reservation_while_the_pools_are_fully_reserved(
        tiny_gemma4_dir, block_size, prompt_len, max_tokens):
    """An exact repeat of a cached prompt whose tail block is partial hits every token but the last, which it
    writes into that tail: the row takes the tail from the cache instead of copying it on write (a copy needs a
    block beyond the ``ceil((len + max_tokens) / bs)`` it reserved whenever the reply ends inside the tail block),
    so it finishes with the cold run's tokens while other requests hold every other reserved block (before: it
    failed mid-prefill with the pool exhausted, an admitted request's allocation failing). Block-aligned repeats
    copy their last full block, which their reservation covers."""
    from gemmaserve.engine.request import Request
    from gemmaserve.engine.scheduler import ContinuousBatchScheduler
    from gemmaserve.sampling_params import SamplingParams
    from gemmaserve.settings import CoreSettings

    backend = make_backend(tiny_gemma4_dir, block_size=block_size, kv_blocks=6, sliding_blocks=6)
    scheduler = ContinuousBatchScheduler(backend, CoreSettings(
        max_batch_size=8, prefill_chunk_tokens=64, max_active_kv_tokens=100_000, max_num_batched_tokens=512))
    prompt = tuple(range(5, 5 + prompt_len))

    def drain() -> None:
        while scheduler.has_work:
            scheduler.step()
            scheduler.check_integrity()

    cold = Request("cold", prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    scheduler.add_request(cold)
    drain()
    need = backend.admission.footprint(prompt_len + max_tokens)
    others = [Request(f"q{i}", tuple(100 + 50 * i + k for k in range(block_size)),
                      SamplingParams(max_tokens=max_tokens, ignore_eos=True))
              for i in range(min(backend.admission.capacity[g] // need[g] for g in need) - 1)]
    for request in others:
        scheduler.add_request(request)
    for _ in range(3):
        scheduler.step()
    repeat = Request("repeat", prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    scheduler.add_request(repeat)
    drain()
    assert repeat.error is None and repeat.finish_reason == FinishReason.LENGTH, repeat.error
    assert repeat.cached_tokens == prompt_len - 1 and repeat.output_token_ids == cold.output_token_ids
    assert all(other.error is None for other in others)
    assert_no_leaks(backend)
