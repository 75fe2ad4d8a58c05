"""Radix prefix index over FULL token blocks: block-aligned token prefix -> one value per block.

Granularity: one node per block. A node's key is the tuple of its ``block_size`` tokens, so the
path from the root spells a block-aligned prefix and edges never need splitting (a block is the
unit of allocation and eviction anyway). Partial trailing blocks are never indexed.

Values are opaque and hashable (``BlockValue``): the core ``CacheManager`` stores an int block id; a
backend may store e.g. a tuple of block ids across several pools. A value lives in at most one node.
The index never frees anything: ``evict`` returns the values it dropped and the caller frees them.

LRU: a logical clock ticks once per ``match``/``insert``, which stamps every node on the walked path.
Eviction repeatedly removes the least recently used LEAF whose value ``can_evict`` accepts; a parent
becomes a candidate once its last child is gone. Not thread-safe: callers serialize access.

Observers (:meth:`RadixPrefixIndex.set_observer`): an optional :class:`RadixObserver` is told of every
change to the set of cached blocks (KV-cache events, ``gemmaserve.kv.events``), naming each block by a
``node_id`` that is unique for the index's lifetime, so content hashes can be derived off the caller's thread.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

__all__ = ["BlockValue", "RadixPrefixIndex", "RadixMatch", "InsertResult", "RadixObserver", "StoredBlock"]

BlockValue = Hashable
"""What the index stores per block (an int block id in the core; anything hashable for backends)."""


class RadixMatch(NamedTuple):
    """Longest cached block-aligned prefix: ``values[k]`` holds tokens ``[k*bs, (k+1)*bs)``."""

    num_tokens: int
    values: tuple[BlockValue, ...]


@dataclass(frozen=True, slots=True)
class InsertResult:
    """Outcome of :meth:`RadixPrefixIndex.insert`.

    Blocks ``0 .. num_existing-1`` were already cached (a cached block's ancestors always are, so
    they form a prefix); the rest took the given values. ``values`` is the index's value for every
    block after the insert.
    """

    num_existing: int
    values: tuple[BlockValue, ...]
    given: tuple[BlockValue, ...]

    @property
    def new_values(self) -> tuple[BlockValue, ...]:
        """Given values the index now holds (ownership passed to the index's owner)."""
        return self.given[self.num_existing :]

    @property
    def duplicate_values(self) -> tuple[BlockValue, ...]:
        """Given values NOT taken because their block was already cached under another value; the
        caller drops (frees) these."""
        pairs = zip(self.given[: self.num_existing], self.values[: self.num_existing])
        return tuple(given for given, held in pairs if given != held)


class StoredBlock(NamedTuple):
    """A block that became cached: its ``node_id`` and its ``block_size`` token ids."""

    node_id: int
    token_ids: tuple[int, ...]


class RadixObserver(Protocol):
    """Told of every change to an index's set of cached blocks, synchronously and in order, while the index's
    owner serializes access: calls must be cheap, must not raise and must not touch the index.

    A ``node_id`` names one cached block from its insertion to its removal and is never reused by the index.
    Replaying the calls into a set of node ids always yields the index's current blocks.
    """

    def blocks_stored(self, parent: int | None, blocks: Sequence[StoredBlock]) -> None:
        """New blocks forming a chain: ``blocks[0]`` extends block ``parent`` (None: it is a sequence's first
        block), every next block the one before it. Never empty."""

    def blocks_removed(self, node_ids: Sequence[int]) -> None:
        """Blocks dropped, each a leaf at its removal (a block's children come before it). Never empty."""

    def all_cleared(self) -> None:
        """Every block was dropped: the index is empty."""


@dataclass(eq=False, slots=True)
class _Node:
    key: tuple[int, ...]
    value: BlockValue
    parent: _Node | None
    serial: int
    depth: int = 0  # blocks from the root down to this one (root 0)
    last_access: int = 0
    children: dict[tuple[int, ...], _Node] = field(default_factory=dict)


class RadixPrefixIndex:
    """One node per full block; see the module docstring for the LRU and ownership rules."""

    def __init__(self, block_size: int) -> None:
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be an integer >= 1, got {block_size!r}")
        self.block_size = block_size
        self._root = _Node(key=(), value=None, parent=None, serial=0)
        self._serials = itertools.count(1)
        self._clock = 0
        self._by_value: dict[BlockValue, _Node] = {}
        self._leaves: set[_Node] = set()
        self._observer: RadixObserver | None = None

    def set_observer(self, observer: RadixObserver | None) -> None:
        """Report every later change to ``observer`` (None: stop reporting). Blocks already cached are reported
        to a new observer at once, as ``blocks_stored`` calls, parents first."""
        self._observer = observer
        if observer is None:
            return
        stack = [self._root]
        while stack:
            node = stack.pop()
            for child in node.children.values():
                parent = None if node is self._root else node.serial
                observer.blocks_stored(parent, (StoredBlock(child.serial, child.key),))
                stack.append(child)

    def block_paths(self) -> list[tuple[tuple[int, ...], ...]]:
        """Every cached block as the block keys (token tuples) from the first block down to it, parents first."""
        paths: list[tuple[tuple[int, ...], ...]] = []
        stack: list[tuple[_Node, tuple[tuple[int, ...], ...]]] = [(self._root, ())]
        while stack:
            node, path = stack.pop()
            for key, child in node.children.items():
                paths.append((*path, key))
                stack.append((child, paths[-1]))
        return paths

    def path_to(self, value: BlockValue) -> tuple[BlockValue, ...]:
        """The values from the first block down to the cached block holding ``value`` (KeyError if none does)."""
        node: _Node | None = self._by_value[value]
        out: list[BlockValue] = []
        while node is not None and node is not self._root:
            out.append(node.value)
            node = node.parent
        return tuple(reversed(out))

    def unreachable(self, can_evict: Callable[[BlockValue], bool]) -> list[BlockValue]:
        """Values ``can_evict`` accepts that :meth:`evict` cannot reach as things stand: they lie above a block it
        rejects (eviction takes leaves only). An owner that counts evictable blocks as free keeps this empty."""
        order: list[_Node] = []
        stack = [self._root]
        while stack:  # parents before children; walked backwards, children are done before their parent
            node = stack.pop()
            order.append(node)
            stack.extend(node.children.values())
        pinned: set[_Node] = set()  # nodes that are, or lie above, a block can_evict rejects
        out: list[BlockValue] = []
        for node in reversed(order[1:]):
            accepted = can_evict(node.value)
            if any(child in pinned for child in node.children.values()):
                if accepted:
                    out.append(node.value)
                pinned.add(node)
            elif not accepted:
                pinned.add(node)
        return out

    @property
    def num_cached_blocks(self) -> int:
        return len(self._by_value)

    def __len__(self) -> int:
        return len(self._by_value)

    def __contains__(self, value: object) -> bool:
        return value in self._by_value

    def _keys(self, token_ids: Sequence[int]) -> list[tuple[int, ...]]:
        """The tuples of the full blocks of ``token_ids`` (a trailing partial block dropped), cut at C speed: zip
        over one iterator repeated ``block_size`` times (half the time of slicing, per prompt lookup and store)."""
        return list(zip(*[iter(token_ids)] * self.block_size, strict=False))

    def match(self, token_ids: Sequence[int], *, touch: bool = True) -> RadixMatch:
        """Longest cached block-aligned prefix of ``token_ids``. ``touch`` stamps the matched path as
        most recently used (pass False for read-only inspection)."""
        if touch:
            self._clock += 1
        node = self._root
        values: list[BlockValue] = []
        for key in self._keys(token_ids):
            child = node.children.get(key)
            if child is None:
                break
            if touch:
                child.last_access = self._clock
            values.append(child.value)
            node = child
        return RadixMatch(len(values) * self.block_size, tuple(values))

    def insert(self, token_ids: Sequence[int], values: Sequence[BlockValue] | Callable[[int], BlockValue], *,
               known: BlockValue | None = None) -> InsertResult:
        """Index the full blocks of ``token_ids``; ``values[i]`` is for block ``i``.

        ``len(values)`` must equal ``len(token_ids) // block_size`` (a trailing partial block is
        ignored). Blocks already cached keep their value; the rest take the given ones, which must not
        be held anywhere in the index. ``values`` may instead be a function of the block index, called only
        for the blocks not cached yet (the result's ``given`` then holds the index's own values for the
        others, so nothing is a duplicate). ``known``: the value of a cached block that the caller knows lies
        on ``token_ids``' path (the last block it matched or inserted along it): the walk resumes there instead
        of hashing the blocks above it (their values come from the parent links; the result is the same); one no
        longer cached is ignored. The caller guarantees the blocks above it are ``token_ids``' (only its own
        block is compared). Stamps the whole path as most recently used. Raises ValueError (changing nothing) on
        a bad argument.
        """
        bs = self.block_size
        num_blocks = len(token_ids) // bs
        lazy = callable(values)
        given: tuple[BlockValue, ...] = ()
        if not lazy:
            given = tuple(values)  # type: ignore[arg-type]
            if len(given) != num_blocks:
                raise ValueError(f"got {len(given)} values for {num_blocks} full blocks of {len(token_ids)} tokens")
        node = self._by_value.get(known, self._root) if known is not None else self._root
        depth = node.depth
        if depth > num_blocks or (depth and tuple(token_ids[(depth - 1) * bs:depth * bs]) != node.key):
            raise ValueError(f"insert: the known block (block {depth - 1} of its path) is not block {depth - 1} of "
                             f"the {num_blocks} full blocks given")
        path: list[_Node] = []
        above = node
        while above is not self._root:
            path.append(above)
            above = above.parent  # type: ignore[assignment]
        path.reverse()
        keys = self._keys(token_ids[depth * bs:])  # only the blocks below the known one are hashed
        for key in keys:
            child = node.children.get(key)
            if child is None:
                break
            path.append(child)
            node = child
        num_existing = len(path)
        if lazy:
            fresh = tuple(values(j) for j in range(num_existing, num_blocks))  # type: ignore[operator]
            given = tuple(n.value for n in path) + fresh
        else:
            fresh = given[num_existing:]
        if len(set(fresh)) != len(fresh) or any(value in self._by_value for value in fresh):
            raise ValueError("insert: a new block value is repeated or already held by another cached block")
        stored_under = node
        for key, value in zip(keys[num_existing - depth:], fresh):
            child = _Node(key=key, value=value, parent=node, serial=next(self._serials), depth=node.depth + 1)
            node.children[key] = child
            self._leaves.discard(node)
            self._leaves.add(child)
            self._by_value[value] = child
            path.append(child)
            node = child
        self._clock += 1
        for path_node in path:
            path_node.last_access = self._clock
        if self._observer is not None and fresh:
            parent = None if stored_under is self._root else stored_under.serial
            self._observer.blocks_stored(parent, [StoredBlock(n.serial, n.key) for n in path[num_existing:]])
        return InsertResult(num_existing, tuple(n.value for n in path), given)

    def evict(self, max_blocks: int, can_evict: Callable[[BlockValue], bool]) -> list[BlockValue]:
        """Remove up to ``max_blocks`` leaves, least recently used first, skipping any whose value
        ``can_evict`` rejects; returns the removed values in eviction order (the caller frees them).

        ``max_blocks <= 0`` is a no-op. ``can_evict`` must not modify the index.
        """
        return self._evict(max_blocks, can_evict, clearing=False)

    def clear(self, can_evict: Callable[[BlockValue], bool]) -> list[BlockValue]:
        """Remove every block that can go (``evict`` with no limit): leaves ``can_evict`` accepts, repeatedly.
        When that empties the index an observer gets one ``all_cleared`` instead of ``blocks_removed``."""
        return self._evict(len(self._by_value), can_evict, clearing=True)

    def _evict(self, max_blocks: int, can_evict: Callable[[BlockValue], bool], *, clearing: bool) -> list[BlockValue]:
        if max_blocks <= 0:
            return []
        heap = [(leaf.last_access, leaf.serial, leaf) for leaf in self._leaves]
        heapq.heapify(heap)
        evicted: list[BlockValue] = []
        removed: list[int] = []
        while heap and len(evicted) < max_blocks:
            _, _, leaf = heapq.heappop(heap)
            if not can_evict(leaf.value):
                continue
            parent = self._remove_leaf(leaf)
            evicted.append(leaf.value)
            removed.append(leaf.serial)
            if parent is not self._root and not parent.children:
                heapq.heappush(heap, (parent.last_access, parent.serial, parent))
        if self._observer is not None and removed:
            if clearing and not self._by_value:
                self._observer.all_cleared()
            else:
                self._observer.blocks_removed(removed)
        return evicted

    def _remove_leaf(self, leaf: _Node) -> _Node:
        parent = leaf.parent
        assert parent is not None and not leaf.children
        del parent.children[leaf.key]
        del self._by_value[leaf.value]
        self._leaves.discard(leaf)
        if parent is not self._root and not parent.children:
            self._leaves.add(parent)
        return parent

    def check_integrity(self) -> None:
        """Raise RuntimeError unless every node is reachable once, keys are one full block and match
        their parent's child map, the value map and leaf set agree with the tree, and no node is newer
        than the clock."""
        seen: dict[BlockValue, _Node] = {}
        leaves: set[_Node] = set()
        stack = [self._root]
        while stack:
            node = stack.pop()
            for key, child in node.children.items():
                if (child.parent is not node or child.key != key or len(key) != self.block_size
                        or child.depth != node.depth + 1):
                    raise RuntimeError(f"RadixPrefixIndex: malformed child {key!r}")
                if child.value in seen:
                    raise RuntimeError(f"RadixPrefixIndex: value {child.value!r} held by two nodes")
                if child.last_access > self._clock:
                    raise RuntimeError("RadixPrefixIndex: node stamped in the future")
                seen[child.value] = child
                if not child.children:
                    leaves.add(child)
                stack.append(child)
        if seen.keys() != self._by_value.keys() or any(self._by_value[v] is not n for v, n in seen.items()):
            raise RuntimeError("RadixPrefixIndex: value map disagrees with the tree")
        if leaves != self._leaves:
            raise RuntimeError("RadixPrefixIndex: leaf set disagrees with the tree")
