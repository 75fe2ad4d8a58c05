"""Hypothesis state machines for KV bookkeeping: part of the conformance kit (needs ``hypothesis``).

Each machine drives a real implementation and a trivially correct model with the same rules and
checks them against each other after every step. Sizes are tiny on purpose (tokens 0..3, block
sizes 1..4, pools of 4..16 blocks) so prefixes are shared and eviction happens constantly.

Run them with the defaults, or build a configured subclass for your own implementation::

    from hypothesis import settings
    from gemmaserve.testing.kv_machines import create_cache_manager_machine

    TestMyCache = create_cache_manager_machine(MyCacheManager, kv_store=MyTensorKVStore).TestCase
    TestMyCache.settings = settings(max_examples=200, stateful_step_count=40, deadline=None)

The cache machine writes a fake "KV" (the token ids themselves) into every planned block through a
:class:`KVStore` and checks that every block a lookup returns holds exactly the looked-up tokens.
A backend can pass a ``KVStore`` that round-trips through its real block tensors.

When the index (``set_observer``) or cache (``set_event_observer``) reports its changes, the machines also
replay them through an :class:`EventLog` and check, after every step, that the replayed set of vLLM block
hashes equals the one computed from the cached blocks themselves (the KV-cache events' contract).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Hashable, Sequence
from typing import Any, Protocol

from hypothesis import note
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from gemmaserve.kv.block_manager import BlockManager, BlockRefError, OutOfBlocksError
from gemmaserve.kv.cache_manager import CacheManager, PrefixMatch, StorePlan
from gemmaserve.kv.events import VllmBlockHasher
from gemmaserve.kv.radix import BlockValue, RadixPrefixIndex, StoredBlock

__all__ = [
    "KVStore",
    "DictKVStore",
    "EventLog",
    "expected_block_hashes",
    "BlockManagerMachine",
    "RadixIndexMachine",
    "CacheManagerMachine",
    "create_block_manager_machine",
    "create_radix_machine",
    "create_cache_manager_machine",
]

TOKENS = st.integers(0, 3)
Path = tuple[tuple[int, ...], ...]


class KVStore(Protocol):
    """Where the cache machine puts its fake KV: ``write`` stores token ids in a block (from slot 0),
    ``read`` returns what the block holds."""

    def write(self, block_id: int, token_ids: tuple[int, ...]) -> None: ...

    def read(self, block_id: int) -> tuple[int, ...]: ...


class DictKVStore:
    """The default :class:`KVStore`: a dict from block id to its token ids."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._data: dict[int, tuple[int, ...]] = {}

    def write(self, block_id: int, token_ids: tuple[int, ...]) -> None:
        assert 0 <= block_id < self.num_blocks, f"block {block_id} out of range"
        self._data[block_id] = tuple(token_ids)

    def read(self, block_id: int) -> tuple[int, ...]:
        return self._data.get(block_id, ())


class EventLog:
    """A :class:`~gemmaserve.kv.radix.RadixObserver` that replays the reported changes into a tree, asserting
    they are well formed (a stored block is new and extends a known block, a removed block is a known leaf),
    and hashes every block as the KV-event publisher does. ``digests()`` is the set a subscriber holds."""

    def __init__(self, hasher: VllmBlockHasher | None = None) -> None:
        self.hasher = hasher or VllmBlockHasher(seed="kv-machines")
        self.nodes: dict[int, tuple[int | None, bytes]] = {}  # node id -> (parent node id, digest)
        self.children: Counter[int | None] = Counter()
        self.calls: Counter[str] = Counter()

    def blocks_stored(self, parent: int | None, blocks: Sequence[StoredBlock]) -> None:
        assert blocks, "blocks_stored with no block"
        assert parent is None or parent in self.nodes, f"block stored under unknown block {parent}"
        previous = parent
        for block in blocks:
            assert block.node_id not in self.nodes, f"block {block.node_id} stored twice"
            parent_digest = None if previous is None else self.nodes[previous][1]
            self.nodes[block.node_id] = (previous, self.hasher.hash_block(parent_digest, block.token_ids))
            self.children[previous] += 1
            previous = block.node_id
        self.calls["stored"] += 1

    def blocks_removed(self, node_ids: Sequence[int]) -> None:
        assert node_ids, "blocks_removed with no block"
        for node_id in node_ids:
            assert node_id in self.nodes, f"unknown block {node_id} removed"
            assert self.children[node_id] == 0, f"block {node_id} removed before its children"
            parent, _ = self.nodes.pop(node_id)
            self.children[parent] -= 1
            del self.children[node_id]
        self.calls["removed"] += 1

    def all_cleared(self) -> None:
        self.nodes.clear()
        self.children.clear()
        self.calls["cleared"] += 1

    def digests(self) -> set[bytes]:
        return {digest for _, digest in self.nodes.values()}


def expected_block_hashes(paths: Sequence[Path], hasher: VllmBlockHasher) -> set[bytes]:
    """vLLM block hashes of cached blocks given as block-key paths (``block_paths()``), from scratch."""
    digests: dict[Path, bytes] = {}
    for path in sorted(paths, key=len):
        parent = digests[path[:-1]] if len(path) > 1 else None
        digests[path] = hasher.hash_block(parent, path[-1])
    return set(digests.values())


def _raises(exc_type: type[BaseException], fn: Callable[[], Any]) -> None:
    try:
        fn()
    except exc_type:
        return
    raise AssertionError(f"expected {exc_type.__name__}")


def _draw_tokens(data: st.DataObject, seen: list[tuple[int, ...]], max_len: int) -> tuple[int, ...]:
    """Fresh tokens, an earlier sequence repeated, or one truncated and extended (so exact repeats and
    shared prefixes are common)."""
    how = data.draw(st.sampled_from(("fresh", "repeat", "branch") if seen else ("fresh",)), label="how")
    if how == "fresh":
        tokens = tuple(data.draw(st.lists(TOKENS, max_size=max_len), label="tokens"))
    else:
        base = data.draw(st.sampled_from(seen), label="base")
        keep = len(base) if how == "repeat" else data.draw(st.integers(0, len(base)), label="keep")
        extra = () if how == "repeat" else data.draw(st.lists(TOKENS, max_size=max_len - keep), label="extra")
        tokens = base[:keep] + tuple(extra)
    if tokens not in seen:
        seen.append(tokens)
        del seen[:-12]
    return tokens


# ---------------------------------------------------------------------------------------------
class BlockManagerMachine(RuleBasedStateMachine):
    """``BlockManager`` against a ``Counter`` of references per block."""

    factory: Callable[[int], BlockManager] = BlockManager
    num_blocks_range: tuple[int, int] = (4, 16)

    @initialize(data=st.data())
    def setup(self, data: st.DataObject) -> None:
        self.num_blocks = data.draw(st.integers(*self.num_blocks_range), label="num_blocks")
        self.bm = type(self).factory(self.num_blocks)
        self.refs: Counter[int] = Counter()

    def _held(self) -> list[int]:
        return sorted(b for b, n in self.refs.items() if n > 0)

    @rule(num=st.integers(0, 6))
    def allocate(self, num: int) -> None:
        num_free = self.num_blocks - len(self._held())
        assert self.bm.can_allocate(num) == (num <= num_free)
        if num > num_free:
            _raises(OutOfBlocksError, lambda: self.bm.allocate(num))
            return
        block_ids = self.bm.allocate(num)
        note(f"allocate({num}) -> {block_ids}")
        assert len(set(block_ids)) == num and all(self.refs[b] == 0 for b in block_ids)
        assert all(0 <= b < self.num_blocks for b in block_ids)
        self.refs.update(block_ids)

    @precondition(lambda self: bool(self._held()))
    @rule(data=st.data())
    def share(self, data: st.DataObject) -> None:
        block_ids = data.draw(st.lists(st.sampled_from(self._held()), min_size=1, max_size=3), label="incref")
        self.bm.incref(block_ids)
        self.refs.update(block_ids)

    @precondition(lambda self: bool(self._held()))
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        owned = [b for b in self._held() for _ in range(self.refs[b])]
        picks = data.draw(st.lists(st.sampled_from(range(len(owned))), unique=True, min_size=1), label="picks")
        block_ids = [owned[i] for i in picks]
        freed = self.bm.decref(block_ids)
        self.refs.subtract(block_ids)
        assert sorted(freed) == sorted({b for b in block_ids if self.refs[b] == 0}), freed

    @rule(data=st.data())
    def misuse_is_rejected(self, data: st.DataObject) -> None:
        block_id = data.draw(st.integers(0, self.num_blocks - 1), label="block")
        held = self.refs[block_id]
        _raises(BlockRefError, lambda: self.bm.decref([block_id] * (held + 1)))
        if held == 0:
            _raises(BlockRefError, lambda: self.bm.incref([block_id]))
        _raises(BlockRefError, lambda: self.bm.decref([self.num_blocks]))

    @invariant()
    def agrees_with_model(self) -> None:
        held = self._held()
        assert self.bm.num_used == len(held) and self.bm.num_free == self.num_blocks - len(held)
        assert all(self.bm.refcount(b) == self.refs[b] for b in range(self.num_blocks))
        self.bm.check_integrity()


# ---------------------------------------------------------------------------------------------
class RadixIndexMachine(RuleBasedStateMachine):
    """``RadixPrefixIndex`` against a dict {block-key path: value} with LRU stamps and a pin set."""

    factory: Callable[[int], RadixPrefixIndex] = RadixPrefixIndex
    make_value: Callable[[int], Hashable] = int
    block_size_range: tuple[int, int] = (1, 4)
    max_tokens: int = 14

    @initialize(data=st.data())
    def setup(self, data: st.DataObject) -> None:
        self.bs = data.draw(st.integers(*self.block_size_range), label="block_size")
        self.index = type(self).factory(self.bs)
        self.paths: dict[Path, Hashable] = {}
        self.stamps: dict[Path, int] = {}
        self.clock = 0
        self.pinned: set[Hashable] = set()
        self.next_value = 0
        self.seen: list[tuple[int, ...]] = []
        self.events: EventLog | None = None
        if hasattr(self.index, "set_observer"):
            self.events = EventLog()
            self.index.set_observer(self.events)

    def _fresh(self) -> Hashable:
        self.next_value += 1
        return type(self).make_value(self.next_value)

    def _path(self, tokens: Sequence[int]) -> Path:
        return tuple(tuple(tokens[i : i + self.bs]) for i in range(0, len(tokens) - self.bs + 1, self.bs))

    def _model_match(self, keys: Path) -> list[Path]:
        matched = []
        for depth in range(1, len(keys) + 1):
            if keys[:depth] not in self.paths:
                break
            matched.append(keys[:depth])
        return matched

    @rule(data=st.data())
    def insert(self, data: st.DataObject) -> None:
        tokens = _draw_tokens(data, self.seen, self.max_tokens)
        keys = self._path(tokens)
        existing = self._model_match(keys)
        lazy = data.draw(st.booleans(), label="values as a function of the block index")
        reuse = lazy or data.draw(st.booleans(), label="pass cached values back")
        given = [self.paths[p] if reuse else self._fresh() for p in existing]
        given += [self._fresh() for _ in keys[len(existing) :]]
        asked: list[int] = []

        def value_of(j: int) -> BlockValue:
            asked.append(j)
            return given[j]

        # where the walk may resume: nothing, a cached block on this path, or a value not cached (ignored)
        known = data.draw(st.sampled_from([None, self._fresh(), *(self.paths[p] for p in existing)]), label="known")
        result = self.index.insert(tokens, value_of if lazy else given, known=known)
        note(f"insert({tokens}, {given}, lazy={lazy}, known={known}) -> {result}")
        assert result.num_existing == len(existing)
        assert result.new_values == tuple(given[len(existing) :])
        assert result.duplicate_values == (() if reuse else tuple(given[: len(existing)]))
        assert asked == (list(range(len(existing), len(keys))) if lazy else []), asked  # only the uncached blocks
        self.clock += 1
        for depth in range(1, len(keys) + 1):
            self.paths.setdefault(keys[:depth], given[depth - 1])
            self.stamps[keys[:depth]] = self.clock
        assert result.values == tuple(self.paths[keys[:d]] for d in range(1, len(keys) + 1))

    @precondition(lambda self: bool(self.paths))
    @rule(data=st.data())
    def bad_insert_is_rejected(self, data: st.DataObject) -> None:
        tokens = _draw_tokens(data, self.seen, self.max_tokens)
        keys = self._path(tokens)
        existing = self._model_match(keys)
        held = data.draw(st.sampled_from(sorted(self.paths.values(), key=repr)), label="held value")
        values = [self.paths[p] for p in existing] + [held] * (len(keys) - len(existing))
        if len(existing) < len(keys):
            _raises(ValueError, lambda: self.index.insert(tokens, values))
        _raises(ValueError, lambda: self.index.insert(tokens, [*values, self._fresh()]))
        # a known block that is not the path's block at its depth (its blocks above are the caller's guarantee)
        elsewhere = [value for path, value in self.paths.items() if len(path) > len(keys) or path[-1] != keys[len(path) - 1]]
        if elsewhere:
            off_path = data.draw(st.sampled_from(sorted(elsewhere, key=repr)), label="known off the path")
            fresh = [self._fresh() for _ in keys[len(existing):]]
            _raises(ValueError, lambda: self.index.insert(tokens, [*(self.paths[p] for p in existing), *fresh],
                                                          known=off_path))

    @rule(data=st.data())
    def match(self, data: st.DataObject) -> None:
        tokens = _draw_tokens(data, self.seen, self.max_tokens)
        matched = self._model_match(self._path(tokens))
        result = self.index.match(tokens)
        assert result.num_tokens == len(matched) * self.bs
        assert result.values == tuple(self.paths[p] for p in matched)
        self.clock += 1
        for p in matched:
            self.stamps[p] = self.clock

    @precondition(lambda self: bool(self.paths))
    @rule(data=st.data())
    def pin(self, data: st.DataObject) -> None:
        self.pinned.add(data.draw(st.sampled_from(sorted(self.paths.values(), key=repr)), label="pin"))

    @precondition(lambda self: bool(self.pinned))
    @rule(data=st.data())
    def unpin(self, data: st.DataObject) -> None:
        self.pinned.discard(data.draw(st.sampled_from(sorted(self.pinned, key=repr)), label="unpin"))

    @rule(max_blocks=st.integers(0, 6))
    def evict(self, max_blocks: int) -> None:
        expected = []
        while len(expected) < max_blocks:
            leaves = [
                p
                for p, value in self.paths.items()
                if value not in self.pinned and not any(q[:-1] == p for q in self.paths if len(q) == len(p) + 1)
            ]
            if not leaves:
                break
            victim = min(leaves, key=self.stamps.__getitem__)
            expected.append(self.paths.pop(victim))
            del self.stamps[victim]
        evicted = self.index.evict(max_blocks, lambda value: value not in self.pinned)
        note(f"evict({max_blocks}) -> {evicted}")
        assert evicted == expected, f"LRU order: expected {expected}, got {evicted}"

    @rule()
    def clear(self) -> None:
        """Every unpinned leaf goes, repeatedly; an emptied index is reported as one ``all_cleared``."""
        cleared_before = self.events.calls["cleared"] if self.events else 0
        evicted = self.index.clear(lambda value: value not in self.pinned)
        note(f"clear() -> {evicted}")
        removed = []
        while True:
            leaves = [p for p, v in self.paths.items() if v not in self.pinned
                      and not any(q[:-1] == p for q in self.paths if len(q) == len(p) + 1)]
            if not leaves:
                break
            for leaf in leaves:
                removed.append(self.paths.pop(leaf))
                del self.stamps[leaf]
        assert len(set(evicted)) == len(evicted) and set(evicted) == set(removed), (evicted, removed)
        if self.events is not None:
            emptied = bool(evicted) and not self.paths
            assert self.events.calls["cleared"] - cleared_before == int(emptied)

    @precondition(lambda self: self.events is not None)
    @rule()
    def reattach_observer(self) -> None:
        """A new observer is told of the blocks cached already."""
        self.events = EventLog()
        self.index.set_observer(self.events)

    @invariant()
    def agrees_with_model(self) -> None:
        if self.events is not None:
            paths = self.index.block_paths()
            assert sorted(paths) == sorted(self.paths), "block_paths() disagrees with the model"
            assert self.events.digests() == expected_block_hashes(paths, self.events.hasher), (
                "replayed KV events disagree with the cached blocks"
            )
        assert self.index.num_cached_blocks == len(self.paths)
        for keys, value in self.paths.items():
            tokens = tuple(t for key in keys for t in key)
            found = self.index.match(tokens, touch=False)
            assert found.num_tokens == len(tokens) and found.values[-1] == value
        self.index.check_integrity()


# ---------------------------------------------------------------------------------------------
class CacheManagerMachine(RuleBasedStateMachine):
    """``CacheManager`` driven like a backend: lookups, pins, store plans written with fake KV.

    Model: live matches, open plans, and ``stored`` = {sequence: tokens a lookup covered right after
    it was committed}, reset whenever ``stats().evictions`` moves (so it only claims what must still
    be cached).
    """

    factory: Callable[[int, int], CacheManager] = CacheManager
    kv_store: Callable[[int], KVStore] = DictKVStore
    block_size_range: tuple[int, int] = (1, 4)
    num_blocks_range: tuple[int, int] = (4, 16)
    max_tokens: int = 14

    @initialize(data=st.data())
    def setup(self, data: st.DataObject) -> None:
        self.bs = data.draw(st.integers(*self.block_size_range), label="block_size")
        self.nb = data.draw(st.integers(*self.num_blocks_range), label="num_blocks")
        self.cm = type(self).factory(self.nb, self.bs)
        self.kv = type(self).kv_store(self.nb)
        self.matches: list[tuple[tuple[int, ...], PrefixMatch]] = []
        self.plans: list[StorePlan] = []
        self.stored: dict[tuple[int, ...], int] = {}
        self.evictions = 0
        self.seen: list[tuple[int, ...]] = []
        self.events: EventLog | None = None
        if hasattr(self.cm, "set_event_observer"):
            self.events = EventLog()
            self.cm.set_event_observer(self.events)

    def _sync_evictions(self) -> None:
        evictions = self.cm.stats().evictions
        if evictions != self.evictions:
            self.evictions = evictions
            self.stored.clear()

    def _guaranteed_hit(self, tokens: tuple[int, ...]) -> int:
        """Tokens of ``tokens`` that must still be cached according to the model."""
        best = 0
        for seq, covered in self.stored.items():
            if seq == tokens:
                best = max(best, covered)
                continue
            common = next((i for i, (a, b) in enumerate(zip(seq, tokens)) if a != b), min(len(seq), len(tokens)))
            best = max(best, min(common, covered) // self.bs * self.bs)
        return best

    def _check_content(self, tokens: tuple[int, ...], match: PrefixMatch) -> None:
        for k, block_id in enumerate(match.block_ids):
            want = tokens[k * self.bs : min((k + 1) * self.bs, match.num_tokens)]
            got = self.kv.read(block_id)
            assert got == want, f"block {block_id} holds {got}, lookup of {tokens} expects {want}"

    @rule(data=st.data())
    def lookup(self, data: st.DataObject) -> None:
        tokens = _draw_tokens(data, self.seen, self.max_tokens)
        before = self.cm.stats()
        match = self.cm.lookup(tokens)
        note(f"lookup({tokens}) -> {match}")
        n = match.num_tokens
        assert 0 <= n <= len(tokens) and len(match.block_ids) == -(-n // self.bs)
        assert len(set(match.block_ids)) == len(match.block_ids)
        assert match.is_full_hit == (n == len(tokens) > 0)
        assert match.is_full_hit or n % self.bs == 0, "only a full hit may end in a partial block"
        assert n >= self._guaranteed_hit(tokens), f"missed cached prefix of {self._guaranteed_hit(tokens)} tokens"
        self._check_content(tokens, match)
        after = self.cm.stats()
        assert (after.lookups - before.lookups, after.hit_tokens - before.hit_tokens) == (1, n)
        assert after.full_hits - before.full_hits == int(match.is_full_hit)
        self.matches.append((tokens, match))

    @precondition(lambda self: bool(self.matches))
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        _, match = self.matches.pop(data.draw(st.integers(0, len(self.matches) - 1), label="match"))
        self.cm.release(match)
        pinned = self.cm.stats().pinned_blocks
        self.cm.release(match)
        assert self.cm.stats().pinned_blocks == pinned, "second release changed the pins"

    def _begin(self, tokens: tuple[int, ...]) -> StorePlan:
        guaranteed = self._guaranteed_hit(tokens)
        plan = self.cm.begin_store(tokens)
        note(f"begin_store({tokens}) -> {plan}")
        assert plan.token_ids == tokens
        busy = {b for _, m in self.matches for b in m.block_ids} | {w.block_id for p in self.plans for w in p.writes}
        for i, write in enumerate(plan.writes):
            assert write.token_start % self.bs == 0 and write.block_id not in busy, f"bad write {write}"
            full = write.token_end - write.token_start == self.bs
            is_tail = i == len(plan.writes) - 1 and write.token_end == len(tokens) and write.num_tokens < self.bs
            assert (full or is_tail) and write.token_end <= len(tokens), f"bad write {write}"
            if i:
                assert write.token_start == plan.writes[i - 1].token_end, "writes are not contiguous"
            assert write.token_start >= guaranteed // self.bs * self.bs, "re-planned an already cached block"
        assert len({w.block_id for w in plan.writes}) == len(plan.writes)
        if tokens and guaranteed == len(tokens):
            assert not plan.writes, "storing a cached sequence again must write nothing"
        self.plans.append(plan)
        if plan.writes:
            covered = plan.writes[-1].token_end
        else:
            match = self.cm.lookup(tokens)
            self.cm.release(match)
            covered = match.num_tokens
        if covered < len(tokens):
            stats = self.cm.stats()
            assert stats.free_blocks == stats.evictable_blocks == 0, "plan fell short with capacity left"
        self._sync_evictions()
        return plan

    def _finish(self, plan: StorePlan, commit: bool) -> None:
        self.plans.remove(plan)
        tokens = plan.token_ids
        if not commit:
            self.cm.abort_store(plan)
            self.cm.abort_store(plan)
            return
        for write in plan.writes:
            self.kv.write(write.block_id, tokens[write.token_start : write.token_end])
        self.cm.commit_store(plan)
        _raises(RuntimeError, lambda: self.cm.commit_store(plan))
        match = self.cm.lookup(tokens)
        self._check_content(tokens, match)
        self.cm.release(match)
        if plan.writes:
            assert match.num_tokens >= plan.writes[-1].token_end, "committed blocks are not visible"
        self.stored[tokens] = max(self.stored.get(tokens, 0), match.num_tokens)

    @rule(data=st.data())
    def begin_store(self, data: st.DataObject) -> None:
        self._begin(_draw_tokens(data, self.seen, self.max_tokens))

    @precondition(lambda self: bool(self.plans))
    @rule(data=st.data(), commit=st.booleans())
    def finish_store(self, data: st.DataObject, commit: bool) -> None:
        """commit_store (after writing the fake KV) or abort_store an open plan."""
        self._finish(self.plans[data.draw(st.integers(0, len(self.plans) - 1), label="plan")], commit)

    @rule(data=st.data(), commits=st.tuples(st.booleans(), st.booleans()), swap=st.booleans())
    def racing_stores(self, data: st.DataObject, commits: tuple[bool, bool], swap: bool) -> None:
        """Two requests with the same prompt plan before either finishes (e.g. in one scheduler tick);
        a second commit of the same blocks must keep one cached copy and free the other."""
        tokens = _draw_tokens(data, self.seen, self.max_tokens)
        plans = [self._begin(tokens), self._begin(tokens)]
        for plan, commit in zip(plans[::-1] if swap else plans, commits):
            self._finish(plan, commit)

    @rule()
    def clear(self) -> None:
        self.cm.clear()
        stats = self.cm.stats()
        assert stats.evictable_blocks == 0
        if not self.matches and not self.plans:
            assert stats.used_blocks == 0, "clear left unpinned blocks in use"
        self._sync_evictions()

    @invariant()
    def agrees_with_model(self) -> None:
        self.cm.check_integrity()
        if self.events is not None:
            expected = expected_block_hashes(self.cm.block_paths(), self.events.hasher)
            assert self.events.digests() == expected, "replayed KV events disagree with the cached blocks"
        stats = self.cm.stats()
        assert stats.used_blocks + stats.free_blocks == self.nb
        assert stats.pinned_blocks == stats.used_blocks - stats.evictable_blocks
        assert self.cm.free_capacity_blocks() == stats.free_blocks + stats.evictable_blocks
        busy = {b for _, m in self.matches for b in m.block_ids} | {w.block_id for p in self.plans for w in p.writes}
        assert stats.pinned_blocks >= len(busy)
        if not self.matches and not self.plans:
            assert stats.pinned_blocks == 0, "blocks stay pinned with no match or plan open"
        for tokens, match in self.matches:
            self._check_content(tokens, match)


# ---------------------------------------------------------------------------------------------
def create_block_manager_machine(
    factory: Callable[[int], BlockManager] = BlockManager, *, num_blocks: tuple[int, int] = (4, 16)
) -> type[BlockManagerMachine]:
    """A :class:`BlockManagerMachine` over ``factory(num_blocks)``, pool sizes drawn from ``num_blocks``."""
    attrs = {"factory": staticmethod(factory), "num_blocks_range": num_blocks}
    return type("BlockManagerMachine", (BlockManagerMachine,), attrs)


def create_radix_machine(
    factory: Callable[[int], RadixPrefixIndex] = RadixPrefixIndex,
    *,
    make_value: Callable[[int], Hashable] = int,
    block_sizes: tuple[int, int] = (1, 4),
    max_tokens: int = 14,
) -> type[RadixIndexMachine]:
    """A :class:`RadixIndexMachine` over ``factory(block_size)``; ``make_value(n)`` builds the n-th
    distinct stored value (e.g. a tuple of per-pool block ids)."""
    attrs = {
        "factory": staticmethod(factory),
        "make_value": staticmethod(make_value),
        "block_size_range": block_sizes,
        "max_tokens": max_tokens,
    }
    return type("RadixIndexMachine", (RadixIndexMachine,), attrs)


def create_cache_manager_machine(
    factory: Callable[[int, int], CacheManager] = CacheManager,
    *,
    kv_store: Callable[[int], KVStore] = DictKVStore,
    block_sizes: tuple[int, int] = (1, 4),
    num_blocks: tuple[int, int] = (4, 16),
    max_tokens: int = 14,
) -> type[CacheManagerMachine]:
    """A :class:`CacheManagerMachine` over ``factory(num_blocks, block_size)`` whose fake KV goes
    through ``kv_store(num_blocks)``."""
    attrs = {
        "factory": staticmethod(factory),
        "kv_store": staticmethod(kv_store),
        "block_size_range": block_sizes,
        "num_blocks_range": num_blocks,
        "max_tokens": max_tokens,
    }
    return type("CacheManagerMachine", (CacheManagerMachine,), attrs)
