"""Prompts that share a prefix with a prompt being prefilled wait for its blocks instead of computing them again.

When requests that share a long prefix (a system prompt, a few-shot preamble, a document asked several
questions) arrive together, every one of them would look up the prefix cache before any of them has stored the
prefix, and each would compute it again: 64 requests sharing 1,536 tokens compute 98,304 prefix tokens instead of
1,536. The scheduler therefore leaves a request that has not been looked up yet without budget while an earlier
request (its *leader*) is still computing blocks the two prompts share; looked up afterwards, it hits them.

A wait must save at least one chunk (``PREFILL_CHUNK_TOKENS``) of the follower's own prefill, and costs it at
most about one tick; whether waiting pays depends on when the backend makes a prompt's blocks findable:

- *progressively* (custom_torch indexes the full blocks of every chunk as it is computed): wait while the leader
  has yet to compute such blocks. The follower's chunks would be capped per tick just as the leader's are, so
  its first token comes at most one tick later, and the shared tokens are computed once;
- *on completion* (the core ``CacheManager``: ``prefill_store`` after the last chunk): wait only if the leader's
  remaining prompt plus the follower's own part take at most one tick more than the follower computing the
  shared blocks itself.

Only full blocks count: caches index whole blocks. A leader's own cache hit is findable already, so followers
of a prompt that hit the cache do not wait for it.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence

__all__ = ["common_prefix_len", "should_wait"]


def common_prefix_len(a: Sequence[int], b: Sequence[int], at_least: int = 1) -> int:
    """Length of the longest common prefix of ``a`` and ``b``; 0 when they differ within the first
    ``at_least`` tokens (a cheap rejection for the common case). Slice comparisons run at C speed."""
    limit = min(len(a), len(b))
    first = min(at_least, limit)
    if first == 0 or a[:first] != b[:first]:
        return 0
    low, high = first, limit  # a[:low] == b[:low] holds; find the largest such low
    while low < high:
        mid = (low + high + 1) // 2
        if a[low:mid] == b[low:mid]:
            low = mid
        else:
            high = mid - 1
    return low


def should_wait(prompt: Sequence[int], leaders: Iterable[tuple[Hashable, Sequence[int], int, int]], block_size: int,
                *, progressive: bool, chunk: int, memo: dict[Hashable, int] | None = None) -> bool:
    """Whether ``prompt`` (not looked up yet) should wait for one of ``leaders``: (key, prompt, tokens computed so
    far, tokens a lookup finds now) of earlier requests whose prefill is under way. ``progressive``: the backend's
    cache finds a prompt's blocks as soon as they are computed, else only once its prefill completed.
    ``chunk``: the most prompt tokens a request computes per tick. ``memo`` (the follower's, mutated): common
    prefix lengths by leader key, so each pair of prompts is compared once. A leader whose findable blocks leave
    less than a chunk of the shorter prompt to share is skipped before any comparison (a burst that hits a cached
    prefix: 64 prompts of 1,600 tokens made 2,016 comparisons per tick). See the module docstring."""
    saving = max(block_size, chunk)
    for key, leader, computed, findable in leaders:
        found = findable // block_size * block_size
        if min(len(prompt), len(leader)) // block_size * block_size - found < saving:
            continue  # even a whole shared prefix would save less than a chunk
        common = memo.get(key) if memo is not None else None
        if common is None:
            common = common_prefix_len(prompt, leader, block_size)
            if memo is not None:
                memo[key] = common
        shared = common // block_size * block_size
        if shared - found < saving:  # waiting would save less than a chunk
            continue
        if progressive:
            return True
        ticks_waiting = -(-(len(leader) - computed) // chunk) + -(-(len(prompt) - shared) // chunk)
        if ticks_waiting <= -(-(len(prompt) - found) // chunk) + 1:
            return True
    return False
