"""The workload `kvtier plan` sizes tiers for, and the analytic estimate of its hit rate.

Workload: conversations that grow. A request either starts a conversation (share
``1 - continue_share``: a first prompt of ``prefix_tokens``, all computed) or continues one of
the open conversations picked at random: the conversation so far (its previous prompt, whose
chunks a tier may hold) plus ``turn_tokens`` new tokens (the answer and the new message). In the
steady state ``conversations`` are open and a new one replaces one at random; a run of
``requests`` from an empty cache (what the benchmarks measure) opens new ones until
``conversations`` are open (no limit when None).

Analytic estimate (Che's approximation for LRU, per conversation): every request touches one
of the N conversation slots, so a conversation was last touched G requests ago with G geometric
(p = 1/N). Its first chunk is still cached if the chunks touched since then by the others (the
conversations they continue for the first time in that gap, the chunks that started new ones,
the new turns) plus its own fit in the tier. Chunks of one conversation are touched in order, so
the first goes first: a conversation is resident whole or useless (a chained hash misses from
its first absent chunk). Tiers are taken as inclusive LRUs of their sizes (the store writes
every tier and promotes hits into the faster ones); `simulate.py` runs the store's actual
policies and says how close this is. A run from an empty cache is estimated step by step with
the conversations open at that point (quasi-static).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from kvtier_tools.plan.shape import PlanError

TIERS = ("cpu", "disk", "s3")
_TAIL = 1e-6  # conversation lengths rarer than this are left out of the sums


@dataclass(frozen=True)
class Workload:
    """What the fleet's users send, per serving host."""

    conversations: int | None
    prefix_tokens: int
    turn_tokens: int
    continue_share: float
    rate: float
    requests: int | None = None

    def check(self) -> None:
        if self.requests is None and self.conversations is None:
            raise PlanError("pass --conversations (open at once), or --requests for a short run")
        if self.conversations is not None and self.conversations < 1:
            raise PlanError(f"--conversations {self.conversations}: pass at least 1")
        if self.requests is not None and self.requests < 1:
            raise PlanError(f"--requests {self.requests}: pass at least 1")
        if self.prefix_tokens < 1 or self.turn_tokens < 0:
            raise PlanError("--prefix-tokens must be >= 1 and --turn-tokens >= 0")
        if not 0 <= self.continue_share < 1:
            raise PlanError(
                f"--continue-share {self.continue_share}: pass a share in [0, 1) (some requests "
                "must start conversations, or they would grow without end)"
            )
        if self.rate < 0:
            raise PlanError(f"--rate {self.rate}: pass requests per second, >= 0")


@dataclass
class RequestMix:
    """Per-request averages (``requests`` requests): what the estimate and the simulation
    both produce, so that they compare field by field."""

    requests: float
    prompt_tokens: float
    prompt_chunks: float
    hit_tokens: dict[str, float] = field(default_factory=dict)
    heads: float = 0.0  # S3 HEADs (lookups beyond the local tiers)
    gets: float = 0.0  # S3 GETs (chunks loaded from S3)
    puts: float = 0.0  # S3 PUTs (chunks computed and saved)

    def added(self, other: RequestMix, weight: float = 1.0) -> RequestMix:
        """``self + weight * other``, field by field."""
        hits = dict(self.hit_tokens)
        for tier, v in other.hit_tokens.items():
            hits[tier] = hits.get(tier, 0.0) + weight * v
        return RequestMix(
            self.requests + weight * other.requests,
            self.prompt_tokens + weight * other.prompt_tokens,
            self.prompt_chunks + weight * other.prompt_chunks,
            hits,
            self.heads + weight * other.heads,
            self.gets + weight * other.gets,
            self.puts + weight * other.puts,
        )

    def scaled(self, factor: float) -> RequestMix:
        return RequestMix(0.0, 0.0, 0.0).added(self, factor)

    def hit_rate(self, tier: str | None = None) -> float:
        """Share of prompt tokens loaded (from ``tier``, or from any)."""
        hits = self.hit_tokens.get(tier, 0.0) if tier else sum(self.hit_tokens.values())
        return hits / self.prompt_tokens if self.prompt_tokens else 0.0


@dataclass(frozen=True)
class _Turn:
    """Conversations with ``m`` continuations so far (probability ``p``) and their sizes."""

    p: float
    stored: int  # full chunks its last prompt left in the cache
    after: int  # full chunks of the prompt that continues it
    loadable: int  # tokens of that prompt a hit loads
    loaded: int  # chunks a hit reads
    prompt: int  # tokens of that prompt


class Analytic:
    """The estimate for one workload, chunk and block size (see the module docstring)."""

    def __init__(self, w: Workload, chunk_size: int, block_size: int) -> None:
        w.check()
        self.w, self.chunk, self.block = w, chunk_size, block_size
        self.turns = self._turns()
        c = w.continue_share
        self.first_chunks = w.prefix_tokens // chunk_size
        self.mean_stored = sum(t.p * t.stored for t in self.turns)
        self.mean_after = sum(t.p * t.after for t in self.turns)
        self.mean_turn = sum(t.p * (t.after - t.stored) for t in self.turns)
        self.prompt_tokens = c * sum(t.p * t.prompt for t in self.turns) + (1 - c) * w.prefix_tokens
        self.prompt_chunks = c * self.mean_after + (1 - c) * self.first_chunks

    def _turns(self) -> list[_Turn]:
        w, cs = self.w, self.chunk
        c = w.continue_share
        out, total, m = [], 0.0, 0
        while total < 1 - _TAIL and m < 100_000:
            p = (1 - c) * c**m
            prefix = w.prefix_tokens + m * w.turn_tokens
            prompt = prefix + w.turn_tokens
            loadable = min(prefix // cs * cs, (prompt - 1) // self.block * self.block)
            out.append(_Turn(p, prefix // cs, prompt // cs, loadable, -(-loadable // cs), prompt))
            total, m = total + p, m + 1
        return [replace(t, p=t.p / total) for t in out]

    def _touched(self, k: float, n_open: float) -> float:
        """Distinct chunks the other requests touch in ``k`` requests."""
        c = self.w.continue_share
        others = n_open - 1
        first = others * (1 - math.exp(-k / others)) if others > 0 else 0.0
        return (
            c * first * self.mean_after
            + c * (k - first) * self.mean_turn
            + (1 - c) * k * self.first_chunks
        )

    def resident(self, own_chunks: int, capacity: float, n_open: float) -> float:
        """Probability that a conversation of ``own_chunks`` is still whole in a tier of
        ``capacity`` chunks when the next request continues it."""
        if own_chunks > capacity:
            return 0.0
        room = capacity - own_chunks
        lo, hi = 0.0, 1.0
        while self._touched(hi, n_open) <= room:
            hi *= 2
            if hi > 1e12:
                return 1.0
        for _ in range(60):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if self._touched(mid, n_open) <= room else (lo, mid)
        return 1.0 - float((1.0 - 1.0 / n_open) ** (lo + 1))

    def _mix_at(self, caps: Mapping[str, float], n_open: float) -> RequestMix:
        """One request in the steady state of ``n_open`` conversations, tiers of ``caps``
        chunks (fastest first; a tier holds what a faster one holds when it is larger)."""
        c = self.w.continue_share
        mix = RequestMix(1.0, self.prompt_tokens, self.prompt_chunks)
        cum, below = 0.0, [0.0] * len(self.turns)
        for tier, cap in caps.items():
            cum = max(cum, cap)
            now = [self.resident(t.stored, cum, n_open) for t in self.turns]
            gain = [max(0.0, a - b) for a, b in zip(now, below, strict=True)]
            mix.hit_tokens[tier] = c * sum(
                t.p * g * t.loadable for t, g in zip(self.turns, gain, strict=True)
            )
            if tier == "s3":
                mix.gets = c * sum(
                    t.p * g * t.loaded for t, g in zip(self.turns, gain, strict=True)
                )
                local = sum(t.p * b * t.stored for t, b in zip(self.turns, below, strict=True))
                mix.heads = self.prompt_chunks - c * local
            below = now
        found = c * sum(t.p * b * t.stored for t, b in zip(self.turns, below, strict=True))
        mix.puts = (self.prompt_chunks - found) if "s3" in caps else 0.0
        return mix

    def estimate(self, caps: Mapping[str, float]) -> RequestMix:
        """Per-request averages for tiers of ``caps`` chunks (one rank's)."""
        w = self.w
        if w.requests is None:
            return self._mix_at(caps, float(w.conversations or 1))
        return self._run_from_empty(caps, w.requests)

    def _run_from_empty(self, caps: Mapping[str, float], requests: int) -> RequestMix:
        """Quasi-static: request t sees the conversations open by then; the first is new."""
        w = self.w
        limit = float(w.conversations) if w.conversations else math.inf
        steps = min(requests - 1, 400)
        total = RequestMix(1.0, float(w.prefix_tokens), float(self.first_chunks))
        total.puts = float(self.first_chunks) if "s3" in caps else 0.0
        total.heads = total.puts
        for i in range(steps):
            t = 1 + (requests - 1) * (i + 0.5) / steps
            weight = (requests - 1) / steps
            mix = self._mix_at(caps, min(limit, 1 + (1 - w.continue_share) * t))
            total = total.added(mix, weight)
        return total.scaled(1 / requests)

    def conversations_held(self, capacity: float) -> float:
        return capacity / self.mean_stored if self.mean_stored else math.inf

    def working_set(self) -> float:
        """Chunks the workload keeps alive (steady state) or writes (a run from empty)."""
        w, c = self.w, self.w.continue_share
        if w.requests is None:
            return (w.conversations or 1) * self.mean_stored
        created = 1 + (1 - c) * (w.requests - 1)
        return created * self.first_chunks + c * (w.requests - 1) * self.mean_turn
