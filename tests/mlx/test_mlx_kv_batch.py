"""The left-padded batched KV against a plain-list reference: whatever the sequence of prefill
chunks, splices, decode steps, sliding-window drops and row removals, every query attends exactly to
its own row's tokens (all of them, or the last ``window`` for sliding layers), in order."""

from __future__ import annotations

import itertools

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gemmaserve_mlx.kv_batch import KVBatch
from gemmaserve_mlx.layout import KVLayout, LayerSpec

WINDOW = 4
LAYOUT = KVLayout((LayerSpec(WINDOW, 1, 2, 3), LayerSpec(None, 1, 2, 3), LayerSpec(WINDOW, 1, 2, 3)), mx.float32)


class Reference:
    """Token ids per row; KV of token t is the vector [t, t] (keys) / [t, -t, 0] (values)."""

    def __init__(self) -> None:
        self.ids = itertools.count(1)

    def kv(self, tokens: list[list[int]]) -> tuple[mx.array, mx.array]:
        array = np.array(tokens, dtype=np.float32)[:, None, :, None]  # [rows, 1, new, 1]
        keys = np.concatenate([array, array], axis=-1)
        values = np.concatenate([array, -array, np.zeros_like(array)], axis=-1)
        return mx.array(keys), mx.array(values)


def forward(kv: KVBatch, new: list[list[int]], rows: list[list[int]]) -> None:
    """Append ``new[r]`` to every row like a model would, checking what each new query sees."""
    count = len(new[0])
    caches = kv.begin_forward(count)
    assert kv.context.offset.tolist() == [len(r) for r in rows], "RoPE offsets = tokens so far"
    for layer in caches:
        mask = layer.make_mask(count, window_size=layer.window)
        keys, values = layer.update_and_fetch(*Reference().kv(new))
        total = keys.shape[2]
        if mask is None or isinstance(mask, str):
            assert mask is None or count > 1
            full = np.tril(np.ones((count, total), dtype=bool), k=total - count)
            mask_np = np.broadcast_to(full, (len(rows), 1, count, total))
        else:
            mask_np = np.broadcast_to(np.array(mask), (len(rows), 1, count, total))
        key_ids = np.array(keys)[:, 0, :, 0]
        value_ids = np.array(values)[:, 0, :, 0]
        for r, row in enumerate(rows):
            for i in range(count):
                history = row + new[r][: i + 1]
                expected = history if layer.window is None else history[-layer.window :]
                seen = key_ids[r][mask_np[r, 0, i]].tolist()
                assert seen == expected, (layer.window, r, i, seen, expected)
                assert value_ids[r][mask_np[r, 0, i]].tolist() == expected
    kv.end_forward(count)
    for r, tokens in enumerate(new):
        rows[r].extend(tokens)


ops = st.lists(
    st.one_of(
        st.tuples(st.just("join"), st.lists(st.integers(1, 6), min_size=1, max_size=3)),  # prefill chunk sizes
        st.tuples(st.just("decode"), st.integers(1, 4)),
        st.tuples(st.just("leave"), st.integers(0, 7)),
    ),
    min_size=1,
    max_size=14,
)


@settings(max_examples=60, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(plan=ops, growth=st.integers(1, 3))
def test_every_query_sees_exactly_its_rows_tokens(plan: list[tuple[str, object]], growth: int) -> None:
    ids = itertools.count(1)
    batch = KVBatch(LAYOUT, [], growth=growth, trim_sliding=True)
    rows: list[list[int]] = []
    for op, arg in plan:
        if op == "join":
            row_kv = KVBatch(LAYOUT, [0], growth=growth, trim_sliding=False)
            row: list[list[int]] = [[]]
            for size in arg:  # type: ignore[union-attr]
                forward(row_kv, [[next(ids) for _ in range(size)]], row)
            row_kv.check_integrity()
            batch.extend([row_kv])
            assert row_kv.status == "consumed"
            rows.append(row[0])
        elif op == "decode" and rows:
            for _ in range(arg):  # type: ignore[arg-type]
                forward(batch, [[next(ids)] for _ in rows], rows)
        elif op == "leave" and rows:
            index = arg % len(rows)  # type: ignore[operator]
            batch.pop_row(index)
            rows.pop(index)
        batch.check_integrity()
        assert batch.lengths == [len(r) for r in rows]
        for layer in batch.layers:
            longest = max((len(r) for r in rows), default=0)
            # sliding layers are cut back to W-1 columns before a step once past W-1+growth
            assert layer.width <= (longest if layer.window is None else min(longest, WINDOW + growth))
    if rows:
        forward(batch, [[next(ids)] for _ in rows], rows)


def test_stack_of_many_rows_equals_splicing_them_one_by_one() -> None:
    rows_kv, rows = [], []
    ids = itertools.count(1)
    for length in (5, 1, 9, 3):
        kv = KVBatch(LAYOUT, [0], growth=2, trim_sliding=False)
        row: list[list[int]] = [[]]
        forward(kv, [[next(ids) for _ in range(length)]], row)
        rows_kv.append(kv)
        rows.append(row[0])
    batch = KVBatch(LAYOUT, [], growth=2, trim_sliding=True)
    batch.extend(rows_kv)
    batch.check_integrity()
    forward(batch, [[next(ids)] for _ in rows], rows)


def test_freed_and_consumed_handles_refuse_use() -> None:
    row = KVBatch(LAYOUT, [0], growth=2, trim_sliding=False)
    forward(row, [[1, 2]], [[]])
    batch = KVBatch(LAYOUT, [], growth=2, trim_sliding=True)
    batch.extend([row])
    with pytest.raises(RuntimeError, match="consumed"):
        row.begin_forward(1)
    with pytest.raises(RuntimeError, match="spliced"):
        row.free()
    with pytest.raises(RuntimeError, match="same model"):
        batch.extend([batch])
    batch.free()
    batch.free()
    with pytest.raises(RuntimeError, match="freed"):
        batch.begin_forward(1)
    batch.check_integrity()
