"""The tiers simulated request by request, as the connector and the store run them.

Per request (``connector/kvtier/vllm/scheduler.py``, ``store.py``): the scheduler's CPU index
gives the leading chunks in the CPU tier (and refreshes them); the rest is looked up in the disk
tier (a stat) and S3 (HEADs counted one per chunk asked beyond the local tiers, in windows of 32
stopping at the first window with a miss: an upper bound, the connector's lookup is a search of
a few requests, kvtier.prefix); at most ``align_down(prompt - 1, block)`` tokens are loaded,
each chunk from the fastest tier holding it and promoted into the faster ones; the chunks after
the found ones are computed and written to every tier. Policies: CPU LRU; disk LRU refreshed
only by its own reads and writes (a chunk served from CPU does not refresh its disk copy); S3
likewise, capped at the bucket's size: what kvtier's cap on the shared tier keeps
(``max_remote_size``, kvtier.tiers.bounded: a read from S3 touches the object), to within its
pass interval. With an admission rule (``remote_admit_after``, kvtier.admission) a chunk goes to
S3 only from its N-th sight on: computed chunks not admitted yet go to the local tiers only,
and a chunk a local tier holds is written to S3 on the sight that admits it.

Chunks are keyed by conversation and position in the synthetic stream, or by the prompts' real
chunk hashes (`requests_from_prompts`), e.g. experiment C's stream.
"""

from __future__ import annotations

import itertools
import math
import random
import statistics
from collections import OrderedDict
from collections.abc import Hashable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass

from kvtier.admission import Admission
from kvtier.keys import chunk_hashes
from kvtier_tools.plan.workload import TIERS, RequestMix, Workload

_WINDOW = 32  # chunks counted per round of the (upper-bound) S3 HEAD count


@dataclass(frozen=True)
class SimRequest:
    """The full chunks of one prompt (keys that identify their whole prefix) and its length."""

    keys: Sequence[Hashable]
    prompt_tokens: int


def _put(items: OrderedDict[Hashable, None], capacity: float, keys: Iterable[Hashable]) -> None:
    """Write ``keys`` (most recent last), then evict the least recently used beyond the cap."""
    if capacity < 1:
        return
    for key in keys:
        items[key] = None
        items.move_to_end(key)
    while len(items) > capacity:
        items.popitem(last=False)


class TierSimulation:
    """The tiers of ``caps`` (chunks of one rank, fastest first; absent tier = off)."""

    def __init__(
        self,
        caps: Mapping[str, float],
        chunk_size: int,
        block_size: int,
        admit_after: int = 1,
    ) -> None:
        self.chunk, self.block = chunk_size, block_size
        # Counted without a window: the connector's (100,000 chunks by default) outlasts a
        # simulated run's chunks that are seen again.
        self.admission = Admission(admit_after, window_chunks=1 << 62)
        self.names = [name for name in TIERS if name in caps]
        self.caps = [caps[name] for name in self.names]
        self.items: list[OrderedDict[Hashable, None]] = [OrderedDict() for _ in self.names]
        self.mix = RequestMix(0.0, 0.0, 0.0, dict.fromkeys(self.names, 0.0))

    def _tier(self, name: str) -> OrderedDict[Hashable, None] | None:
        return self.items[self.names.index(name)] if name in self.names else None

    def _lookup(self, keys: Sequence[Hashable]) -> tuple[int, int]:
        """(leading chunks found, of which in the CPU tier), counting S3 HEADs."""
        cpu, disk, s3 = (self._tier(n) for n in TIERS)
        in_cpu = 0
        if cpu is not None:
            while in_cpu < len(keys) and keys[in_cpu] in cpu:
                cpu.move_to_end(keys[in_cpu])
                in_cpu += 1
        found = in_cpu
        while found < len(keys) and (disk is not None or s3 is not None):
            window = keys[found : found + _WINDOW]
            present = [disk is not None and k in disk for k in window]
            first_missing = next((i for i, p in enumerate(present) if not p), len(window))
            if s3 is not None and first_missing < len(window):
                start = 0 if disk is None else first_missing
                self.mix.heads += len(window) - start
                present = [
                    p or (i >= start and k in s3)
                    for i, (p, k) in enumerate(zip(present, window, strict=True))
                ]
            lead = next((i for i, p in enumerate(present) if not p), len(window))
            found += lead
            if lead < len(window):
                break
        return found, in_cpu

    def _load(self, keys: Sequence[Hashable], loadable: int, in_cpu: int) -> None:
        """Read the chunks holding the first ``loadable`` tokens, each from the fastest tier
        holding it, and promote it into the faster tiers."""
        chunks = -(-loadable // self.chunk)
        cpu_first = self.names[0] == "cpu"
        served = [0] * len(self.items)
        promote: list[list[Hashable]] = [[] for _ in self.items]
        level = 0
        for k in range(chunks):
            key = keys[k]
            level = 0
            if k >= in_cpu or not cpu_first:
                level = 1 if cpu_first else 0
                while key not in self.items[level]:
                    level += 1
            served[level] += 1
            self.items[level].move_to_end(key)
            for i in range(level):
                promote[i].append(key)
        for i, keys_up in enumerate(promote):
            _put(self.items[i], self.caps[i], keys_up)
        hits = self.mix.hit_tokens
        for i, n in enumerate(served):
            hits[self.names[i]] += n * self.chunk
        if chunks:  # the last chunk read may be read in part (vLLM computes the last block)
            hits[self.names[level]] -= chunks * self.chunk - loadable
        if "s3" in self.names:
            self.mix.gets += served[self.names.index("s3")]

    def request(self, req: SimRequest, counted: bool = True) -> None:
        """Serve one request; ``counted=False`` only warms the tiers up."""
        if counted:
            self._serve(req)
            return
        kept, self.mix = self.mix, RequestMix(0.0, 0.0, 0.0, dict.fromkeys(self.names, 0.0))
        self._serve(req)
        self.mix = kept

    def _serve(self, req: SimRequest) -> None:
        sights = self.admission.see(req.keys)
        found, in_cpu = self._lookup(req.keys)
        s3 = self._tier("s3")
        held_locally = 0
        while held_locally < found and any(
            req.keys[held_locally] in items for items in self.items if items is not s3
        ):
            held_locally += 1
        loadable = min(found * self.chunk, req.prompt_tokens - 1) // self.block * self.block
        self._load(req.keys, loadable, in_cpu)
        computed = req.keys[found:]
        for items, cap in zip(self.items, self.caps, strict=True):
            if items is not s3:
                _put(items, cap, computed)
        if s3 is not None:
            late = [
                key
                for key, n in zip(req.keys[:held_locally], sights, strict=False)
                if self.admission.admits_now(n) and key not in s3
            ]
            admitted = list(
                itertools.takewhile(
                    lambda kn: self.admission.admits(kn[1]),
                    zip(computed, sights[found:], strict=True),
                )
            )
            written = late + [key for key, _ in admitted]
            _put(s3, self.caps[self.names.index("s3")], written)
            self.mix.puts += len(written)
        self.mix.requests += 1
        self.mix.prompt_tokens += req.prompt_tokens
        self.mix.prompt_chunks += len(req.keys)


def synthetic_stream(w: Workload, chunk_size: int, seed: int = 0) -> Iterator[SimRequest]:
    """Endless requests of the workload (see `workload.py`); a chunk's key is its conversation
    and position, since conversations never share a prefix."""
    rng = random.Random(seed)
    slots: list[int] = []
    length: dict[int, int] = {}
    limit = w.conversations or math.inf
    next_id = 0
    while True:
        if slots and rng.random() < w.continue_share:
            conv = rng.choice(slots)
            length[conv] += w.turn_tokens
        else:
            conv, next_id = next_id, next_id + 1
            length[conv] = w.prefix_tokens
            if len(slots) < limit:
                slots.append(conv)
            else:
                j = rng.randrange(len(slots))
                del length[slots[j]]
                slots[j] = conv
        n = length[conv]
        base = conv << 24  # chunk i of a conversation: one int, cheaper to hash than a tuple
        yield SimRequest(range(base, base + n // chunk_size), n)


def requests_from_prompts(prompts: Iterable[Sequence[int]], chunk_size: int) -> list[SimRequest]:
    """Real prompts (token ids), keyed by their chunk hashes as the connector keys them."""
    return [SimRequest(chunk_hashes(p, chunk_size), len(p)) for p in prompts]


def run(
    requests: Iterable[SimRequest],
    caps: Mapping[str, float],
    chunk_size: int,
    block_size: int,
    warmup: int = 0,
    admit_after: int = 1,
) -> RequestMix:
    """Totals over ``requests`` after the first ``warmup`` of them (not counted)."""
    sim = TierSimulation(caps, chunk_size, block_size, admit_after)
    for i, req in enumerate(requests):
        sim.request(req, counted=i >= warmup)
    return sim.mix


@dataclass(frozen=True)
class SimResult:
    """Per-request averages, and how they were obtained."""

    mix: RequestMix
    counted: int  # requests counted
    warmup: int  # requests run before counting (steady state)
    runs: int  # independent runs (a short run from an empty cache is repeated)
    warmup_cut: bool  # the warm-up was shorter than the tiers need to fill
    #: Hit rate of the 10th and 90th percentile run (repeated short runs only): how much one
    #: run of that many requests (e.g. a benchmark's) may differ from the average.
    run_spread: tuple[float, float] | None = None


def simulate(
    w: Workload,
    caps: Mapping[str, float],
    chunk_size: int,
    block_size: int,
    requests: int = 10_000,
    seed: int = 0,
    admit_after: int = 1,
) -> SimResult:
    """The workload through the tiers: the steady state after a warm-up, or (``w.requests``)
    runs of that many requests from empty tiers, repeated up to ``requests`` in all."""
    if w.requests is not None:
        runs = max(1, min(200, requests // w.requests))
        total, rates = RequestMix(0.0, 0.0, 0.0), []
        for r in range(runs):
            stream = itertools.islice(synthetic_stream(w, chunk_size, seed + r), w.requests)
            one = run(stream, caps, chunk_size, block_size, admit_after=admit_after)
            rates.append(one.hit_rate())
            total = total.added(one)
        deciles = statistics.quantiles(rates, n=10) if runs > 1 else [rates[0]] * 9
        return SimResult(
            total.scaled(1 / total.requests),
            w.requests * runs,
            0,
            runs,
            False,
            (deciles[0], deciles[-1]),
        )
    warmup, cut = _warmup(w, caps, chunk_size, requests)
    stream = itertools.islice(synthetic_stream(w, chunk_size, seed), warmup + requests)
    mix = run(stream, caps, chunk_size, block_size, warmup, admit_after)
    return SimResult(mix.scaled(1 / mix.requests), requests, warmup, 1, cut)


def _warmup(w: Workload, caps: Mapping[str, float], chunk: int, requests: int) -> tuple[int, bool]:
    """Requests until conversations and tiers reach their steady state: every slot replaced
    twice, the largest finite tier filled 1.5 times over; at most 6 x ``requests``."""
    c = w.continue_share
    new_chunks = c * w.turn_tokens / chunk + (1 - c) * w.prefix_tokens / chunk
    largest = max((v for v in caps.values() if math.isfinite(v)), default=0.0)
    need = 2 * (w.conversations or 1) / (1 - c) + 1.5 * largest / max(new_chunks, 1e-9)
    return min(int(need), 6 * requests), need > 6 * requests
