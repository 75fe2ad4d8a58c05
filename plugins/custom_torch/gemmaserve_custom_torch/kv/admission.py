"""`KVAdmission`: window-aware KV reservations (``kv_reserve`` / ``kv_release``).

A request that will hold at most ``n`` tokens reserves, per group, the most blocks a row of ``n`` tokens can
ever hold (``GroupGeometry.max_blocks``): ``ceil(n/bs)`` in the full group, ``min(ceil(n/bs), ceil(W/bs)+1)``
in the sliding group (see ``pools.py`` for why ``+1`` and not more). It is admitted only if, in every group,
the sum of reservations fits the group's block count. Blocks held only by the prefix cache count as free: the
cache gives them back on demand. Hence an admitted request's allocations never fail (reservations bound what
rows hold). Blocks only: the token budget (``MAX_ACTIVE_KV_TOKENS``) is the core scheduler's, enforced once
there (validation and admission); ``reserved_tokens`` here is a statistic.
"""

from __future__ import annotations

from gemmaserve.errors import InvalidRequestError, KVCapacityError

from ..models.config import SLIDING
from .pools import GroupGeometry

__all__ = ["KVAdmission"]


class KVAdmission:
    """Reservations by request id. Mutated by ``reserve``/``release``; single-threaded (backend lock)."""

    def __init__(self, geometry: dict[str, GroupGeometry], capacity: dict[str, int]) -> None:
        if set(geometry) != set(capacity):
            raise ValueError(f"geometry groups {sorted(geometry)} != capacity groups {sorted(capacity)}")
        self.geometry = dict(geometry)
        self.capacity = dict(capacity)
        self._reservations: dict[str, tuple[int, dict[str, int]]] = {}
        self.reserved = {group: 0 for group in capacity}
        self.reserved_tokens = 0
        self.rejections = 0

    def footprint(self, num_tokens: int) -> dict[str, int]:
        """Blocks per group a request of up to ``num_tokens`` tokens may hold at once."""
        return {group: geometry.max_blocks(num_tokens) for group, geometry in self.geometry.items()}

    def max_tokens(self, limit: int) -> int:
        """The largest token count up to ``limit`` whose :meth:`footprint` fits the pools (0 if not even one token:
        footprints grow with the count, so a bisection finds it)."""
        low, high = 0, limit
        while low < high:
            mid = (low + high + 1) // 2
            if all(blocks <= self.capacity[group] for group, blocks in self.footprint(mid).items()):
                low = mid
            else:
                high = mid - 1
        return low

    def reserve(self, request_id: str, num_tokens: int) -> bool:
        """Reserve for ``request_id`` (replacing an earlier reservation of the same id). False = does not fit
        now. Raises KVCapacityError if it could never fit, InvalidRequestError if ``num_tokens < 1``."""
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 1:
            raise InvalidRequestError(f"a KV reservation needs a positive token count, got {num_tokens!r}")
        need = self.footprint(num_tokens)
        self._check_ever_fits(num_tokens, need)
        self.release(request_id)
        fits = all(self.reserved[group] + blocks <= self.capacity[group] for group, blocks in need.items())
        if not fits:
            self.rejections += 1
            return False
        self._reservations[request_id] = (num_tokens, need)
        for group, blocks in need.items():
            self.reserved[group] += blocks
        self.reserved_tokens += num_tokens
        return True

    def _check_ever_fits(self, num_tokens: int, need: dict[str, int]) -> None:
        for group, blocks in need.items():
            if blocks > self.capacity[group]:
                raise KVCapacityError(
                    f"the request needs {blocks} blocks of the {group} KV pool ({num_tokens} tokens) but the pool has "
                    f"{self.capacity[group]} in total; lower max_tokens, shorten the prompt, or raise "
                    + ("CUSTOM_BACKEND_SLIDING_BLOCKS (if set) or " if group == SLIDING else "")
                    + "CUSTOM_BACKEND_KV_MEMORY_GB / CUSTOM_BACKEND_KV_BLOCKS"
                )

    def release(self, request_id: str) -> None:
        """Give back ``request_id``'s reservation; unknown ids are ignored (idempotent)."""
        held = self._reservations.pop(request_id, None)
        if held is None:
            return
        num_tokens, need = held
        for group, blocks in need.items():
            self.reserved[group] -= blocks
        self.reserved_tokens -= num_tokens

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._reservations

    def __len__(self) -> int:
        return len(self._reservations)

    def check_integrity(self) -> None:
        """Totals equal the sum of the reservations and fit every capacity."""
        for group in self.capacity:
            total = sum(need[group] for _, need in self._reservations.values())
            if total != self.reserved[group] or total > self.capacity[group]:
                raise RuntimeError(f"KVAdmission: {group} reserved {self.reserved[group]} (sum {total}) vs capacity")
        tokens = sum(n for n, _ in self._reservations.values())
        if tokens != self.reserved_tokens:
            raise RuntimeError(f"KVAdmission: reserved tokens {self.reserved_tokens} != the reservations' sum {tokens}")
