"""The default split of the KV budget between the sliding-window and full-attention pools (``plan_pool_sizes``):
properties over random geometries, limits and budgets (hypothesis), and the issue-18 demonstration at Gemma 4
31B shapes (tight memory: the old even split ran 21 concurrent 4,096-token requests where 66 fit)."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gemmaserve.errors import ConfigurationError
from gemmaserve.kv.block_manager import BlockManager
from gemmaserve_custom_torch.kv import GroupGeometry, KVAdmission, KVGroupSpec, plan_pool_sizes, reference_tokens
from gemmaserve_custom_torch.models.config import FULL, SLIDING


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@st.composite
def plans(draw):
    """Two groups, a block size, limits, and a budget of 1..1500 uniform blocks (plus a remainder)."""
    window = draw(st.integers(1, 96))
    shapes = [tuple(draw(st.lists(st.tuples(st.integers(1, 4), st.integers(1, 8)), min_size=1, max_size=3)))
              for _ in range(2)]
    sliding = KVGroupSpec(SLIDING, window, tuple(range(len(shapes[0]))), shapes[0])
    full = KVGroupSpec(FULL, None, tuple(range(len(shapes[0]), len(shapes[0]) + len(shapes[1]))), shapes[1])
    groups = (sliding, full)
    bs = draw(st.integers(1, 16))
    per_block = sum(g.bytes_per_block(bs, 1) for g in groups)
    budget = draw(st.integers(1, 1500)) * per_block + draw(st.integers(0, per_block - 1))
    limits = {"max_rows": draw(st.integers(1, 48)), "max_active_tokens": draw(st.integers(1, 40_000)),
              "max_len": draw(st.integers(1, 40_000))}
    headroom = draw(st.integers(0, 64))
    return groups, bs, budget, limits, headroom


def _bytes(groups, bs):
    return tuple(g.bytes_per_block(bs, 1) for g in groups)


def _admitted(capacity, geometry, lengths):
    admission = KVAdmission(geometry, capacity)
    count = sum(admission.reserve(f"r{i}", n) for i, n in enumerate(lengths))
    admission.check_integrity()
    return count


def _maxima(groups, bs, limits, headroom):
    """The most blocks of each group the scheduler's limits let requests use, written out here independently
    of the planner: full = ceil(T / bs) + rows (or rows x max_len's blocks), sliding = rows x (window blocks +
    chunk headroom), never more than the full blocks plus the headroom."""
    rows, tokens, max_len = limits["max_rows"], limits["max_active_tokens"], limits["max_len"]
    h = _cdiv(headroom, bs)
    full_max = min(_cdiv(tokens, bs) + rows, rows * _cdiv(max_len, bs))
    window = min(_cdiv(max_len, bs), _cdiv(groups[0].window, bs) + 1)
    return min(rows * (window + h), full_max + rows * h), full_max


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(plans())
def test_default_split_properties(plan):
    groups, bs, budget, limits, headroom = plan
    s, f = _bytes(groups, bs)
    sizes = plan_pool_sizes(groups, bs, 1, budget, sliding_blocks=None, sliding_headroom_tokens=headroom, **limits)
    sliding, full = sizes[SLIDING], sizes[FULL]
    # within the budget, one block at least each
    assert sliding >= 1 and full >= 1 and sliding * s + full * f <= budget
    assert budget - (sliding * s + full * f) < f  # the full pool takes every whole block left
    sliding_max, full_max = _maxima(groups, bs, limits, headroom)
    if sliding_max * s + full_max * f <= budget:  # room for both groups' maxima: the sliding maximum
        assert sliding == sliding_max
        return
    # tight: the sliding pool never exceeds its maximum, and the full pool is not given memory it cannot use
    # while the sliding pool is below its maximum
    assert sliding <= sliding_max
    assert sliding == sliding_max or sliding == 1 or full <= full_max + s // f + 1

    # the reference length: min(max_len, ceil(T / rows)), shortened in blocks until max_rows requests fit
    rows = limits["max_rows"]
    ref = reference_tokens(groups, bs, 1, budget, **limits)
    cap = max(1, min(limits["max_len"], _cdiv(limits["max_active_tokens"], rows)))
    assert 1 <= ref <= cap
    geometry = {g.name: GroupGeometry(bs, g.window) for g in groups}
    a, b = geometry[SLIDING].max_blocks(ref), _cdiv(ref, bs)
    fits = rows * (a * s + b * f) <= budget
    if ref < cap:  # shortened: one more block would not fit (or it is the one-block floor)
        longer = min(cap, (_cdiv(ref, bs) + 1) * bs)
        assert ref == bs * _cdiv(ref, bs) and (not fits or ref == min(cap, bs)
                                               or rows * (geometry[SLIDING].max_blocks(longer) * s
                                                          + _cdiv(longer, bs) * f) > budget)
    # at the reference length the split admits as many requests as the best split of this budget does (or
    # max_rows, all the scheduler lets run), and any max_rows requests up to the reference length fit at once
    best = max(min(x // a, ((budget - x * s) // f) // b) for x in range(1, budget // s + 1))
    assert _admitted(sizes, geometry, [ref] * (best + 1)) >= min(best, rows)
    if fits:
        assert _admitted(sizes, geometry, [ref] * rows) == rows
        assert _admitted(sizes, geometry, [max(1, ref - 3 * i) for i in range(rows)]) == rows


@settings(max_examples=300, deadline=None)
@given(plans())
def test_default_budget_keeps_the_previous_split(plan):
    """With the default budget (uniform blocks for MAX_ACTIVE_KV_TOKENS plus one per row, ``_budget_bytes``)
    and a model length that does not bound the full pool's use, the split is the previous default:
    min(uniform, rows x (window blocks + chunk headroom)). Only a budget below what the limits need changes it."""
    groups, bs, _, limits, headroom = plan
    limits = {**limits, "max_len": 10**9}
    uniform = _cdiv(limits["max_active_tokens"], bs) + limits["max_rows"]
    s, f = _bytes(groups, bs)
    sizes = plan_pool_sizes(groups, bs, 1, uniform * (s + f), sliding_blocks=None,
                            sliding_headroom_tokens=headroom, **limits)
    window = GroupGeometry(bs, groups[0].window).max_blocks(limits["max_len"])
    previous = min(uniform, limits["max_rows"] * (window + _cdiv(headroom, bs)))
    assert sizes[SLIDING] == previous and sizes[FULL] == (uniform * (s + f) - previous * s) // f


@settings(max_examples=200, deadline=None)
@given(plans(), st.integers(1, 3000))
def test_explicit_sliding_blocks_are_kept(plan, sliding_blocks):
    """An explicit sliding pool is kept as given, unless it cannot hold one request's window (refused, naming the
    least that can) or leaves no full-attention block."""
    groups, bs, budget, limits, headroom = plan
    s, f = _bytes(groups, bs)
    one_window = GroupGeometry(bs, groups[0].window).max_blocks(limits["max_len"])
    if sliding_blocks < one_window:
        with pytest.raises(ConfigurationError, match=f"SLIDING_BLOCKS={sliding_blocks} cannot hold one request's "
                                                     f"sliding window.*set at least {one_window}"):
            plan_pool_sizes(groups, bs, 1, budget, sliding_blocks=sliding_blocks, **limits)
        return
    if budget - sliding_blocks * s < f:
        with pytest.raises(ConfigurationError, match=f"SLIDING_BLOCKS={sliding_blocks} uses the whole KV budget"):
            plan_pool_sizes(groups, bs, 1, budget, sliding_blocks=sliding_blocks, **limits)
        return
    sizes = plan_pool_sizes(groups, bs, 1, budget, sliding_blocks=sliding_blocks, sliding_headroom_tokens=headroom,
                            **limits)
    assert sizes == {SLIDING: sliding_blocks, FULL: (budget - sliding_blocks * s) // f}


@settings(max_examples=200, deadline=None)
@given(plans(), st.lists(st.tuples(st.booleans(), st.integers(0, 15), st.integers(1, 5000)), max_size=60))
def test_admission_over_the_planned_pools_never_over_admits(plan, ops):
    """Reserve / release at random against the planned capacities; every reserved request then takes its
    whole footprint from the pools' block managers, which never run out."""
    groups, bs, budget, limits, headroom = plan
    sizes = plan_pool_sizes(groups, bs, 1, budget, sliding_blocks=None, sliding_headroom_tokens=headroom, **limits)
    geometry = {g.name: GroupGeometry(bs, g.window) for g in groups}
    admission = KVAdmission(geometry, sizes)
    managers = {name: BlockManager(n) for name, n in sizes.items()}
    held: dict[str, dict[str, list[int]]] = {}
    for reserve, slot, tokens in ops:
        rid = f"r{slot}"
        if rid in held:
            for name, ids in held.pop(rid).items():
                managers[name].decref(ids)
        admission.release(rid)
        if not reserve:
            continue
        try:
            ok = admission.reserve(rid, tokens)
        except Exception:  # never fits: KVCapacityError, and nothing changed
            assert rid not in admission
            continue
        if ok:
            held[rid] = {name: managers[name].allocate(n) for name, n in admission.footprint(tokens).items()}
        admission.check_integrity()
        for name, manager in managers.items():
            assert manager.num_used == admission.reserved[name] <= sizes[name]


def test_gemma4_31b_shapes_tight_memory_runs_the_pools_out_together():
    """Issue 18: 66 requests of 4,096 tokens fit this memory at Gemma 4 31B shapes (50 storing sliding layers x
    16 KV heads x 256, window 1024; 10 full layers x 4 x 512; bf16, block 16). The previous default, whose
    sliding pool got as many blocks as the full one when rows x (window + a chunk) exceeded that, admitted 21."""
    sliding = KVGroupSpec(SLIDING, 1024, tuple(range(50)), ((16, 256),) * 50)
    full = KVGroupSpec(FULL, None, tuple(range(50, 60)), ((4, 512),) * 10)
    groups, bs = (sliding, full), 16
    s, f = sliding.bytes_per_block(bs, 2), full.bytes_per_block(bs, 2)
    assert s == 10 * f
    per_request = 65 * s + 256 * f  # window blocks + 1, every full block
    budget = 66 * per_request + per_request // 2
    geometry = {g.name: GroupGeometry(bs, g.window) for g in groups}
    limits = {"max_rows": 66, "max_active_tokens": 66 * 4096, "max_len": 4096}
    sizes = plan_pool_sizes(groups, bs, 2, budget, sliding_blocks=None, sliding_headroom_tokens=512, **limits)
    assert reference_tokens(groups, bs, 2, budget, **limits) == 4096
    assert _admitted(sizes, geometry, [4096] * 80) == 66
    uniform = budget // (s + f)  # the previous default: sliding = min(uniform, 66 x (65 + 32)) = uniform
    previous = {SLIDING: uniform, FULL: (budget - uniform * s) // f}
    assert _admitted(previous, geometry, [4096] * 80) == 21
    # MAX_BATCH_SIZE 256 in the same memory: 256 requests of 4,096 tokens do not fit, so the reference is the
    # longest length at which 256 fit (below the window: an even split), and 256 such requests run at once
    wide = {"max_rows": 256, "max_active_tokens": 2**20, "max_len": 131072}
    ref = reference_tokens(groups, bs, 2, budget, **wide)
    assert ref < 1024
    wide_sizes = plan_pool_sizes(groups, bs, 2, budget, sliding_blocks=None, sliding_headroom_tokens=512, **wide)
    assert _admitted(wide_sizes, geometry, [ref] * 300) >= 256
