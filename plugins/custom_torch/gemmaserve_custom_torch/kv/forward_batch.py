"""`ForwardBatch`: one tick's tokens of many rows (prefill chunks and decode rows) packed for ONE forward, the
fixed device buffers that hold it for CUDA-graph replay (`ForwardBuffers`), and `RaggedPagedContext`, the
attention context that runs it over the paged pools.

A batch is described in one place (:func:`pack_tick`) from rows whose blocks for the new positions are already
prepared (``PagedKVCache.prepare_append``; lengths not yet committed). Sequence ``s`` contributes ``n_s``
tokens at positions ``row.length ...``; the tensors (on the pools' device) are:

- ``ids``, ``positions``: int64 ``[T]`` (tokens of sequence 0, then 1, ...);
- ``write_slots[group]``: int64 ``[T]``, the flat pool slot each token's K/V goes to (the scratch block for
  positions the group does not keep, and for padding tokens);
- ``query_start``: int32 ``[S + 1]``; ``seq_lens``: int32 ``[S]`` = context after the tick (``length + n_s``);
- ``block_tables[group]``: int32 ``[S, width]`` (``-1`` = not held);
- ``logit_seqs``: int64 ``[R]``, the sequences whose last token's logits are wanted (decode rows, chunks that
  complete their prompt), in output order;
- ``tiles[block_m]``: the Triton kernel's query-tile map.

Padded batches (``ForwardBuffers.view``): tokens past ``T`` are padding (token 0, scratch write slot, in no
sequence: attention gives them zeros), sequences past ``S`` are empty (``n_s = 0``, ``seq_len = 0``), and
``logit_seqs`` past ``R`` name an empty sequence when there is one (its attention is zero), else a real one
(work thrown away); they are padded to ``logit_buckets`` rows, not to the bucket's sequence count. Every shape
depends on the bucket and that row count only, so the forward can be captured once per pair.

Every storing layer writes the batch's K/V (its fused q/k/v kernel at the write slots, through
:meth:`RaggedPagedContext.kv_cache_target`; unfused, one indexed copy each), then every layer attends through the block
tables with the ragged kernel (Triton) or its plain-torch reference (the portable path); fresh keys are read
back from the pools, so one kernel serves prefill and decode. From ``narrow_layer`` on (the KV-shared tail,
fast prefill) only the last tokens of ``logit_seqs`` are computed: those layers attend as decode rows.

A decode-only batch (``decode_only``: every sequence one token, every sequence's logits wanted, in order) is
the same description run by the model as ``[S, 1]`` with the paged decode kernel (`DecodeBatchContext`, picked
by :func:`paged_context` from the flag, never from data). On the fixed buffers it is staged by `DecodeStaging`
(:meth:`ForwardBuffers.load_decode`, row buckets of ``graph_buckets``) and read through
:meth:`ForwardBuffers.decode_view`.
"""

from __future__ import annotations

import ctypes
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from ..kernels.ragged_reference import query_tiles, ragged_paged_attention_reference
from ..models.config import GemmaTextConfig
from .decode_context import DecodeBatchContext
from .decode_state import DecodeStaging, feed_previous, graph_buckets, pick_bucket
from .paged_cache import PagedKVCache
from .pools import BatchKVWrites, KVPools

__all__ = ["ForwardBatch", "ForwardBuffers", "PackedTick", "RaggedPagedContext", "build_forward_batch", "logit_buckets",
           "pack_tick", "paged_context"]

RaggedAttention = Literal["triton", "reference"]
Tiles = tuple[Tensor, Tensor, Tensor]  # tile_seq int32 [N], tile_q0 int32 [N], number of valid tiles int32 [1]


@dataclass(slots=True)
class PackedTick:
    """The host description of a tick (what :func:`pack_tick` returns; lists of ints)."""

    ids: list[int]
    positions: list[int]
    write_slots: dict[str, list[int]]
    query_start: list[int]
    seq_lens: list[int]
    tables: dict[str, list[list[int]]]
    logit_seqs: list[int]
    query_lens: list[int]
    decode_only: bool = False  # every sequence a decode row (one token, logits wanted): the decode forward

    @property
    def num_tokens(self) -> int:
        return len(self.ids)


def pack_tick(pools: KVPools, rows: Sequence[PagedKVCache], tokens: Sequence[Sequence[int]],
              logit_seqs: Sequence[int], *, decode_only: bool = False) -> PackedTick:
    """Describe ``tokens[i]`` appended to ``rows[i]`` (prepared, lengths not committed); logits wanted for the
    last token of each sequence in ``logit_seqs``. ``decode_only``: every sequence is one token whose logits are
    wanted, in order (checked): the tick runs as a decode forward (`DecodeBatchContext`)."""
    if len(rows) != len(tokens) or not rows:
        raise ValueError(f"{len(rows)} rows for {len(tokens)} token lists")
    lens = [len(t) for t in tokens]
    if min(lens) < 1:
        raise ValueError("every sequence of a forward batch needs at least one token")
    bs = pools.block_size
    ids: list[int] = []
    positions: list[int] = []
    starts = [0]
    for row, chunk in zip(rows, tokens):
        ids.extend(chunk)
        positions.extend(range(row.length, row.length + len(chunk)))
        starts.append(starts[-1] + len(chunk))
    slots: dict[str, list[int]] = {}
    tables: dict[str, list[list[int]]] = {}
    for group in pools.groups:
        scratch = pools.scratch_block(group) * bs
        group_slots: list[int] = []
        for row, n in zip(rows, lens):
            table, start = row.tables[group], row.length
            write_from = row.write_start(group, n)
            group_slots.extend([scratch] * (write_from - start))
            end = start + n
            while write_from < end:  # block by block: one list extension per block, not per token
                block_end = min(end, (write_from // bs + 1) * bs)
                base = table[write_from // bs] * bs - (write_from // bs) * bs
                group_slots.extend(range(base + write_from, base + block_end))
                write_from = block_end
        slots[group] = group_slots
        tables[group] = [row.tables[group] for row in rows]
    if decode_only and (max(lens) != 1 or list(logit_seqs) != list(range(len(rows)))):
        raise ValueError("a decode-only tick is one token per sequence, every sequence's logits wanted in order")
    return PackedTick(ids, positions, slots, starts, [row.length + n for row, n in zip(rows, lens)], tables,
                      list(logit_seqs), lens, decode_only)


@dataclass(slots=True)
class ForwardBatch:
    """The packed tick on the device (see the module docstring); views of `ForwardBuffers` when padded."""

    ids: Tensor
    positions: Tensor
    write_slots: dict[str, Tensor]
    query_start: Tensor
    seq_lens: Tensor
    block_tables: dict[str, Tensor]
    logit_seqs: Tensor
    tiles: dict[int, Tiles]
    decode_only: bool = False  # one token per sequence, all logits wanted: the decode forward (static per graph)
    max_seq_len: int | None = None  # the longest seq_len when known on the host (unpadded batches)

    @property
    def num_tokens(self) -> int:
        return int(self.ids.shape[0])

    @property
    def last_index(self) -> Tensor:
        """int64 [S]: each sequence's last token (an empty sequence gives the token before it; harmless)."""
        return (self.query_start[1:].to(torch.int64) - 1).clamp_(min=0)

    def logit_tokens(self) -> Tensor:
        """int64 [R]: the token index of each ``logit_seqs`` entry's last token."""
        return self.last_index[self.logit_seqs]


def build_forward_batch(pools: KVPools, tick: PackedTick, device: torch.device, block_ms: Sequence[int]) -> ForwardBatch:
    """The unpadded batch of ``tick`` in fresh tensors (eager forwards: CPU, MoE, oversized ticks)."""
    groups = list(pools.groups)
    ints = torch.tensor([tick.ids, tick.positions, *(tick.write_slots[g] for g in groups)], dtype=torch.int64)
    ints = ints.to(device)
    width = max(len(t) for g in groups for t in tick.tables[g])
    tables = torch.tensor([[t + [-1] * (width - len(t)) for t in tick.tables[g]] for g in groups], dtype=torch.int32)
    meta = torch.tensor([*tick.query_start, *tick.seq_lens], dtype=torch.int32).to(device)
    tiles: dict[int, Tiles] = {}
    for block_m in block_ms if not tick.decode_only else ():  # the decode kernel reads no tile map
        seqs, firsts = query_tiles(tick.query_lens, block_m)
        both = torch.tensor([seqs, firsts], dtype=torch.int32).to(device)
        tiles[block_m] = (both[0], both[1], torch.tensor([len(seqs)], dtype=torch.int32, device=device))
    count = len(tick.query_lens)
    tables = tables.to(device)
    return ForwardBatch(
        ids=ints[0], positions=ints[1], write_slots={g: ints[2 + i] for i, g in enumerate(groups)},
        query_start=meta[: count + 1], seq_lens=meta[count + 1 :],
        block_tables={g: tables[i] for i, g in enumerate(groups)},
        logit_seqs=torch.tensor(tick.logit_seqs, dtype=torch.int64).to(device), tiles=tiles,
        decode_only=tick.decode_only, max_seq_len=max(tick.seq_lens),
    )


def token_buckets(max_tokens: int, smallest: int = 16) -> tuple[int, ...]:
    """Padded token counts up to ``max_tokens``: 16, 32, 48, 64, 96, 128, 192, 256, ... (each power of two and
    1.5x it, so padding wastes at most a third), ending with ``max_tokens`` itself."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    sizes: set[int] = set()
    size = smallest
    while size < max_tokens:
        sizes.add(size)
        if size >= 32 and size * 3 // 2 < max_tokens:
            sizes.add(size * 3 // 2)
        size *= 2
    sizes.add(max_tokens)
    return tuple(sorted(sizes))


def logit_buckets(seqs: int) -> tuple[int, ...]:
    """Logits-row counts of a token bucket whose forward has room for ``seqs`` sequences: 16 times the powers of four
    below ``seqs``, then ``seqs`` itself (up to 64 rows a projection streams its weights about as fast at any count,
    so coarse steps waste little)."""
    return graph_buckets(seqs, smallest=16, factor=4)


class ForwardBuffers:
    """Fixed device buffers for ticks of at most ``max_tokens`` tokens and ``max_seqs`` sequences whose rows
    hold at most ``width`` blocks. :meth:`load` stages a tick and returns its bucket; :meth:`view` gives the
    padded `ForwardBatch` of a bucket. Device buffers keep their addresses for the object's lifetime (graphs
    capture them). Single-threaded (backend lock).

    Staging: the tick is written into one of two pinned host buffers (alternating, so a tick is staged while
    the previous one's copies may still be queued) as two contiguous runs — int64 ``[ids, positions, write
    slots per group, sources]`` laid out ``[rows, bucket]`` and int32 ``[meta, block tables]`` — and each run
    goes to the device in ONE copy (pinned and contiguous: it never waits for queued device work). The block
    tables arrive packed ``[groups, seqs, tick width]`` and one device copy spreads them into the fixed
    ``[groups, max_seqs, width]`` tables; entries past a row's tick width keep stale ids, which no kernel reads
    (each reads only the blocks below its sequence length)."""

    def __init__(self, pools: KVPools, *, max_tokens: int, max_seqs: int, width: int, block_ms: Sequence[int],
                 device: torch.device) -> None:
        self.pools = pools
        self.groups = list(pools.groups)
        self.max_tokens, self.max_seqs, self.width = max_tokens, max_seqs, width
        self.buckets = token_buckets(max_tokens)
        self.logit_rows = {bucket: logit_buckets(self.seqs_of(bucket)) for bucket in self.buckets}
        """Per token bucket, the logits-row counts its forward is captured at (:meth:`logit_rows_for` picks one)."""
        self.block_ms = tuple(sorted(set(block_ms)))
        self.device = device
        self._rows64 = 3 + len(self.groups)  # ids, positions, sources, one write-slot row per group
        self._max_tiles = {bm: -(-max_tokens // bm) + max_seqs for bm in self.block_ms}
        self._meta_room = 3 * max_seqs + 1 + sum(2 * n + 1 for n in self._max_tiles.values())
        len64 = max(self._rows64 * max_tokens, 3 * max_seqs)  # decode-only ticks use 3 * bucket of it
        len32 = self._meta_room + len(self.groups) * max_seqs * width
        self._i64 = torch.zeros(len64, dtype=torch.int64, device=device)
        self._i32 = torch.zeros(len32, dtype=torch.int32, device=device)
        self._tables = torch.full((len(self.groups), max_seqs, width), -1, dtype=torch.int32, device=device)
        pin = device.type == "cuda"
        self._staging = [(torch.zeros(len64, dtype=torch.int64, pin_memory=pin),
                          torch.zeros(len32, dtype=torch.int32, pin_memory=pin)) for _ in range(2)]
        self._copied: list[torch.cuda.Event | None] = [None, None]
        self._turn = 0
        self._scratch_slots = [pools.scratch_block(group) * pools.block_size for group in self.groups]
        self.decode_buckets = graph_buckets(max_seqs)  # decode-only ticks: rows (= tokens) per bucket
        # decode-only ticks keep their own tables, so a tick with prompt tokens leaves their mirror valid
        self._decode_tables = torch.full_like(self._tables, -1)
        self.decode = DecodeStaging(pools, self._i64, self._decode_tables, max_seqs, width)
        self._arange = torch.arange(max_seqs + 1, dtype=torch.int64, device=device)
        self._arange32 = self._arange.to(torch.int32)
        self._bucket = self.buckets[0]
        self.load_padding(self._bucket)

    def bucket_for(self, num_tokens: int, num_seqs: int) -> int | None:
        """The smallest bucket holding the tick, or None when it exceeds the buffers."""
        if num_seqs > self.max_seqs:
            return None
        return next((b for b in self.buckets if b >= num_tokens), None)

    def seqs_of(self, bucket: int) -> int:
        """Sequences (and logits rows at most) a bucket's forward has room for."""
        return min(bucket, self.max_seqs)

    def logit_rows_for(self, bucket: int, count: int) -> int:
        """Logits rows a forward of token ``bucket`` computes for ``count`` wanted ones: the smallest of
        ``logit_rows[bucket]`` holding them. With fast prefill the KV-shared layers run at that many rows, so a
        tick of a few decode rows beside a long chunk does not run them (and the LM head) at its padded sequence
        count."""
        return pick_bucket(self.logit_rows[bucket], max(count, 1))

    def load(self, tick: PackedTick, sources: Sequence[int] | None = None) -> int:
        """Stage ``tick`` into the buffers; returns its bucket. ``sources``: per decode row (the first
        sequences) the index of the previous step's token it consumes, or -1 (see :meth:`feed_previous`).
        Raises ValueError if it does not fit (see :meth:`bucket_for`) or a row is wider than the tables."""
        num_tokens, count = tick.num_tokens, len(tick.query_lens)
        bucket = self.bucket_for(num_tokens, count)
        if bucket is None:
            raise ValueError(f"a tick of {num_tokens} tokens / {count} sequences exceeds the buffers "
                             f"({self.max_tokens} / {self.max_seqs})")
        width = max(len(t) for g in self.groups for t in tick.tables[g])
        if width > self.width:
            raise ValueError(f"a row holds {width} blocks but the tick buffers are {self.width} wide "
                             "(MAX_MODEL_LEN / block size)")
        self._stage_tick(tick, bucket, sources, width)
        return bucket

    def load_padding(self, bucket: int) -> None:
        """Stage an all-padding tick of ``bucket`` tokens (no sequence: writes go to the scratch blocks, no
        tile runs, logits rows are zero-context decode rows): a valid state to capture a graph from."""
        nothing: dict[str, list] = {group: [] for group in self.groups}
        self._stage_tick(PackedTick([], [], nothing, [0], [], nothing, [], []), bucket, None, 0)
        self._tables[:, : self.seqs_of(bucket)].fill_(-1)

    def load_decode(self, rows: Sequence[PagedKVCache], input_ids: Sequence[int],
                    sources: Sequence[int] | None = None) -> int:
        """Stage a decode-only tick (row ``i`` consumes ``input_ids[i]`` at ``rows[i].length``; rows hold the
        block of that position) through `DecodeStaging`; returns its bucket (of :attr:`decode_buckets`, read by
        :meth:`decode_view`). ``sources``: as in :meth:`load`. Raises ValueError (buffers untouched) if it does
        not fit."""
        bucket = pick_bucket(self.decode_buckets, max(len(rows), 1))
        self.decode.load(rows, input_ids, bucket, sources)
        self._bucket = bucket
        return bucket

    def decode_view(self, bucket: int) -> ForwardBatch:
        """The padded decode-only batch of ``bucket`` rows (views of the buffers and device derivations of
        them: no host sync, graph-capturable). Query tiles are left out: the decode kernel reads none."""
        ids, positions, seq_lens, tables, slots = self.decode.step_tensors(bucket)
        return ForwardBatch(
            ids=ids, positions=positions, write_slots=slots,
            query_start=self._arange32[: bucket + 1], seq_lens=seq_lens, block_tables=tables,
            logit_seqs=self._arange[:bucket], tiles={}, decode_only=True,
        )

    def _stage_tick(self, tick: PackedTick, bucket: int, sources: Sequence[int] | None, width: int) -> None:
        """Lay ``tick`` out padded to ``bucket`` (tables ``width`` wide), stage it and spread its tables (into
        the tick tables; the decode-only tables and their mirror are not touched)."""
        seqs, pad, count = self.seqs_of(bucket), bucket - tick.num_tokens, len(tick.query_lens)
        fed = array("q", sources if sources is not None else ())
        ints = array("q", tick.ids)
        ints.extend(array("q", [0]) * pad)
        ints.extend(tick.positions)
        ints.extend(array("q", [0]) * pad)
        ints.extend(fed)
        ints.extend(array("q", [-1]) * (bucket - len(fed)))
        for group, scratch in zip(self.groups, self._scratch_slots):
            ints.extend(tick.write_slots[group])
            ints.extend(array("q", [scratch]) * pad)
        meta = self._meta(tick, bucket)
        tables_at = len(meta)
        unheld = array("i", [-1]) * width
        for group in self.groups:  # every row's table padded to the tick's width with -1, at C speed
            for table in tick.tables[group]:
                meta.extend(table)
                meta.extend(unheld[: width - len(table)])
            meta.extend(unheld * (seqs - count))
        self._stage(ints, meta)
        packed = self._i32[tables_at : tables_at + len(self.groups) * seqs * width]
        self._tables[:, :seqs, :width].copy_(packed.view(len(self.groups), seqs, width))
        self._bucket = bucket

    def _meta(self, tick: PackedTick, bucket: int) -> array:
        """The int32 metadata of ``tick`` padded to ``bucket`` (the layout :meth:`view` reads)."""
        num_tokens, count, seqs = tick.num_tokens, len(tick.query_lens), self.seqs_of(bucket)
        meta = array("i", tick.query_start)
        meta.extend(array("i", [num_tokens]) * (seqs - count))
        meta.extend(tick.seq_lens)
        meta.extend(array("i", [0]) * (seqs - count))
        pad_seq = count if count < seqs else 0  # an empty sequence when there is one
        meta.extend(tick.logit_seqs)
        meta.extend(array("i", [pad_seq]) * (seqs - len(tick.logit_seqs)))
        for bm in self.block_ms:
            tile_seq, tile_q0 = query_tiles(tick.query_lens, bm)
            room = self._tiles_of(bucket, bm)
            meta.extend(tile_seq)
            meta.extend(array("i", [0]) * (room - len(tile_seq)))
            meta.extend(tile_q0)
            meta.extend(array("i", [0]) * (room - len(tile_q0)))
            meta.append(len(tile_seq))
        return meta

    def _stage(self, ints: array, meta: array) -> None:
        """Copy the two runs into the next pinned staging pair, then each to the device in one copy."""
        turn = self._turn
        self._turn ^= 1
        done = self._copied[turn]
        if done is not None:
            done.synchronize()  # this staging pair's last copies have left it (two ticks ago)
        host64, host32 = self._staging[turn]  # sized for the largest bucket's layout
        ctypes.memmove(host64.data_ptr(), ints.buffer_info()[0], len(ints) * ints.itemsize)
        ctypes.memmove(host32.data_ptr(), meta.buffer_info()[0], len(meta) * meta.itemsize)
        self._i64[: len(ints)].copy_(host64[: len(ints)], non_blocking=True)
        self._i32[: len(meta)].copy_(host32[: len(meta)], non_blocking=True)
        if self.device.type == "cuda":
            event = torch.cuda.Event()
            event.record()
            self._copied[turn] = event

    def feed_previous(self, previous: Tensor) -> None:
        """Decode rows whose staged source is ``s >= 0`` consume ``previous[s]`` (the previous step's device
        tokens) instead of their staged id: device ops only, queued before the forward."""
        ints = self._ints(self._bucket)
        feed_previous(ints[0], ints[2], previous)

    def _tiles_of(self, bucket: int, block_m: int) -> int:
        return -(-bucket // block_m) + self.seqs_of(bucket)

    def _ints(self, bucket: int) -> Tensor:
        """int64 [3 + groups, bucket]: ids, positions, sources, write slots per group (a view)."""
        return self._i64[: self._rows64 * bucket].view(self._rows64, bucket)

    def view(self, bucket: int, logit_rows: int | None = None) -> ForwardBatch:
        """The padded batch of ``bucket`` with ``logit_rows`` logits rows (default: the bucket's sequences; at least
        the tick's wanted ones, see :meth:`logit_rows_for`): views of the buffers, shapes depending on these two
        only."""
        seqs = self.seqs_of(bucket)
        meta = self._i32
        at = 0

        def take(n: int) -> Tensor:
            nonlocal at
            out = meta[at : at + n]
            at += n
            return out

        query_start, seq_lens = take(seqs + 1), take(seqs)
        logit_seqs = take(seqs)[: seqs if logit_rows is None else logit_rows].to(torch.int64)
        tiles: dict[int, Tiles] = {}
        for bm in self.block_ms:
            room = self._tiles_of(bucket, bm)
            tiles[bm] = (take(room), take(room), take(1))
        ints = self._ints(bucket)
        return ForwardBatch(
            ids=ints[0], positions=ints[1], write_slots={g: ints[3 + i] for i, g in enumerate(self.groups)},
            query_start=query_start, seq_lens=seq_lens,
            block_tables={g: self._tables[i, :seqs] for i, g in enumerate(self.groups)},
            logit_seqs=logit_seqs, tiles=tiles,
        )


class RaggedPagedContext:
    """`AttentionContext` of one `ForwardBatch` (B = 1, S = T packed tokens). ``narrow_layer``: from that
    layer on, the model computes only the last tokens of ``batch.logit_seqs`` (fast prefill; those layers must
    store no K/V). ``attention``: the Triton kernels or the plain-torch reference."""

    def __init__(self, config: GemmaTextConfig, pools: KVPools, batch: ForwardBatch, attention: RaggedAttention,
                 narrow_layer: int | None = None) -> None:
        self.config = config
        self.pools = pools
        self.batch = batch
        self.attention = attention
        self.narrow_layer = config.num_hidden_layers if narrow_layer is None else narrow_layer
        if any(config.stores_kv(i) for i in range(self.narrow_layer, config.num_hidden_layers)):
            raise ValueError(f"layers from {narrow_layer} on store K/V: they cannot be narrowed")
        self._narrowed: tuple[Tensor, Tensor, dict[str, Tensor]] | None = None
        self._kv = BatchKVWrites(pools, batch.write_slots)
        self._ragged: Callable[..., Tensor] = ragged_paged_attention_reference
        self._decode: Callable[..., Tensor] | None = None
        self._block_m: Callable[[int, int], int] | None = None
        if attention == "triton":
            from ..kernels.paged_attention import paged_decode_attention
            from ..kernels.ragged_attention import ragged_block_m, ragged_paged_attention

            self._ragged, self._decode, self._block_m = ragged_paged_attention, paged_decode_attention, ragged_block_m

    def _narrow(self) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
        """(query_start, seq_lens, tables) of one query per ``logit_seqs`` entry (built once per forward)."""
        if self._narrowed is None:
            batch, sel = self.batch, self.batch.logit_seqs
            count = int(sel.shape[0])
            starts = torch.arange(count + 1, dtype=torch.int32, device=sel.device)
            self._narrowed = (starts, batch.seq_lens[sel].contiguous(),
                              {g: t[sel].contiguous() for g, t in batch.block_tables.items()})
        return self._narrowed

    def kv_cache_target(self, layer_idx: int) -> tuple[Tensor, Tensor, Tensor] | None:
        """The AttentionContext option (:meth:`BatchKVWrites.target`): a storing layer's fused q/k/v kernel writes
        the batch's new K/V itself (padding tokens and positions a group does not keep to its scratch block, as
        the slots say) and passes none to :meth:`attend`."""
        return self._kv.target(layer_idx)

    def attend(self, layer_idx: int, q: Tensor, k: Tensor | None, v: Tensor | None) -> Tensor:
        source = self.config.kv_source_layer[layer_idx]
        group = self.pools.group_of_layer[layer_idx]
        k_pool, v_pool = self.pools.k[source], self.pools.v[source]
        self._kv.store(layer_idx, k, v)
        window = self.config.window_for_layer(layer_idx) or 0
        scale = self.config.attention_scale
        query_start, seq_lens, tables = self.batch.query_start, self.batch.seq_lens, self.batch.block_tables
        if layer_idx >= self.narrow_layer:  # one query per logit_seqs entry
            query_start, seq_lens, tables = self._narrow()
            if self._decode is not None:
                out = self._decode(q[0].contiguous(), k_pool, v_pool, tables[group], seq_lens, scale=scale,
                                   window=window)
                return out[None]
            return self._ragged(q[0], k_pool, v_pool, tables[group], query_start, seq_lens, scale=scale,
                                window=window)[None]
        tiles = {}
        if self._block_m is not None:  # the Triton kernel: its tile map for this layer's shapes
            tiles["tiles"] = self.batch.tiles[self._block_m(q.shape[-1], q.shape[2] // k_pool.shape[2])]
        out = self._ragged(q[0], k_pool, v_pool, tables[group], query_start, seq_lens, scale=scale, window=window,
                           **tiles)
        return out[None]


def paged_context(config: GemmaTextConfig, pools: KVPools, batch: ForwardBatch, attention: RaggedAttention,
                  narrow_layer: int | None = None,
                  decode_kernel: Callable[..., Tensor] | None = None) -> DecodeBatchContext | RaggedPagedContext:
    """The attention context of ``batch``, chosen by its static ``decode_only`` flag (never by its data): the
    paged decode kernel (`DecodeBatchContext`; the model runs the batch as ``[S, 1]``) for a decode-only batch,
    else the ragged kernel (`RaggedPagedContext`, ``[1, T]``). ``narrow_layer`` applies to the ragged one,
    ``decode_kernel`` (a ``paged_decode_attention`` stand-in) to the decode one."""
    if batch.decode_only:
        return DecodeBatchContext(config, pools, batch, attention, decode_kernel)
    return RaggedPagedContext(config, pools, batch, attention, narrow_layer)
