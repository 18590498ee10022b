"""kvtier's chunks as vLLM KV events, for cache-aware routers.

When the operator turns vLLM's KV events on (``--kv-events-config``, ``enable_kv_cache_events``),
vLLM publishes ``BlockStored`` / ``BlockRemoved`` for the blocks of its own KV cache (medium
"GPU"), and collects a connector's events through ``take_events`` into the same stream. kvtier
publishes:

- ``BlockStored`` when a chunk is written to a tier (the write succeeded: for S3 the PUT
  answered), with vLLM's own block hashes of the blocks the chunk covers, its parent block's
  hash, its token ids, the LoRA name and vLLM's per-block extra keys (so a router that indexes
  vLLM's blocks needs no hashing of its own), ``medium`` = "CPU", "DISK" or "S3".
- ``BlockRemoved`` when a tier loses it: evicted (CPU, disk: their caps), dropped as damaged,
  or, for S3, found missing by a lookup that announced it before (a purge, the lifecycle rule).

Where the facts are: the worker's store knows what a tier wrote or lost (by chunk key); the
scheduler knows which request (so which vLLM block hashes) a chunk belongs to. Workers send
(kind, tier, chunk digest) through vLLM's connector output (`ChunkEvents`); the scheduler side
(`EventPublisher`) remembers the blocks of each chunk it planned to save and turns those
reports into vLLM events. With tensor parallelism a chunk is on the host once every rank has
stored its part: ``BlockStored`` comes with the last rank's report, ``BlockRemoved`` with the
first rank's loss.

Only chunks of the server's own namespace are published (a request's own namespace,
``request_namespaces``, is test traffic such as kv_verify's). Everything is bounded: the
chunks remembered (LRU), the reports waiting for the other ranks and the events waiting for
vLLM; what does not fit is dropped and counted (``kvtier:kv_events_dropped_total``), never
queued without bound. Off unless vLLM's KV events are on: nothing is recorded then.
"""

from __future__ import annotations

import threading
import time
from array import array
from collections import OrderedDict
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVConnectorKVEvents

from kvtier.admission import writes_to
from kvtier.keys import ChunkKey
from kvtier.vllm.step_plan import SaveSpec

#: kvtier tier name -> the ``medium`` of its events.
MEDIUMS = {"cpu": "CPU", "disk": "DISK", "s3": "S3"}
#: Chunks whose blocks the scheduler remembers (for events of chunks planned to be saved).
TRACKED_CHUNKS = 65_536
#: Events waiting for vLLM to take them, and worker reports waiting for the other ranks.
MAX_PENDING = 16_384

#: (kind: "stored" | "failed" | "removed", tier name, chunk digest)
Report = tuple[str, str, str]
#: Seconds the engine keeps stepping, at most, for the reports of a step's background writes.
REPORT_WAIT_SECS = 30.0


def events_enabled(vllm_config: Any) -> bool:
    """Whether vLLM publishes KV events (the operator turned them on)."""
    config = getattr(vllm_config, "kv_events_config", None)
    return bool(config is not None and getattr(config, "enable_kv_cache_events", False))


class ChunkEvents(KVConnectorKVEvents):  # type: ignore[misc]
    """A worker's reports of one step, as vLLM carries them to the scheduler (picklable);
    vLLM merges the workers' into one with `add_events` / `increment_workers`."""

    def __init__(self, reports: list[Report], workers: int = 1) -> None:
        self.reports = list(reports)
        self.workers = workers

    def add_events(self, events: list[Any]) -> None:
        self.reports.extend(events)

    def aggregate(self) -> ChunkEvents:
        return self

    def increment_workers(self, count: int = 1) -> None:
        self.workers += count

    def get_all_events(self) -> list[Any]:
        return list(self.reports)

    def get_number_of_workers(self) -> int:
        return self.workers

    def clear_events(self) -> None:
        self.reports = []


class WorkerReports:
    """What the worker's store reports (from its writer and evicting threads), until the next
    step takes it; at most `MAX_PENDING`, the rest dropped and counted."""

    def __init__(self, namespace: str, limit: int = MAX_PENDING) -> None:
        self.namespace = namespace
        self.limit = limit
        self.dropped = 0
        self._reports: list[Report] = []
        self._lock = threading.Lock()

    def __call__(self, kind: str, tier: str, key: str) -> None:
        """`kvtier.store.TieredStore.report_chunks`'s callback."""
        try:
            parsed = ChunkKey.parse(key)
        except ValueError:
            return  # not a chunk key (doctor's probes)
        if parsed.namespace != self.namespace or tier not in MEDIUMS:
            return
        with self._lock:
            if len(self._reports) >= self.limit:
                self.dropped += 1
                return
            self._reports.append((kind, tier, parsed.digest))

    def take(self) -> ChunkEvents | None:
        with self._lock:
            reports, self._reports = self._reports, []
        return ChunkEvents(reports) if reports else None

    def take_dropped(self) -> int:
        with self._lock:
            dropped, self.dropped = self.dropped, 0
        return dropped


@dataclass
class _Chunk:
    """What a chunk's events say, from the request that saved it."""

    block_hashes: list[Any]
    parent: Any
    token_ids: array[int]
    lora_id: int | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None
    #: Mediums announced as holding it (a removal is published only for those).
    mediums: set[str]


class EventPublisher:
    """The scheduler side: remembers chunks planned to be saved, turns the workers' reports
    into vLLM events, and hands them to vLLM (`take`). vLLM's scheduler thread only."""

    def __init__(
        self,
        block_size: int,
        chunk_size: int,
        ranks: int,
        background_tiers: Collection[str] = (),
    ) -> None:
        self.block_size = block_size
        self.blocks_per_chunk = chunk_size // block_size
        self.chunk_size = chunk_size
        self.ranks = ranks
        #: Reports still to come of the background writes (disk, S3) of the saves planned,
        #: and when the last was planned (see `waiting_for_reports`).
        self.background_tiers = frozenset(background_tiers)  # of "disk", "s3"
        self._expected = 0
        self._last_planned = 0.0
        self.published = 0
        self.dropped = 0
        self._chunks: OrderedDict[str, _Chunk] = OrderedDict()
        self._waiting: OrderedDict[tuple[str, str], int] = OrderedDict()  # stored on some ranks
        self._events: list[BlockStored | BlockRemoved] = []

    # ------------------------------------------------------------------ what a chunk covers
    def expect_saves(self, saves: Iterable[SaveSpec]) -> None:
        """These saves were planned: their background writes (of the tiers each names, see
        `SaveSpec.tiers`) will report."""
        writes = sum(
            writes_to(s.tiers, remote=tier == "s3") for s in saves for tier in self.background_tiers
        )
        self._expected += writes * self.ranks
        self._last_planned = time.monotonic()

    def waiting_for_reports(self) -> bool:
        """Whether background writes of planned saves have not reported yet. vLLM publishes
        events only in its steps, and steps only while there is work: while this holds the
        connector asks it to keep stepping (empty steps), for at most REPORT_WAIT_SECS after
        the last save (a report that never comes, e.g. of a worker that died, ends there)."""
        if self._expected > 0 and time.monotonic() - self._last_planned > REPORT_WAIT_SECS:
            self._expected = 0
        return self._expected > 0

    def remember(self, digest: str, request: Any, index: int, num_tokens: int) -> None:
        """Chunk ``index`` of ``request`` (vLLM's Request) is planned to be saved under
        ``digest``: keep the blocks it covers (vLLM's hashes, computed for the prompt's full
        blocks when prefix caching is on; without them there is nothing to publish)."""
        from vllm.v1.core.kv_cache_utils import (
            generate_block_hash_extra_keys,
            maybe_convert_block_hash,
            to_event_extra_keys,
        )

        if digest in self._chunks:
            self._chunks.move_to_end(digest)
            return
        first = index * self.blocks_per_chunk
        count = num_tokens // self.block_size
        hashes = list(getattr(request, "block_hashes", ()) or ())[first : first + count]
        if len(hashes) < count or count == 0:
            return
        start = index * self.chunk_size
        extra: list[tuple[Any, ...] | None] = []
        mm_index = 0
        for b in range(count):
            lo = start + b * self.block_size
            keys, mm_index = generate_block_hash_extra_keys(
                request, lo, lo + self.block_size, mm_index
            )
            extra.append(keys)
        lora = getattr(request, "lora_request", None)
        self._chunks[digest] = _Chunk(
            block_hashes=[maybe_convert_block_hash(h) for h in hashes],
            parent=maybe_convert_block_hash(request.block_hashes[first - 1]) if first else None,
            token_ids=array("q", request.all_token_ids[start : start + count * self.block_size]),
            lora_id=lora.adapter_id if lora else None,
            lora_name=lora.name if lora else None,
            extra_keys=to_event_extra_keys(extra),
            mediums=set(),
        )
        while len(self._chunks) > TRACKED_CHUNKS:
            self._chunks.popitem(last=False)

    # ------------------------------------------------------------------ reports -> events
    def from_workers(self, reports: Sequence[Report]) -> None:
        """One step's reports of every worker (one per rank and fact)."""
        for kind, tier, digest in reports:
            if tier != "cpu" and kind in ("stored", "failed"):
                self._expected = max(0, self._expected - 1)
            if kind == "failed":
                continue
            if kind == "removed":
                self._removed(digest, MEDIUMS[tier])
                continue
            seen = self._waiting.pop((tier, digest), 0) + 1
            if seen < self.ranks:  # the other ranks' parts are not written yet
                self._waiting[(tier, digest)] = seen
                while len(self._waiting) > MAX_PENDING:
                    self._waiting.popitem(last=False)
                    self.dropped += 1
                continue
            self._stored(digest, MEDIUMS[tier])

    def missing_remotely(self, digest: str) -> None:
        """A lookup that the remote tier answered found this chunk missing there."""
        self._removed(digest, MEDIUMS["s3"])

    def _stored(self, digest: str, medium: str) -> None:
        chunk = self._chunks.get(digest)
        if chunk is None:
            self.dropped += 1  # forgotten (or never planned here: another process's)
            return
        chunk.mediums.add(medium)
        self._emit(
            BlockStored(
                block_hashes=chunk.block_hashes,
                parent_block_hash=chunk.parent,
                token_ids=chunk.token_ids.tolist(),
                block_size=self.block_size,
                lora_id=chunk.lora_id,
                medium=medium,
                lora_name=chunk.lora_name,
                extra_keys=chunk.extra_keys,
                group_idx=0,
                ownership="kvtier",
            )
        )

    def _removed(self, digest: str, medium: str) -> None:
        chunk = self._chunks.get(digest)
        if chunk is None or medium not in chunk.mediums:
            return  # never announced there: nothing for a router to forget
        chunk.mediums.discard(medium)
        self._emit(BlockRemoved(block_hashes=chunk.block_hashes, medium=medium, group_idx=0))

    def _emit(self, event: BlockStored | BlockRemoved) -> None:
        if len(self._events) >= MAX_PENDING:
            self.dropped += 1
            return
        self._events.append(event)
        self.published += 1

    def take(self) -> list[BlockStored | BlockRemoved]:
        events, self._events = self._events, []
        return events

    def take_counts(self) -> tuple[int, int]:
        """(events published, events or reports dropped) since the last call."""
        counts = (self.published, self.dropped)
        self.published = self.dropped = 0
        return counts
