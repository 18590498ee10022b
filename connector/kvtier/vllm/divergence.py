"""Prompts that stop sharing their prefix with an earlier one: where, by chunk.

A value that changes early in every prompt (a timestamp or a request id in the system prompt)
makes each request's chained chunk hashes differ from that chunk on, so nothing after it is
ever reused, and the hit rate alone does not say why. The scheduler side keeps, per first
chunk, the chunk hashes of the last request that began with it, and compares each new request
with them:

* its lookup found fewer leading chunks than that earlier request had, and
* its hashes equal the earlier request's up to the first chunk not found, and differ there:
  the prompt itself changed at that chunk (a divergence).

Equal hashes at the first chunk not found mean the chunk was evicted, or the earlier request
has not saved it yet: not a divergence. A lookup that found more than the two prompts share
was served by a third prompt: not this comparison's business either.

A divergence is not always a fault: prompts of different users after one shared system prompt
diverge too. What points to a changing value is the same chunk index again and again for
prompts that should share more (the same document, the next turn of a conversation).

Bounded memory: at most ``max_prompts`` first chunks (least recently seen dropped), each with at
most ``max_chunks`` hashes cut to 8 bytes (a comparison, not a key: a collision hides one
divergence, nothing else): 8 MiB at most with the defaults, far less for usual prompts.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

#: First chunks remembered (distinct prompt beginnings).
MAX_PROMPTS = 4096
#: Chunks remembered per prompt (64k tokens with 256-token chunks): a changing value that
#: matters sits early in the prompt.
MAX_CHUNKS = 256
#: Bytes of each chunk hash kept for the comparison.
_DIGEST_BYTES = 8


@dataclass(frozen=True)
class Divergence:
    """A request whose prompt differs from an earlier one's from ``chunk`` on."""

    #: Index of the first chunk that differs (= the leading chunks the two share).
    chunk: int
    #: Full chunks of this request's prompt, and of the earlier request's (as far as kept).
    prompt_chunks: int
    earlier_chunks: int

    def message(self, req_id: str, chunk_size: int) -> str:
        """The server log's line (after "kvtier: "), tokens counted from 0."""
        first, last = self.chunk * chunk_size, (self.chunk + 1) * chunk_size - 1
        return (
            f"request {req_id}: its prompt diverges from an earlier request's at chunk "
            f"{self.chunk} (tokens {first}-{last}): {self.chunk} of its {self.prompt_chunks} "
            f"chunks shared, the other {self.prompt_chunks - self.chunk} computed again (the "
            f"earlier request had {self.earlier_chunks}). A value that changes early in the "
            "prompt (a timestamp, a request id) stops reuse from there; `kvtier explain` on "
            "both prompts shows where"
        )


def _digests(hashes: Sequence[str]) -> bytes:
    # A chunk id is "<hash>" or "<namespace>/<hash>": its last hex digits are the hash's.
    return b"".join(bytes.fromhex(h[-2 * _DIGEST_BYTES :]) for h in hashes)


class PrefixHistory:
    """Chunk hashes of the last request per first chunk (see the module docstring)."""

    def __init__(self, max_prompts: int = MAX_PROMPTS, max_chunks: int = MAX_CHUNKS) -> None:
        if max_prompts < 1 or max_chunks < 1:
            raise ValueError(
                f"max_prompts ({max_prompts}) and max_chunks ({max_chunks}) must be >= 1"
            )
        self.max_prompts = max_prompts
        self.max_chunks = max_chunks
        self._by_first: OrderedDict[str, bytes] = OrderedDict()

    def __len__(self) -> int:
        return len(self._by_first)

    def observe(self, hashes: Sequence[str], found: int) -> Divergence | None:
        """Record a request's full-chunk ``hashes`` (prompt order) and the leading chunks its
        lookup ``found``; the divergence from the earlier request with the same first chunk,
        if its prompt changed right where its lookup stopped."""
        if not hashes:
            return None
        first = hashes[0]
        mine = _digests(hashes[: self.max_chunks])
        earlier = self._by_first.pop(first, None)
        self._by_first[first] = mine  # the most recent request is the one compared next
        while len(self._by_first) > self.max_prompts:
            self._by_first.popitem(last=False)
        if earlier is None:
            return None
        earlier_chunks = len(earlier) // _DIGEST_BYTES
        mine_chunks = len(mine) // _DIGEST_BYTES
        if found >= min(earlier_chunks, mine_chunks):
            return None  # found all the earlier request had, or all of this prompt (as kept)
        cut = found * _DIGEST_BYTES
        if mine[:cut] != earlier[:cut]:
            return None  # the two differ before: the found chunks came from another prompt
        if mine[cut : cut + _DIGEST_BYTES] == earlier[cut : cut + _DIGEST_BYTES]:
            return None  # the same chunk, not stored (evicted, or not saved yet)
        return Divergence(chunk=found, prompt_chunks=len(hashes), earlier_chunks=earlier_chunks)
