"""How many leading chunks of a prompt a remote tier holds, asking it a few times only.

With one chunk per object (:func:`leading_present`):

A chunk's key covers its whole prefix (chained hashes) and chunks are saved in prefix order, so
along one prompt presence is monotone: chunks 0..k-1 are stored, k.. are not. That makes the
answer a search, not a scan of one request per chunk:

* the last chunk first: a prompt seen before (the common hit) costs one request;
* then the first: a new prompt costs two;
* otherwise a k-ary search between a present and an absent chunk, ``fanout - 1`` probes in
  parallel per round (log_fanout n rounds).

Monotonicity can be broken behind kvtier's back (one object expired or deleted in the middle):
the search may then report chunks past the hole. That is a wrong guess, never wrong KV: loading
the missing chunk fails and vLLM recomputes from there.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

#: Probes per round of the search (4: three in parallel, then the interval shrinks by 4).
FANOUT = 4
#: Objects asked per round of the walk over objects of several chunks.
WALK_ROUND = 4


def leading_present(
    contains_many: Callable[[Sequence[str]], list[bool]],
    keys: Sequence[str],
    fanout: int = FANOUT,
) -> tuple[int, int]:
    """(leading keys present, requests made) for ``keys`` in prompt order."""
    n = len(keys)
    if n == 0:
        return 0, 0
    ends = [keys[-1]] if n == 1 else [keys[0], keys[-1]]
    first_last = contains_many(ends)
    asked = len(ends)
    if first_last[-1]:
        return n, asked
    if not first_last[0] or n == 1:
        return 0, asked
    lo, hi = 0, n - 1  # keys[lo] present, keys[hi] absent
    while hi - lo > 1:
        step = (hi - lo) / fanout
        points = sorted({lo + max(1, round(step * i)) for i in range(1, fanout)} - {hi})
        points = [p for p in points if lo < p < hi]
        present = contains_many([keys[p] for p in points])
        asked += len(points)
        new_lo, new_hi = lo, hi
        for p, ok in zip(points, present, strict=True):
            if not ok:
                new_hi = p
                break
            new_lo = p
        lo, hi = new_lo, new_hi
    return lo + 1, asked


@dataclass(frozen=True)
class RemotePrefix:
    """What a remote tier holds of a prompt: its first ``found`` chunks, in ``objects`` (first
    chunk index, chunks of the prompt in that object), which cover chunks 0..found-1 in order;
    ``requests`` made to find out."""

    found: int = 0
    objects: tuple[tuple[int, int], ...] = ()
    requests: int = 0

    def holds(self, chunk: int) -> bool:
        """Whether the lookup saw ``chunk`` in one of the remote tier's objects (a walk over
        objects of several chunks starts at the first chunk; a search over one-chunk objects
        starts after the local tiers' chunks, so it never says so for those)."""
        first, _ = self.object_of(chunk)
        return first != chunk or any(start == chunk for start, _ in self.objects)

    def object_of(self, chunk: int) -> tuple[int, int]:
        """(first chunk index of the object holding ``chunk``, its position in that object);
        (chunk, 0) for a chunk in no object of the chain (an object of its own)."""
        i = bisect.bisect_right(self.objects, (chunk, math.inf)) - 1  # by first chunk index
        if i >= 0:
            first, count = self.objects[i]
            if chunk < first + count:
                return first, chunk - first
        return chunk, 0


def walk_objects(
    heads: Callable[[Sequence[str]], list[list[str] | None]],
    keys: Sequence[str],
    shorts: Sequence[str],
    span: int,
) -> RemotePrefix:
    """The chain of objects of several chunks that holds a prompt's leading chunks.

    An object is keyed by its first chunk (``keys[i]`` is chunk i's key) and lists its chunks
    (``shorts[i]`` is chunk i's short hash). Writers start a new object where what the tier held
    ended and cut it every ``span`` chunks, so from a position ``p`` the next objects most
    likely start at p, p+span, p+2*span... (``span``: a first guess, then the length of the last
    object found): each round asks for ``WALK_ROUND`` of them at once and follows the chain
    while the guesses hold. An object whose chunks stop matching the prompt ends its part of
    the chain there (another prompt wrote the rest); the walk then asks for an object starting
    at that chunk. It ends at the first absent object.
    """
    n = len(keys)
    objects: list[tuple[int, int]] = []
    p = asked = 0
    while p < n:
        guesses = [g for g in range(p, p + WALK_ROUND * span, span) if g < n]
        answers = heads([keys[g] for g in guesses])
        asked += len(guesses)
        for g, listed in zip(guesses, answers, strict=True):
            if g != p:  # the chain did not reach this guess: ask again from where it is
                break
            if listed is None:
                return RemotePrefix(p, tuple(objects), asked)
            listed = listed or [shorts[g]]
            m = 0
            while m < len(listed) and g + m < n and listed[m] == shorts[g + m]:
                m += 1
            if m == 0:  # under this chunk's key, another chunk: unusable
                return RemotePrefix(p, tuple(objects), asked)
            objects.append((g, m))
            p = g + m
            if m < len(listed):  # the rest is another prompt's: ask for an object starting at p
                break
            span = len(listed)  # the next ones most likely hold as many (one writer's cut)
    return RemotePrefix(p, tuple(objects), asked)
