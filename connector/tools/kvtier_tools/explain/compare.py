"""Where prompts stop sharing a prefix, in tokens and in kvtier's chunks.

Chunk keys are the connector's (`kvtier.keys.chunk_hashes`): chained, so two prompts share
chunk i exactly when they share every token up to the end of chunk i. A prompt can be served
from the cache up to its first chunk that differs from every prompt sent before it; the prompt
that shares the longest prefix with it is the one to compare it with.

Two prompts whose requests differ in identity (another ``cache_salt``, another model or LoRA
adapter, another namespace, images or audio) share no chunk, whatever their tokens: a salt is
put into the keys as the server does (so the tiers are asked for the right chunks); for the
others the keys cannot be computed here, and the prompts are said to differ at chunk 0.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvtier.keys import chunk_hashes, encode_extra_keys


@dataclass(frozen=True)
class Rendered:
    label: str
    tokens: list[int]
    hashes: list[str]  # one per full chunk
    identity: tuple[tuple[str, str], ...] = ()

    @classmethod
    def of(
        cls,
        label: str,
        tokens: list[int],
        chunk_size: int,
        identity: tuple[tuple[str, str], ...] = (),
    ) -> Rendered:
        salt = dict(identity).get("cache_salt")
        extras = None
        if salt and len(tokens) >= chunk_size:
            n = len(tokens) // chunk_size
            extras = [encode_extra_keys([("cache_salt", salt)])] + [b""] * (n - 1)
        return cls(label, tokens, chunk_hashes(tokens, chunk_size, extras=extras), identity)


def identity_difference(a: Rendered, b: Rendered) -> str | None:
    """How the identities of two requests differ, e.g. "cache_salt 'a' vs none"."""
    da, db = dict(a.identity), dict(b.identity)
    diffs = [
        f"{k} {da[k]!r} vs {db[k]!r}"
        if k in da and k in db
        else f"{k} {da[k]!r} vs none"
        if k in da
        else f"{k} none vs {db[k]!r}"
        for k in sorted(set(da) | set(db))
        # A request without "model" asks for the served default, which may be the other's.
        if da.get(k) != db.get(k) and (k != "model" or (k in da and k in db))
    ]
    return "; ".join(diffs) or None


@dataclass(frozen=True)
class Divergence:
    """How prompt ``index`` relates to the prompt sharing its longest prefix (``partner``)."""

    index: int
    partner: int
    shared_tokens: int  # leading tokens equal to the partner's
    shared_chunks: int  # leading full chunks with the same key
    chunks: int  # full chunks of this prompt
    kind: str  # identical | contained (all of it begins the partner) | extends | diverges
    #: Set when the two requests differ in identity (then no chunk is shared at all).
    other_identity: str | None = None

    @property
    def position(self) -> int | None:
        """The first token that differs (None: every token of this prompt is in the partner)."""
        return None if self.kind in ("identical", "contained") else self.shared_tokens


def _common_prefix(a: list[int], b: list[int]) -> int:
    """Leading tokens equal in both (binary search over slice comparisons, done in C)."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _shared_chunks(a: list[str], b: list[str]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def divergences(prompts: list[Rendered]) -> list[Divergence]:
    """For each prompt, its relation to the other prompt sharing the longest prefix (on ties
    the earliest, except that an identical copy comes before a longer prompt it begins)."""
    out = []
    for i, p in enumerate(prompts):
        others = [j for j in range(len(prompts)) if j != i]
        shared = {j: _common_prefix(p.tokens, prompts[j].tokens) for j in others}

        n = len(p.tokens)
        ranks = [
            (-shared[j], len(prompts[j].tokens) - n if shared[j] == n else 0, j) for j in others
        ]
        best = min(ranks)[2]
        best_len, q = shared[best], prompts[best]
        if best_len == len(p.tokens) == len(q.tokens):
            kind = "identical"
        elif best_len == len(p.tokens):
            kind = "contained"
        elif best_len == len(q.tokens):
            kind = "extends"
        else:
            kind = "diverges"
        other = identity_difference(p, q)
        chunks = 0 if other else _shared_chunks(p.hashes, q.hashes)
        out.append(Divergence(i, best, best_len, chunks, len(p.hashes), kind, other))
    return out
