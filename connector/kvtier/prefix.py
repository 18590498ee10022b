"""How many leading chunks of a prompt a remote tier holds, asking it a few times only.

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

from collections.abc import Callable, Sequence

#: Probes per round of the search (4: three in parallel, then the interval shrinks by 4).
FANOUT = 4


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
