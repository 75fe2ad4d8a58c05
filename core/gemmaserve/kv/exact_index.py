"""Exact-match index: a WHOLE token sequence -> the values of all its blocks, partial tail included.

The radix index only holds full blocks, so a prompt of ``n`` tokens can hit at most
``n - n % block_size`` of them there. This index remembers whole stored sequences, including the
value of the partial last block (the *tail*), so a repeated prompt hits every token.

Hash choice: entries live in a dict keyed by the token tuple itself. Python hashes the whole tuple
and, on a hash collision, compares the tuples element by element, so a collision can cost time but
can never return another sequence's KV. The stored key is the verification copy.

An entry refers to its radix path values (held by the radix index's owner) and owns no reference
itself; the owner must call :meth:`remove_value` whenever one of those values leaves the radix
index, and frees the tails of the entries it returns. Tails are unique to their entry. Eviction
(:meth:`evict_tails`) is LRU over entries; :meth:`get` counts as a use. Not thread-safe.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from gemmaserve.kv.radix import BlockValue

__all__ = ["ExactEntry", "ExactMatchIndex"]


@dataclass(frozen=True, slots=True)
class ExactEntry:
    """One stored sequence. ``path_values[k]`` holds tokens ``[k*bs, (k+1)*bs)``; ``tail_value`` holds
    the last ``len(token_ids) % bs`` tokens and is None iff the sequence is block-aligned."""

    token_ids: tuple[int, ...]
    path_values: tuple[BlockValue, ...]
    tail_value: BlockValue | None

    @property
    def values(self) -> tuple[BlockValue, ...]:
        """Values covering every token, in order."""
        return self.path_values if self.tail_value is None else (*self.path_values, self.tail_value)


class ExactMatchIndex:
    """Token tuple -> :class:`ExactEntry`, with a reverse map from every referenced value to its entries."""

    def __init__(self, block_size: int) -> None:
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be an integer >= 1, got {block_size!r}")
        self.block_size = block_size
        self._entries: OrderedDict[tuple[int, ...], ExactEntry] = OrderedDict()  # LRU first
        self._by_value: dict[BlockValue, set[tuple[int, ...]]] = {}
        self._tails: dict[BlockValue, tuple[int, ...]] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, token_ids: object) -> bool:
        """True if exactly this sequence (a tuple or list of ints) is recorded; not a use."""
        return isinstance(token_ids, (tuple, list)) and tuple(token_ids) in self._entries

    @property
    def num_tails(self) -> int:
        return len(self._tails)

    def entries(self) -> Iterator[ExactEntry]:
        """All entries, least recently used first (read-only; does not count as a use)."""
        return iter(list(self._entries.values()))

    def get(self, token_ids: Sequence[int]) -> ExactEntry | None:
        """The entry for exactly ``token_ids`` (marked most recently used), or None."""
        key = tuple(token_ids)
        entry = self._entries.get(key)
        if entry is not None:
            self._entries.move_to_end(key)
        return entry

    def add(
        self, token_ids: Sequence[int], path_values: Sequence[BlockValue], tail_value: BlockValue | None
    ) -> bool:
        """Record ``token_ids``; returns False (changing nothing) if it is already recorded.

        ``path_values`` must have one value per full block; ``tail_value`` must be given iff the length
        is not block-aligned, and must not be referenced by any entry yet. Raises ValueError otherwise.
        """
        key = tuple(token_ids)
        path = tuple(path_values)
        num_full, remainder = divmod(len(key), self.block_size)
        if len(path) != num_full:
            raise ValueError(f"got {len(path)} path values for {num_full} full blocks of {len(key)} tokens")
        if (tail_value is None) != (remainder == 0):
            raise ValueError(f"a tail value is required iff the length ({len(key)}) is not block-aligned")
        if key in self._entries:
            return False
        if tail_value is not None and (tail_value in self._by_value or tail_value in path):
            raise ValueError(f"tail value {tail_value!r} is already referenced")
        if any(value in self._tails for value in path):
            raise ValueError("a path value is another entry's tail")
        entry = ExactEntry(key, path, tail_value)
        self._entries[key] = entry
        for value in entry.values:
            self._by_value.setdefault(value, set()).add(key)
        if tail_value is not None:
            self._tails[tail_value] = key
        return True

    def pop(self, token_ids: Sequence[int]) -> ExactEntry | None:
        """Remove and return the entry for exactly ``token_ids`` (None if there is none): the caller now owns its
        tail (frees it, or hands it on)."""
        key = tuple(token_ids)
        return self._remove(key) if key in self._entries else None

    def remove_value(self, value: BlockValue) -> list[ExactEntry]:
        """Drop every entry whose path or tail holds ``value``; returns them (caller frees their tails)."""
        keys = self._by_value.get(value)
        if not keys:
            return []
        return [self._remove(key) for key in list(keys)]

    def evict_tails(self, max_entries: int, can_evict: Callable[[BlockValue], bool]) -> list[ExactEntry]:
        """Drop up to ``max_entries`` entries that have a tail, least recently used first, skipping those
        whose tail ``can_evict`` rejects; returns them (caller frees their tails). ``<= 0`` is a no-op."""
        evicted: list[ExactEntry] = []
        if max_entries <= 0:
            return evicted
        for key, entry in list(self._entries.items()):
            if len(evicted) == max_entries:
                break
            if entry.tail_value is not None and can_evict(entry.tail_value):
                evicted.append(self._remove(key))
        return evicted

    def _remove(self, key: tuple[int, ...]) -> ExactEntry:
        entry = self._entries.pop(key)
        for value in set(entry.values):
            keys = self._by_value[value]
            keys.discard(key)
            if not keys:
                del self._by_value[value]
        if entry.tail_value is not None:
            del self._tails[entry.tail_value]
        return entry

    def check_integrity(self) -> None:
        """Raise RuntimeError unless every entry is keyed by its own tokens, has the right shape, and
        the reverse and tail maps list exactly the entries' values."""
        by_value: dict[BlockValue, set[tuple[int, ...]]] = {}
        tails: dict[BlockValue, tuple[int, ...]] = {}
        for key, entry in self._entries.items():
            num_full, remainder = divmod(len(key), self.block_size)
            if entry.token_ids != key or len(entry.path_values) != num_full or (entry.tail_value is None) != (
                remainder == 0
            ):
                raise RuntimeError(f"ExactMatchIndex: malformed entry for {len(key)} tokens")
            for value in entry.values:
                by_value.setdefault(value, set()).add(key)
            if entry.tail_value is not None:
                if entry.tail_value in tails:
                    raise RuntimeError(f"ExactMatchIndex: tail {entry.tail_value!r} shared by two entries")
                tails[entry.tail_value] = key
        if by_value != self._by_value or tails != self._tails:
            raise RuntimeError("ExactMatchIndex: reverse maps disagree with the entries")
        if any(len(by_value[tail]) != 1 for tail in tails):
            raise RuntimeError("ExactMatchIndex: a tail value is also another entry's path value")
