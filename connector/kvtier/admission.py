"""Admission to the shared tier: a chunk goes to S3 once its prefix has been seen often enough.

A cache that writes every one-off prompt to Ceph spends the cluster's write bandwidth and
capacity on chunks nobody reads again. With ``remote_admit_after: N`` a chunk is written to the
remote tier only from the N-th request whose prompt contains its prefix on; the local tiers (CPU,
disk) take every chunk, as before, so a prefix seen once is still reused on its own host.

The count is kept by the scheduler side (one per vLLM server), which sees every request's chunk
ids at its lookup, including the chunks vLLM's own prefix cache holds. A chunk whose count
reaches N is written:

- as it is computed, if no tier held it (a normal save, to every tier);
- from the request's own KV, if a local tier held it (or vLLM's prefix cache did): the chunks
  are then saved to the remote tier only ("late admission"), after the step that loaded them.

Counts live in `SightCounter`, an LRU table of at most ``admission_window_chunks`` chunk ids
(a few hundred bytes each): a chunk not seen within the window starts again from one. A
restart forgets the counts, which only delays admission; nothing is ever written early.
Servers count apart: with N = 2, a prefix seen once on each of two servers is not admitted
(a prefix-aware router keeps a prefix on one server).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Sequence
from typing import Literal

#: Which tiers a save writes: every tier; the local ones only (the remote tier does not admit
#: the chunk yet); the remote one only (a chunk the local tiers hold, admitted now).
SaveTiers = Literal["all", "local", "remote"]


def writes_to(tiers: SaveTiers, remote: bool) -> bool:
    """Whether a save of ``tiers`` writes a tier that is (``remote``) or is not the remote one."""
    return tiers == "all" or (tiers == "remote") == remote


class SightCounter:
    """How many requests contained each chunk, for the ``capacity`` most recently seen chunks."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"a sight counter needs room for at least one chunk, not {capacity}")
        self.capacity = capacity
        self._counts: OrderedDict[Hashable, int] = OrderedDict()

    def see(self, chunk_ids: Sequence[Hashable]) -> list[int]:
        """Count one more sight of each of ``chunk_ids`` (one request's prompt); their counts
        now, in the same order."""
        counts = []
        for chunk in chunk_ids:
            n = self._counts.pop(chunk, 0) + 1
            self._counts[chunk] = n
            counts.append(n)
        while len(self._counts) > self.capacity:
            self._counts.popitem(last=False)
        return counts

    def __len__(self) -> int:
        return len(self._counts)


class Admission:
    """The remote tier's admission rule: ``after`` sights (1: every chunk, no counting)."""

    def __init__(self, after: int, window_chunks: int) -> None:
        if after < 1:
            raise ValueError(f"remote_admit_after must be at least 1, not {after}")
        self.after = after
        self._sights = SightCounter(window_chunks) if after > 1 else None

    def see(self, chunk_ids: Sequence[Hashable]) -> list[int]:
        """Count a request's chunks; their counts (all ``after`` when nothing is counted)."""
        if self._sights is None:
            return [self.after] * len(chunk_ids)
        return self._sights.see(chunk_ids)

    def admits(self, count: int) -> bool:
        """A chunk seen ``count`` times goes to the remote tier."""
        return count >= self.after

    def admits_now(self, count: int) -> bool:
        """A chunk seen ``count`` times reached the rule with this sight: one the local tiers
        hold goes to the remote tier now (before, it was not admitted; after, it was)."""
        return self.after > 1 and count == self.after
