"""Requests that share a prefix with a prompt being prefilled wait for its blocks (engine/shared_prefix.py): the
rule itself, and through the scheduler: a burst sharing a long prefix computes it once, every request's tokens
stay the reference's, nobody waits forever, and a leader that is cancelled or fails releases its followers."""

from __future__ import annotations

import pytest
from gemmaserve.engine.shared_prefix import common_prefix_len, should_wait
from gemmaserve.sampling_params import SamplingParams
from gemmaserve.testing.reference_backend import ReferenceBackend
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from test_scheduler import Recorder, assert_idle, make, req, run


@settings(max_examples=200, deadline=None, database=None)
@given(shared=st.lists(st.integers(0, 3), max_size=40), a=st.lists(st.integers(0, 3), max_size=20),
       b=st.lists(st.integers(0, 3), max_size=20), at_least=st.integers(1, 8))
def test_common_prefix_len_is_the_naive_one(shared, a, b, at_least) -> None:
    x, y = tuple(shared + a), tuple(shared + b)
    naive = 0
    while naive < min(len(x), len(y)) and x[naive] == y[naive]:
        naive += 1
    expected = naive if naive >= min(at_least, len(x), len(y)) and min(len(x), len(y)) > 0 else 0
    assert common_prefix_len(x, y, at_least) == expected
    assert common_prefix_len(list(x), list(y), at_least) == expected


def test_the_rule_for_each_kind_of_cache() -> None:
    prefix = tuple(range(100, 132))  # 32 tokens: 8 blocks of 4
    follower = prefix + (1, 2, 3)
    leader = prefix + (7,) * 20
    # progressive: wait while shared full blocks worth at least a chunk are not computed (findable) yet
    assert should_wait(follower, [("L", leader, 0, 0)], 4, progressive=True, chunk=8)
    assert should_wait(follower, [("L", leader, 24, 24)], 4, progressive=True, chunk=8)
    assert not should_wait(follower, [("L", leader, 28, 28)], 4, progressive=True, chunk=8)  # one block left < a chunk
    assert should_wait(follower, [("L", leader, 28, 28)], 4, progressive=True, chunk=4)
    assert not should_wait(follower, [("L", leader, 52, 52)], 4, progressive=True, chunk=8)
    # less than one shared block: never
    assert not should_wait((100, 101, 102, 9), [("L", leader, 0, 0)], 4, progressive=True, chunk=1)
    assert not should_wait((5,) + prefix, [("L", leader, 0, 0)], 4, progressive=True, chunk=1)
    # on completion: only if the follower's first token comes at most one tick later than without waiting
    assert not should_wait(follower, [("L", leader, 0, 0)], 4, progressive=False, chunk=16)  # 4 + 1 > 3 + 1 ticks
    assert not should_wait(follower, [("L", leader, 0, 0)], 4, progressive=False, chunk=8)  # 7 + 1 > 5 + 1 ticks
    assert should_wait(follower, [("L", leader, 36, 0)], 4, progressive=False, chunk=8)  # 2 + 1 <= 5 + 1
    assert should_wait(follower, [("L", leader, 52, 0)], 4, progressive=False, chunk=8)  # complete, not stored yet
    # the leader found the shared blocks in the cache itself: they are findable, nothing to wait for
    assert not should_wait(follower, [("L", leader, 32, 32)], 4, progressive=False, chunk=8)
    assert should_wait(follower, [("L", leader, 32, 16)], 4, progressive=False, chunk=8)
    # any leader will do
    assert should_wait(follower, [("x", (9, 9, 9, 9), 0, 0), ("L", leader, 0, 0)], 4, progressive=True, chunk=8)


def _burst(sched, prefix, own: int, count: int, max_tokens: int = 3):
    for i in range(count):
        sched.add_request(req(f"r{i}", prefix + [5 + (i + j) % 3 for j in range(own)], max_tokens=max_tokens,
                              ignore_eos=True))


@pytest.mark.parametrize("mixed", [False, True])
def test_a_burst_sharing_a_prefix_computes_it_once(mixed: bool) -> None:
    """Eight prompts of a 48-token shared prefix + 4 own tokens, all queued at once, chunks of 16: the leader
    computes the prefix, the others wait and hit it; prompt tokens computed drop from 8 x 52 to about
    48 + 8 x 4 (the cache recomputes a fully cached prompt's last token), at one tick more (the core cache
    finds the prefix once the leader's prompt is stored); tokens equal the reference."""
    prefix = [5 + (7 * i) % 3 for i in range(48)]
    results = {}
    for cache_blocks in (0, 64):
        backend = ReferenceBackend(mixed_step=mixed)
        sched, _, _ = make(backend, cache_blocks=cache_blocks, block_size=4, prefill_chunk_tokens=16,
                           max_num_batched_tokens=256, max_batch_size=8)
        _burst(sched, prefix, 4, 8)
        recorder = run(sched)
        stats = sched.stats()
        results[cache_blocks] = (stats.prompt_tokens - stats.cached_tokens, stats.num_steps)
        for i in range(8):
            prompt = prefix + [5 + (i + j) % 3 for j in range(4)]
            assert recorder.outputs[f"r{i}"].token_ids == backend.reference_generate(
                prompt, SamplingParams(max_tokens=3, ignore_eos=True))
        assert_idle(sched)
    (computed_without_cache, ticks_without_cache), (computed_with_cache, ticks_with_cache) = results[0], results[64]
    assert computed_without_cache == 8 * 52
    assert computed_with_cache <= 52 + 7 * 8, computed_with_cache
    assert ticks_with_cache <= ticks_without_cache + 1


def test_followers_of_a_cancelled_leader_go_on() -> None:
    """The leader is cancelled mid-prefill: its followers are released and finish with the reference tokens."""
    prefix = [6] * 40
    backend = ReferenceBackend()
    sched, _, _ = make(backend, cache_blocks=64, block_size=4, prefill_chunk_tokens=8, max_num_batched_tokens=64)
    _burst(sched, prefix, 3, 4)
    recorder = Recorder()
    recorder.feed(sched.step())
    recorder.feed(sched.step())
    sched.abort_request("r0")
    run(sched, recorder)
    for i in range(1, 4):
        prompt = prefix + [5 + (i + j) % 3 for j in range(3)]
        assert recorder.outputs[f"r{i}"].token_ids == backend.reference_generate(
            prompt, SamplingParams(max_tokens=3, ignore_eos=True))
    assert_idle(sched)


def test_followers_of_a_failing_leader_go_on() -> None:
    """The leader's prefill fails (an injected fault on a token only it has): the followers still finish."""
    prefix = [6] * 40
    backend = ReferenceBackend(fail_on_token=9)
    sched, _, _ = make(backend, cache_blocks=64, block_size=4, prefill_chunk_tokens=8, max_num_batched_tokens=64)
    sched.add_request(req("leader", prefix + [9], max_tokens=2, ignore_eos=True))
    for i in range(3):
        sched.add_request(req(f"f{i}", prefix + [5 + i], max_tokens=2, ignore_eos=True))
    recorder = run(sched)
    assert recorder.outputs["leader"].finish_reason.value == "error"
    for i in range(3):
        assert recorder.outputs[f"f{i}"].token_ids == backend.reference_generate(
            prefix + [5 + i], SamplingParams(max_tokens=2, ignore_eos=True))
    assert_idle(sched)


@settings(max_examples=40, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(prefix_len=st.integers(0, 30), owns=st.lists(st.integers(1, 12), min_size=1, max_size=6),
       chunk=st.integers(1, 12), budget=st.integers(4, 40), mixed=st.booleans(), block=st.sampled_from([1, 2, 4]))
def test_waiting_never_changes_tokens_or_stalls(prefix_len, owns, chunk, budget, mixed, block) -> None:
    """Any burst of prompts with a shared prefix, any chunk / budget / block size: every request finishes with
    the reference tokens and the scheduler drains (nobody waits forever)."""
    prefix = [5 + (3 * i) % 4 for i in range(prefix_len)]
    backend = ReferenceBackend(mixed_step=mixed)
    sched, _, _ = make(backend, cache_blocks=64, block_size=block, prefill_chunk_tokens=chunk,
                       max_num_batched_tokens=budget, max_batch_size=4)
    prompts = {f"r{i}": prefix + [5 + (i * 7 + j) % 4 for j in range(own)] for i, own in enumerate(owns)}
    for rid, prompt in prompts.items():
        sched.add_request(req(rid, prompt, max_tokens=2, ignore_eos=True))
    recorder = run(sched, max_ticks=2_000)
    for rid, prompt in prompts.items():
        assert recorder.outputs[rid].token_ids == backend.reference_generate(
            prompt, SamplingParams(max_tokens=2, ignore_eos=True))
    assert_idle(sched)


def test_the_waits_are_counted_for_metrics() -> None:
    """SchedulerStats.prefix_waits (exported as gemmaserve_shared_prefix_waits_total) counts the held ticks."""
    backend = ReferenceBackend()
    sched, _, _ = make(backend, cache_blocks=64, block_size=4, prefill_chunk_tokens=8, max_num_batched_tokens=64)
    assert sched.stats().prefix_waits == 0
    _burst(sched, [6] * 40, 3, 3)
    run(sched)
    assert sched.stats().prefix_waits > 0
    assert_idle(sched)


@settings(max_examples=200, deadline=None)
@given(prefix=st.lists(st.integers(0, 2), max_size=24), tails=st.lists(st.lists(st.integers(0, 2), max_size=12),
       min_size=2, max_size=5), progress=st.lists(st.tuples(st.integers(0, 40), st.integers(0, 40)), min_size=4,
       max_size=4), block=st.sampled_from([1, 2, 4]), chunk=st.integers(1, 16), progressive=st.booleans())
def test_leaders_skipped_without_comparing_change_no_decision(prefix, tails, progress, block, chunk, progressive):
    """The length bound that skips a leader before comparing prompts decides exactly as comparing them would:
    the rule evaluated leader by leader with the full common prefix gives the same answer."""
    prompts = [tuple(prefix + tail) for tail in tails]
    follower, others = prompts[0], prompts[1:]
    leaders = []
    for i, (leader, (computed, findable)) in enumerate(zip(others, progress)):
        computed = min(computed, len(leader))
        leaders.append((i, leader, computed, min(findable, computed)))
    expected = False
    for _, leader, computed, findable in leaders:
        shared = common_prefix_len(follower, leader) // block * block
        found = findable // block * block
        if shared - found < max(block, chunk):
            continue
        if progressive:
            expected = True
            break
        ticks_waiting = -(-(len(leader) - computed) // chunk) + -(-(len(follower) - shared) // chunk)
        if ticks_waiting <= -(-(len(follower) - found) // chunk) + 1:
            expected = True
            break
    assert should_wait(follower, leaders, block, progressive=progressive, chunk=chunk) == expected


def test_a_burst_hitting_a_cached_prefix_compares_no_prompts(monkeypatch) -> None:
    """64 prompts of a cached 1,536-token prefix + 64 own tokens (workload B's hits): every leader's findable
    blocks already cover all but less than a chunk, so no pair of prompts is compared."""
    from gemmaserve.engine import shared_prefix

    calls = []
    monkeypatch.setattr(shared_prefix, "common_prefix_len", lambda *a, **k: calls.append(1) or 0)
    prefix = tuple(range(1536))
    prompts = [prefix + tuple(range(10_000 + 64 * i, 10_064 + 64 * i)) for i in range(64)]
    leaders = []
    for i, prompt in enumerate(prompts):
        assert not shared_prefix.should_wait(prompt, leaders, 16, progressive=True, chunk=512, memo={})
        leaders.append((i, prompt, 1536, 1536))
    assert calls == []
