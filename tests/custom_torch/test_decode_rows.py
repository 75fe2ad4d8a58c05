"""`prepare_decode_rows` (one pass over a decode step's rows) has exactly the effect of `prepare_append(1)` on
each row: the same blocks held and shared, the same free counts, sliding blocks released as the window moves,
copy-on-write of blocks shared with the prefix cache. Property-tested against the per-row method on a twin
backend."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fixtures_backend import make_backend
from gemmaserve.errors import KVCapacityError
from fixtures_backend import one_torch_thread  # noqa: F401  (autouse)
from gemmaserve_custom_torch.kv.paged_cache import PagedKVCache, prepare_decode_rows


def prompt_of(family: int, length: int) -> list[int]:
    """Prompts of one family share their first tokens, so a later one hits the blocks an earlier one cached."""
    return [(family * 97 + 13 * i) % 400 + 4 for i in range(length)]


def per_row_decode_rows(pools, rows: list[PagedKVCache]) -> None:
    """The definition: room for the step's blocks made once (the prefix cache may give some up), then
    ``prepare_append(1)`` on each row that needs bookkeeping."""
    slow = [row for row in rows if not row.decode_needs_nothing()]
    for row in slow:
        row.release_out_of_window(1)
    needs: Counter[str] = Counter()
    for row in slow:
        needs.update({group: len(missing) + len(shared) for group, (missing, shared) in row._plan(1).items()})
    for group, num in needs.items():
        pools.ensure_free(group, num)
    for row in slow:
        row.prepare_append(1)


def shape(row: PagedKVCache) -> dict[str, list[int]]:
    """Per group, each table entry's reference count (0 = not held): equal across twin backends whatever ids
    their allocators picked."""
    pools = row.pools
    return {group: [pools.refcount(group, b) if b >= 0 else 0 for b in table] for group, table in row.tables.items()}


@settings(max_examples=25, deadline=None)
@given(prompts=st.lists(st.tuples(st.integers(0, 2), st.integers(1, 14)), min_size=1, max_size=5),
       steps=st.integers(1, 20), pinned=st.booleans(), kv_blocks=st.integers(10, 48))
def test_prepare_decode_rows_is_prepare_append_on_each_row(tiny_gemma4_dir, prompts, steps, pinned,
                                                          kv_blocks) -> None:
    """Small pools too: the prefix cache gives blocks back on both sides alike, and a step that cannot get its
    blocks fails on both."""
    one_pass = make_backend(tiny_gemma4_dir, kv_blocks=kv_blocks)  # blocks of 4, window 8
    per_row = make_backend(tiny_gemma4_dir, kv_blocks=kv_blocks)
    prompts = [*prompts, prompts[0]]  # a whole-prompt hit: its first step writes into a shared tail block
    with one_pass.lock, per_row.lock:
        rows, twins = [], []
        for f, n in prompts:  # prefill stores: later ones hit
            try:
                row = one_pass.prefill(prompt_of(f, n)).kv
            except KVCapacityError:
                with pytest.raises(KVCapacityError):
                    per_row.prefill(prompt_of(f, n))
                continue
            rows.append(row)
            twins.append(per_row.prefill(prompt_of(f, n)).kv)
        if not rows:
            return
        held: list[tuple[object, str, int]] = []  # (pools, group, block) referenced by a third party
        if pinned:  # someone else holds the block the first row writes next: its step copies it on write
            for row in (rows[0], twins[0]):
                j = row.length // row.pools.block_size
                for group, table in row.tables.items():
                    if j < len(table) and table[j] >= 0:
                        row.pools.incref(group, [table[j]])
                        held.append((row.pools, group, table[j]))
        for _ in range(steps):
            try:
                changed = prepare_decode_rows(one_pass.pools, rows)
            except KVCapacityError:
                with pytest.raises(KVCapacityError):
                    per_row_decode_rows(per_row.pools, twins)
                break
            per_row_decode_rows(per_row.pools, twins)
            assert changed <= len(rows)
            for row, twin in zip(rows, twins):
                assert shape(row) == shape(twin), row.length
                row.commit_append(1)
                twin.commit_append(1)
                row.check_integrity()
            for group, manager in one_pass.pools.managers.items():
                assert manager.num_free == per_row.pools.managers[group].num_free, group
        for row in rows + twins:
            row.free_all()
        for pools, group, block in held:
            pools.decref(group, [block])
        one_pass.pools.check_integrity()
        per_row.pools.check_integrity()


def test_a_row_built_from_cached_blocks_releases_what_leaves_its_window(tiny_gemma4_dir) -> None:
    """A prefix hit's row starts from adopted tables (its eviction watermark at 0) and, decoding, still releases
    every sliding block that leaves its window; a row listed twice in a step is prepared once."""
    backend = make_backend(tiny_gemma4_dir)
    with backend.lock:
        row = backend.prefill(prompt_of(0, 14)).kv
        for _ in range(12):
            prepare_decode_rows(backend.pools, [row])
            row.commit_append(1)
            row.check_integrity()
        row.free_all()
        again = backend.prefill(prompt_of(0, 14)).kv  # a prefix hit: adopt() installs cached tables
        for _ in range(12):
            prepare_decode_rows(backend.pools, [again, again])
            again.commit_append(1)
            again.check_integrity()  # raises if an out-of-window block is still held
        again.free_all()
        backend.pools.check_integrity()
