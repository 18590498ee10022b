"""Scheduler side: which prompt chunks to load or save, per request and per step.

Pure bookkeeping (no vLLM or torch import), so it is unit-tested without a server. The
connector translates vLLM's scheduler objects into the calls below and ships the resulting
`StepPlan` to the workers inside the connector metadata.

Rules:
- Chunks are `chunk_size` prompt tokens (a multiple of vLLM's block size); chunk i's key
  covers tokens 0..(i+1)*chunk_size (chained hashes), so a hit on chunk i implies its prefix,
  and the request's identity beyond its tokens over that range (``extras``: salt, LoRA adapter,
  multimodal items, prompt embeddings; `kvtier.vllm.identity`).
- A load that fails (vLLM reports the request's blocks invalid; with tensor parallelism a chunk
  one rank lacks, say: the lookup asks rank 0's keys) is recomputed by vLLM from the failed
  chunk on, and those chunks are saved again as they are recomputed (`loads_failed`): each rank
  writes what it computed, so the rank that lacked the chunk has it from then on and the next
  request hits on every rank, instead of paying a failed load forever.
- Only requests the connector looked up are planned: one `num_new_matched_tokens` never saw (or
  one served without kvtier) is never saved, so nothing is stored under a key that might not
  cover its identity.
- At most ``align_down(prompt_len - 1, block_size)`` tokens are offered: vLLM must compute at
  least one prompt token itself to produce logits.
- Chunks are saved in runs of ``object_chunks`` (one S3 object each, kvtier.format): the runs
  of a request start at the first chunk that no tier holds and are cut every ``object_chunks``
  chunks; a run is saved in the step in which its last chunk's last token is computed (its
  earlier chunks' blocks are still the request's), the last run when the prompt is done. So
  prompts prefilled over several steps (chunked prefill) are saved step by step. The trailing
  partial chunk is saved (its fully written blocks only) when ``save_unfull_chunk`` is on.
- With an admission rule on the remote tier (``remote_admit_after`` > 1, kvtier.admission), a
  chunk computed before its prefix was seen often enough is saved to the local tiers only (its
  run cut where the admitted chunks end, so the remote tier's objects stay prefix-ordered), and
  a chunk the local tiers (or vLLM's prefix cache) hold is saved to the remote tier from the
  request's blocks on the sight that admits it, once those blocks are loaded ("late
  admission"; a failed load cancels it, and the recompute saves the chunk to every tier).
- A chunk that another request planned to save to the remote tier moments ago
  (``_REMOTE_SAVE_SECS``) is not saved again when it leads a request's saves: that request's
  runs start after it. Two requests in flight with one uncached prefix (a prompt and its
  continuation) would otherwise save runs with the same first chunk and different lengths:
  one S3 key, and the shorter object, landing last, dropped the other's tail (kvtier bench
  soak found 4 of 283 chunks lost so). If the other save fails, the chunk is a miss later,
  recomputed and saved by a later request.
- The scheduler cannot see the worker's CPU tier (another process in production). It keeps
  an LRU index of the chunks it told the worker to save or load (each lands in the worker's
  CPU tier) and asks the store (disk, S3: shared media) about the rest. If the index is wrong,
  the worker's load fails and vLLM recomputes: a miss, never wrong KV.
- A request whose prompt stops matching an earlier one with the same first chunk right where
  its lookup stopped is logged (rate-limited) and counted (``prefix_divergences``):
  `divergence.PrefixHistory` says why that is a changed prompt, not an eviction.
- The remote tier is never asked inside vLLM's scheduler loop: its lookup runs in a thread
  (`ChunkLookups.remote_prefix` returns a future of a `RemotePrefix`: the chunks found and
  the objects that hold them, which the load plan passes on so each chunk is read from its
  object), and until it answers the request is reported as "not yet" (None) so vLLM schedules
  the others. After ``lookup_timeout`` the request goes ahead with what the local tiers hold:
  a slow or dead remote tier delays no request by more.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Protocol

from kvtier.admission import Admission, SaveTiers
from kvtier.keys import chunk_hashes, chunk_id
from kvtier.metrics import SAMPLES
from kvtier.prefix import RemotePrefix
from kvtier.ratelimit import RateLimitedLog
from kvtier.vllm.divergence import PrefixHistory
from kvtier.vllm.step_plan import LoadSpec, SaveSpec, StepPlan

log = logging.getLogger(__name__)
_warnings = RateLimitedLog(log)

#: Seconds one call may wait for a pending remote lookup before answering "not yet" (short: the
#: scheduler calls again at its next step, and other requests are scheduled meanwhile).
_LOOKUP_POLL_SECS = 0.001
#: How long a chunk planned for the remote tier counts as being saved by its request (its PUT
#: lands within this, or has failed), and how many such chunks are remembered.
_REMOTE_SAVE_SECS = 30.0
_REMOTE_SAVES_KEPT = 65_536


@dataclass(frozen=True)
class SchedulerSettings:
    """What the scheduler side plans by, fixed at start (the connector builds it once)."""

    chunk_size: int
    block_size: int
    #: Save the trailing partial chunk too (its fully written blocks).
    save_unfull_chunk: bool = False
    #: Chunks per S3 object: saves are cut into runs of this many (kvtier.format).
    object_chunks: int = 1
    #: Loads the remote tier serves run outside the batch (vLLM's asynchronous load).
    background_loads: bool = False
    #: Seconds a request waits for the remote tier's lookup before going ahead without it.
    lookup_timeout: float = 0.1
    #: The name the remote tier's hits are reported under (`SchedulerSide.hit_sources`).
    remote_tier: str = "s3"
    #: Whether a local tier takes the chunks the remote tier does not admit (else they are
    #: not saved at all).
    local_tiers: bool = True
    #: The remote tier's admission rule (None: every chunk is admitted). It keeps the sight
    #: counts (the scheduler's one piece of state here); the rule itself is fixed.
    admission: Admission | None = None

    def __post_init__(self) -> None:
        if self.chunk_size % self.block_size:
            raise ValueError(
                f"kvtier chunk_size ({self.chunk_size}) must be a multiple of vLLM's block size "
                f"({self.block_size}): set chunk_size in the kvtier config or --block-size"
            )

    @property
    def blocks_per_chunk(self) -> int:
        return self.chunk_size // self.block_size


class ChunkLookups(Protocol):
    """What the scheduler side asks the store (disk, S3) about chunks: all it sees of the
    tiers beyond its own index of the worker's CPU tier (`kvtier.vllm.store_setup.StoreLookups`)."""

    def local_prefix(self, hashes: Sequence[str]) -> int:
        """Leading chunks of ``hashes`` that a local tier holds, asked now (0: none)."""
        ...

    def remote_prefix(self, hashes: Sequence[str], start: int) -> Future[RemotePrefix] | None:
        """The remote tier's answer for ``hashes`` (the local tiers hold the first ``start``),
        looked up in a thread; None without a remote tier."""
        ...

    def count_lookup(self, asked: int, found: int) -> None:
        """Count one request's lookup: ``asked`` chunks, the leading ``found`` of them held."""
        ...

    def on_disk(self, hashes: Sequence[str]) -> list[bool]:
        """Whether the disk tier holds each of ``hashes`` (all False without one)."""
        ...


@dataclass
class _PendingLookup:
    """A remote lookup in flight for chunks from ``local`` on."""

    future: Future[RemotePrefix]
    local: int
    in_cpu: int
    started: float


@dataclass
class _Request:
    prompt_len: int
    hashes: list[str]  # full chunks, then the partial one if save_unfull_chunk
    block_ids: list[int] = field(default_factory=list)
    #: Leading chunks found by the last lookup (None: not looked up yet).
    found_chunks: int | None = None
    #: Of those, leading chunks expected in the worker's CPU tier, and in any local tier.
    found_in_cpu: int = 0
    found_local: int = 0
    #: Locally computed tokens when the lookup was made (vLLM's own prefix cache).
    local_tokens: int = 0
    #: The remote lookup while it runs, then what it found (the objects holding the chunks).
    pending: _PendingLookup | None = None
    remote: RemotePrefix = field(default_factory=RemotePrefix)
    #: (start token, token count) to load in the next step, set after allocation.
    pending_load: tuple[int, int] | None = None
    #: Next chunk index to consider for saving; chunks below `known_stored` are never saved,
    #: and the runs of the saved ones start at `known_stored`.
    next_save: int = 0
    known_stored: int = 0
    #: False for a request that asked for a namespace it may not use: no load, no save.
    enabled: bool = True
    #: With an admission rule: each chunk's sights counted at the lookup (this one included),
    #: and the chunks a local tier holds that this sight admits to the remote tier, in order,
    #: until they are saved there.
    sights: list[int] = field(default_factory=list)
    late: list[int] = field(default_factory=list)


@dataclass
class SchedulerCounters:
    """Counters the scheduler side reports through KVConnectorStats (deltas per interval)."""

    lookup_requests: int = 0
    lookup_tokens: int = 0
    hit_tokens: int = 0
    hit_tokens_by_tier: dict[str, int] = field(default_factory=dict)
    planned_save_chunks: int = 0
    #: Admission to the remote tier: chunks saved without it (not admitted yet), and chunks
    #: the local tiers held that were saved to it when admitted (late admission).
    remote_unadmitted_chunks: int = 0
    remote_late_admitted_chunks: int = 0
    #: Lookups that asked the remote tier, their time until answered (or given up), and those
    #: given up after lookup_timeout.
    remote_lookups: int = 0
    remote_lookup_seconds: list[float] = field(default_factory=list)
    lookup_timeouts: int = 0
    #: Requests whose prompt diverged from an earlier one's where their lookup stopped.
    prefix_divergences: int = 0
    #: Requests served without kvtier, by reason (a namespace not allowed, an identity the
    #: keys cannot cover).
    uncached: dict[str, int] = field(default_factory=dict)

    def take(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "lookup_requests": self.lookup_requests,
            "lookup_tokens": self.lookup_tokens,
            "hit_tokens": self.hit_tokens,
            "planned_save_chunks": self.planned_save_chunks,
            "remote_unadmitted_chunks": self.remote_unadmitted_chunks,
            "remote_late_admitted_chunks": self.remote_late_admitted_chunks,
            "remote_lookups": self.remote_lookups,
            "remote_lookup_seconds" + SAMPLES: self.remote_lookup_seconds,
            "lookup_timeouts": self.lookup_timeouts,
            "prefix_divergences": self.prefix_divergences,
        }
        for tier, n in self.hit_tokens_by_tier.items():
            out[f"hit_tokens.{tier}"] = n
        for reason, n in self.uncached.items():
            out[f"uncached_requests.{reason}"] = n
        self.uncached = {}
        self.lookup_requests = self.lookup_tokens = self.hit_tokens = 0
        self.planned_save_chunks = self.remote_lookups = self.lookup_timeouts = 0
        self.prefix_divergences = 0
        self.remote_unadmitted_chunks = self.remote_late_admitted_chunks = 0
        self.remote_lookup_seconds = []
        self.hit_tokens_by_tier = {}
        return out


class CpuTierIndex:
    """LRU mirror of the chunks the worker's CPU tier should hold (see module docstring)."""

    def __init__(self, capacity_chunks: int) -> None:
        self.capacity = max(0, capacity_chunks)
        self._lru: OrderedDict[str, None] = OrderedDict()

    def add(self, chunk_hash: str) -> None:
        if self.capacity == 0:
            return
        self._lru[chunk_hash] = None
        self._lru.move_to_end(chunk_hash)
        while len(self._lru) > self.capacity:
            self._lru.popitem(last=False)

    def leading(self, hashes: Sequence[str]) -> int:
        n = 0
        for h in hashes:
            if h not in self._lru:
                break
            self._lru.move_to_end(h)
            n += 1
        return n


class SchedulerSide:
    """Per-request load/save planning. Not thread-safe (vLLM's scheduler is one thread)."""

    def __init__(
        self, settings: SchedulerSettings, lookups: ChunkLookups, cpu_index: CpuTierIndex
    ) -> None:
        self.settings = settings
        self.lookups = lookups
        self.cpu_index = cpu_index
        self._reqs: dict[str, _Request] = {}
        self._scheduled: list[str] = []
        self._plan = StepPlan()
        self.counters = SchedulerCounters()
        self._history = PrefixHistory()
        self._divergence_log = RateLimitedLog(log)  # one line per 10 s, with the count held back
        #: Chunk ids planned for the remote tier -> when (monotonic), oldest first.
        self._remote_saves: OrderedDict[str, float] = OrderedDict()

    # ------------------------------------------------------------------ helpers
    def _chunk_tokens(self, st: _Request, k: int) -> int:
        """Tokens of chunk k that a stored copy covers."""
        cs = self.settings.chunk_size
        return min(cs, st.prompt_len - k * cs)

    def _state(
        self,
        req_id: str,
        prompt: Sequence[int],
        namespace: str | None = None,
        extras: Sequence[bytes] | None = None,
    ) -> _Request:
        st = self._reqs.get(req_id)
        if st is None:
            cfg = self.settings
            hashes = chunk_hashes(prompt, cfg.chunk_size, cfg.save_unfull_chunk, extras)
            # A request's own namespace goes into the chunk id; the store files it there.
            hashes = [chunk_id(h, namespace) for h in hashes]
            st = _Request(prompt_len=len(prompt), hashes=hashes)
            self._reqs[req_id] = st
        return st

    def _lookup(self, req_id: str, st: _Request) -> tuple[int, int, int] | None:
        """(leading chunks found, of them in the CPU tier, in any local tier), or None while
        the remote tier's answer is pending (for at most ``lookup_timeout`` seconds)."""
        hashes = st.hashes
        if st.pending is None:
            in_cpu = self.cpu_index.leading(hashes)
            local = in_cpu
            if local < len(hashes):
                local += self.lookups.local_prefix(hashes[local:])
            future = None if local == len(hashes) else self.lookups.remote_prefix(hashes, local)
            if future is None:
                return local, in_cpu, local
            st.pending = _PendingLookup(future, local, in_cpu, time.monotonic())
        p = st.pending
        timeout = self.settings.lookup_timeout
        left = timeout - (time.monotonic() - p.started)
        remote = RemotePrefix(found=p.local)
        try:
            remote = p.future.result(timeout=max(0.0, min(left, _LOOKUP_POLL_SECS)))
        except TimeoutError:
            if left > _LOOKUP_POLL_SECS:
                return None  # "not yet": vLLM asks again at its next step
            self.counters.lookup_timeouts += 1
            _warnings.warning(
                "lookup_timeout",
                f"request {req_id}: the remote tier did not answer its lookup within "
                f"lookup_timeout_secs={timeout:g}: served from the local tiers "
                f"({p.local} of {len(hashes)} chunks)",
            )
        except Exception as exc:  # the store answers "none" on failure; anything else is a miss
            _warnings.warning("lookup_error", f"remote lookup of {req_id} failed: {exc!r}")
        st.pending = None
        st.remote = remote
        self.counters.remote_lookups += 1
        self.counters.remote_lookup_seconds.append(time.monotonic() - p.started)
        return max(p.local, remote.found), p.in_cpu, p.local

    # ------------------------------------------------------------------ vLLM hooks
    def num_new_matched_tokens(
        self,
        req_id: str,
        prompt: Sequence[int],
        num_computed_tokens: int,
        namespace: str | None = None,
        extras: Sequence[bytes] | None = None,
    ) -> int | None:
        """Prompt tokens beyond `num_computed_tokens` that can be loaded (block-aligned); None
        while the remote tier's lookup is pending (vLLM then asks again at its next step).

        ``namespace`` (a request's own, see `KvtierConfig.request_namespaces`) files the
        request's chunks under that namespace instead of the configured one. ``extras``: the
        request's encoded extra keys per chunk (`kvtier.keys.chunk_hashes`), read on the first
        call only.
        """
        st = self._state(req_id, prompt, namespace, extras)
        if not st.enabled:
            return 0
        if st.found_chunks is None:
            found = self._lookup(req_id, st)
            if found is None:
                return None
            st.found_chunks, st.found_in_cpu, st.found_local = found
            self.counters.lookup_requests += 1
            self.counters.lookup_tokens += st.prompt_len
            self.lookups.count_lookup(len(st.hashes), st.found_chunks)
            admission = self.settings.admission
            if admission is not None:
                st.sights = admission.see(st.hashes)
                st.late = [
                    k
                    for k in range(st.found_local)
                    if admission.admits_now(st.sights[k]) and not st.remote.holds(k)
                ]
            self._check_divergence(req_id, st)
        st.local_tokens = num_computed_tokens
        cs, bs = self.settings.chunk_size, self.settings.block_size
        found_tokens = min(st.found_chunks * cs, st.prompt_len)
        # Never the whole prompt: vLLM computes at least the last token to sample from it.
        loadable = min(found_tokens, st.prompt_len - 1) // bs * bs
        return max(0, loadable - num_computed_tokens)

    def _check_divergence(self, req_id: str, st: _Request) -> None:
        cs = self.settings.chunk_size
        full = st.prompt_len // cs  # full chunks: a partial one's hash has its length
        found = min(st.found_chunks or 0, full)
        divergence = self._history.observe(st.hashes[:full], found)
        if divergence is None:
            return
        self.counters.prefix_divergences += 1
        self._divergence_log.warning("prefix_divergence", divergence.message(req_id, cs))

    def missing_remotely(self, req_id: str) -> str | None:
        """The chunk id at which the remote tier, asked by the request's lookup, said the
        prompt's stored prefix ends (None: not asked, no answer, or nothing missing)."""
        st = self._reqs.get(req_id)
        if st is None or st.found_chunks is None or st.remote.requests == 0:
            return None
        return st.hashes[st.remote.found] if st.remote.found < len(st.hashes) else None

    def loads_in_background(self, req_id: str) -> bool:
        """Whether the request's planned loads run outside the batch (vLLM's asynchronous
        load): with ``background_loads``, when the remote tier serves some of them (local
        tiers answer within a step)."""
        st = self._reqs.get(req_id)
        if not self.settings.background_loads or st is None:
            return False
        return (st.found_chunks or 0) > st.found_local

    def knows(self, req_id: str) -> bool:
        """Whether the request was looked up (or bypassed) already."""
        return req_id in self._reqs

    def bypass(self, req_id: str, reason: str) -> None:
        """Serve the request without kvtier: nothing looked up, loaded or saved; counted."""
        st = self._reqs.get(req_id)
        if st is None or st.enabled:  # counted once per request
            self.counters.uncached[reason] = self.counters.uncached.get(reason, 0) + 1
        self._reqs[req_id] = _Request(prompt_len=0, hashes=[], enabled=False)

    def after_alloc(
        self, req_id: str, num_external_tokens: int, block_ids: Sequence[int] | None = None
    ) -> None:
        """Blocks are allocated for the tokens to load. ``block_ids`` (the request's blocks)
        come with a load in the background: it is planned now, in the step that follows,
        where the request itself is not scheduled; else when the request is."""
        st = self._reqs.get(req_id)
        if st is None or num_external_tokens <= 0:
            return
        st.pending_load = (st.local_tokens, num_external_tokens)
        if block_ids is not None:
            st.block_ids = list(block_ids)
            self._plan_load(req_id, st, background=True)
        self.counters.hit_tokens += num_external_tokens
        sources = self._hit_sources(st, st.local_tokens, num_external_tokens)
        for tier, n in sources.items():
            self.counters.hit_tokens_by_tier[tier] = (
                self.counters.hit_tokens_by_tier.get(tier, 0) + n
            )
        log.info(
            "kvtier: request %s: %d prompt tokens, %d in vLLM's prefix cache, %d to load %s",
            req_id,
            st.prompt_len,
            st.local_tokens,
            num_external_tokens,
            sources,
        )

    def hit_sources(self, req_id: str, num_external_tokens: int) -> dict[str, int]:
        """Where the planned tokens are expected to come from ("cpu", "disk", "s3")."""
        st = self._reqs.get(req_id)
        if st is None or num_external_tokens <= 0:
            return {}
        return self._hit_sources(st, st.local_tokens, num_external_tokens)

    def _hit_sources(self, st: _Request, start: int, count: int) -> dict[str, int]:
        out: dict[str, int] = {}
        end = start + count
        cs = self.settings.chunk_size
        first, last = start // cs, (end - 1) // cs
        on_disk: list[bool] = []
        if last >= st.found_in_cpu:
            lo = max(first, st.found_in_cpu)
            on_disk = [False] * (lo - first) + self.lookups.on_disk(st.hashes[lo : last + 1])
        for k in range(first, last + 1):
            lo = max(start, k * cs)
            hi = min(end, (k + 1) * cs)
            if k < st.found_in_cpu:
                tier = "cpu"
            elif on_disk and on_disk[k - first]:
                tier = "disk"
            else:
                tier = self.settings.remote_tier
            out[tier] = out.get(tier, 0) + hi - lo
        return out

    def on_scheduled(
        self,
        req_id: str,
        *,
        block_ids: Sequence[int] | None,
        replace_blocks: bool,
        num_computed_tokens: int,
        num_scheduled_tokens: int,
    ) -> None:
        """Record one scheduled request of this step and plan its loads and saves."""
        st = self._reqs.get(req_id)
        if st is None:
            return  # never looked up: its identity was not keyed (module docstring)
        if replace_blocks:
            st.block_ids = list(block_ids or ())
        elif block_ids:
            st.block_ids.extend(block_ids)
        if st.pending_load is not None:
            self._plan_load(req_id, st)
        self._plan_saves(req_id, st, num_computed_tokens + num_scheduled_tokens)

    def _plan_load(self, req_id: str, st: _Request, background: bool = False) -> None:
        if st.pending_load is None or st.found_chunks is None:
            return
        start, count = st.pending_load
        st.pending_load = None
        end = start + count
        bs, cs = self.settings.block_size, self.settings.chunk_size
        for k in range(start // cs, (end - 1) // cs + 1):
            lo, hi = max(start, k * cs), min(end, (k + 1) * cs)
            stored_blocks = self._chunk_tokens(st, k) // bs
            object_first, position = st.remote.object_of(k)
            spec = LoadSpec(
                req_id=req_id,
                chunk_hash=st.hashes[k],
                stored_blocks=stored_blocks,
                first=(lo - k * cs) // bs,
                block_ids=tuple(st.block_ids[lo // bs : hi // bs]),
                num_tokens=hi - lo,
                object_hash=st.hashes[object_first],
                position=position,
                background=background,
                index=k,
            )
            self._plan.loads.append(spec)
            self.cpu_index.add(spec.chunk_hash)  # the worker's get() promotes it into CPU
        # Everything the lookup found is stored already: never save it again.
        st.known_stored = max(st.known_stored, st.found_chunks)

    def _plan_saves(self, req_id: str, st: _Request, computed: int) -> None:
        if not st.enabled:
            return
        cfg = self.settings
        cs, bs, runs = cfg.chunk_size, cfg.block_size, cfg.object_chunks
        full_chunks = st.prompt_len // cs
        partial = st.prompt_len % cs
        # Only the partial chunk's fully written blocks: the last block's tail is filled later
        # by decoding, and loads never reach it (at least one prompt token is always computed).
        with_partial = cfg.save_unfull_chunk and partial // bs > 0
        last = full_chunks + with_partial
        done = min(full_chunks, min(computed, st.prompt_len) // cs)
        if with_partial and computed >= st.prompt_len:
            done = last
        if st.found_chunks is not None:
            st.known_stored = max(st.known_stored, st.found_chunks)
        if st.late:
            self._plan_late_admissions(req_id, st, done)
        start = max(st.next_save, st.known_stored)
        while start < last and self._remote_save_pending(st.hashes[start]):
            start += 1  # another request saves it (module docstring): runs start after it
            st.known_stored = start
        while start < last:
            # Runs start where the stored chunks end and are cut every `runs` chunks.
            end = min(last, st.known_stored + ((start - st.known_stored) // runs + 1) * runs)
            if done < end:
                break
            tiers: SaveTiers = "all"
            head = start  # the first chunk of the object this chunk goes into
            for k in range(start, end):
                if tiers == "all" and not self._admitted(st, k):
                    tiers, head = "local", k  # the remote tier's object ends before it
                if tiers == "local":
                    self.counters.remote_unadmitted_chunks += 1
                    if not cfg.local_tiers:
                        continue
                if not self._save(
                    req_id, st, k, *self._chunk_blocks(st, k), st.hashes[head], tiers
                ):
                    end = last  # the blocks ran out: nothing after this chunk can be saved
                    break
            start = end
        st.next_save = start

    def _chunk_blocks(self, st: _Request, k: int) -> tuple[int, int]:
        """(blocks, tokens) a saved copy of chunk k holds: all of a full chunk; of the partial
        one (save_unfull_chunk) its fully written blocks only, since the last block's tail is
        filled later by decoding and loads never reach it."""
        cs, bs = self.settings.chunk_size, self.settings.block_size
        if k < st.prompt_len // cs:
            return self.settings.blocks_per_chunk, cs
        partial = st.prompt_len % cs
        return partial // bs, partial

    def _admitted(self, st: _Request, k: int) -> bool:
        """Whether chunk k goes to the remote tier when saved (a chunk whose sights were not
        counted is not: unknown means no)."""
        admission = self.settings.admission
        if admission is None:
            return True
        return k < len(st.sights) and admission.admits(st.sights[k])

    def _plan_late_admissions(self, req_id: str, st: _Request, done: int) -> None:
        """Save to the remote tier the chunks a local tier held that this request's sight
        admitted, from its blocks, once they hold the chunks (loaded, or computed: the last
        token is always computed); in runs of consecutive chunks cut every ``object_chunks``."""
        ready = [k for k in st.late if k < done]
        st.late = [k for k in st.late if k >= done]
        for run in _runs(ready, self.settings.object_chunks):
            for k in run:
                if not self._save(
                    req_id, st, k, *self._chunk_blocks(st, k), st.hashes[run[0]], "remote"
                ):
                    return
                self.counters.remote_late_admitted_chunks += 1

    def _save(
        self,
        req_id: str,
        st: _Request,
        k: int,
        num_blocks: int,
        num_tokens: int,
        run: str,
        tiers: SaveTiers = "all",
    ) -> bool:
        first = k * self.settings.blocks_per_chunk
        blocks = st.block_ids[first : first + num_blocks]
        if len(blocks) < num_blocks:
            log.warning(
                "kvtier: request %s has %d blocks, chunk %d needs %d; not saving it",
                req_id,
                len(st.block_ids),
                k,
                first + num_blocks,
            )
            return False
        self._plan.saves.append(
            SaveSpec(req_id, st.hashes[k], tuple(blocks), num_tokens, run, index=k, tiers=tiers)
        )
        if tiers != "remote":
            self.cpu_index.add(st.hashes[k])
        if tiers != "local":
            self._remote_saves[st.hashes[k]] = time.monotonic()
            self._remote_saves.move_to_end(st.hashes[k])
            if len(self._remote_saves) > _REMOTE_SAVES_KEPT:
                self._remote_saves.popitem(last=False)
        self.counters.planned_save_chunks += 1
        return True

    def _remote_save_pending(self, chunk: str) -> bool:
        """Whether a request planned to save ``chunk`` to the remote tier moments ago."""
        planned = self._remote_saves.get(chunk)
        return planned is not None and time.monotonic() - planned < _REMOTE_SAVE_SECS

    def loads_failed(self, invalid_block_ids: set[int]) -> None:
        """vLLM reported these blocks' loads failed: each request holding one is recomputed
        from its first chunk with a failed block, and from there its chunks are saved again."""
        bpc = self.settings.blocks_per_chunk
        for st in self._reqs.values():
            found = st.found_chunks or 0
            failed = [
                k
                for k in range(found)
                if not invalid_block_ids.isdisjoint(st.block_ids[k * bpc : (k + 1) * bpc])
            ]
            if failed:
                k = failed[0]
                # Chunks from k on are recomputed (and saved as computed): their blocks, which
                # did not load, must not be saved to the remote tier now.
                st.late = [j for j in st.late if j < k]
                st.found_chunks = k
                st.known_stored = min(st.known_stored, k)
                st.next_save = min(st.next_save, k)
                for chunk in st.hashes[k:]:  # the stored copies failed: saved again, now
                    self._remote_saves.pop(chunk, None)

    def take_plan(self) -> StepPlan:
        plan, self._plan = self._plan, StepPlan()
        return plan

    def finished(self, req_id: str) -> None:
        self._reqs.pop(req_id, None)


def _runs(chunks: Sequence[int], span: int) -> list[list[int]]:
    """Increasing chunk indices as runs of consecutive ones, each cut every ``span`` chunks."""
    runs: list[list[int]] = []
    for k in chunks:
        if runs and runs[-1][-1] == k - 1 and len(runs[-1]) < span:
            runs[-1].append(k)
        else:
            runs.append([k])
    return runs
