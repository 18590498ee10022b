"""TieredStore: longest-prefix lookup across tiers, verified reads with promotion, write-through.

Tiers are ordered fastest first (CPU, disk, S3). ``put`` (one chunk) and ``put_run`` (a run of
consecutive chunks of one prompt) store into the CPU tier at once and write the slower tiers in
the background; the remote tier gets a run as one object (kvtier.format), which cuts its
per-request cost for models with little KV per chunk. Background writes are bounded: beyond
``s3_max_inflight_reqs`` writes or ``max_write_backlog_size`` bytes in flight, new ones are
dropped and counted rather than queued without limit. A remote tier sits behind a circuit
breaker (kvtier.tiers.guard), and its lookup is a search of a few requests (kvtier.prefix), not
one per chunk. ``get_many`` reads each chunk from the fastest local tier holding it and the rest
from the remote tier, one GET per object, verifies header and checksum, and copies what the
remote tier gave into the faster tiers. Payloads are passed by reference between tiers (bytes
are immutable), except into the CPU tier, which copies what it keeps (kvtier.tiers.cpu); a read
returns the payload object the tier produced (the CPU slab tier's: a leased view). Every
failure in the data path (I/O error, timeout, corrupt blob, full disk) is a miss: counted per
tier by cause and logged (at most once per cause and tier every few seconds: a dead endpoint
must not write a warning per chunk), never raised into the caller.
"""

from __future__ import annotations

import copy
import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, TypeVar, cast

from kvtier.admission import SaveTiers, writes_to
from kvtier.config import KvtierConfig
from kvtier.format import (
    FormatError,
    pack_header,
    short_hash,
    split_object,
    verify,
)
from kvtier.hostmem import owned_copy
from kvtier.keys import ChunkKey, chunk_digest
from kvtier.prefix import RemotePrefix, leading_present, walk_objects
from kvtier.ratelimit import RateLimitedLog
from kvtier.stats import StatsFile, StoreStats, TierStats
from kvtier.tiers.base import Stored, Tier, TierError
from kvtier.writer import BackgroundWriter

if TYPE_CHECKING:
    from kvtier.tiers.cpu import PinHost

log = logging.getLogger(__name__)
T = TypeVar("T")

#: Chunks asked of a local tier per round in ``lookup_local``.
_LOOKUP_WINDOW = 32


def _hash_bytes(chunk_id: str) -> bytes:
    """The chunk hash of an id (`kvtier.keys.chunk_id`), as the header holds it."""
    return bytes.fromhex(chunk_digest(chunk_id))


def _put_ok(tier: Tier, items: Sequence[tuple[str, Stored]]) -> bool:
    tier.put_chunks(items)
    return True


class _Latch:
    """Calls ``on_done`` once every write added has ended and `arm` was called (the writes
    of one `TieredStore.put_run`, which lent its payloads)."""

    def __init__(self, on_done: Callable[[], None] | None) -> None:
        self._on_done = on_done
        self._pending = 1  # the put_run itself, until arm()
        self._lock = threading.Lock()

    def add(self) -> None:
        with self._lock:
            self._pending += 1

    def done(self) -> None:
        with self._lock:
            self._pending -= 1
            last = self._pending == 0
        if last and self._on_done is not None:
            self._on_done()

    arm = done


@dataclass(frozen=True)
class ChunkRef:
    """A chunk to read, and where the remote tier holds it: in the object of the run that
    starts with chunk ``object_id`` (empty: an object of its own), at ``position``."""

    chunk_id: str
    object_id: str = ""
    position: int = 0


class TieredStore:
    """Chunk store over ordered tiers. Thread-safe."""

    def __init__(
        self,
        tiers: Sequence[Tier],
        fingerprint: str,
        namespace: str = "default",
        *,
        verify_checksums: bool = True,
        io_threads: int = 16,
        max_inflight_writes: int = 256,
        max_backlog_bytes: int = 1 << 30,
        stats_dir: str | None = None,
        stats_interval: float = 10.0,
        object_chunks: int = 1,
    ) -> None:
        if not tiers:
            raise ValueError("TieredStore needs at least one tier")
        self.tiers = list(tiers)
        #: Chunks per object that the remote tier's writers cut runs into (1: an object per
        #: chunk, found by a search over chunk keys; more: by a walk over objects).
        self.object_chunks = object_chunks
        self.fingerprint = fingerprint
        self.namespace = namespace
        self.verify_checksums = verify_checksums
        self._layout = bytes.fromhex(fingerprint)
        self._lock = threading.Lock()
        self._stats = StoreStats(tiers={t.name: TierStats() for t in self.tiers})
        self._io = ThreadPoolExecutor(max_workers=io_threads, thread_name_prefix="kvtier-io")
        self._writer = BackgroundWriter(io_threads, max_inflight_writes, max_backlog_bytes)
        self._warnings = RateLimitedLog(log)
        self._closed = False
        self._stats_file = StatsFile(stats_dir, stats_interval, self.stats) if stats_dir else None
        #: Called with ("stored" | "failed" | "removed", tier name, key) for each chunk a tier
        #: writes, fails to write, evicts or drops (KV events: `report_chunks`); None: off.
        self._on_chunk: Callable[[str, str, str], None] | None = None

    def report_chunks(self, callback: Callable[[str, str, str], None]) -> None:
        """Call ``callback(kind, tier, key)`` for each chunk a tier stores ("stored", once the
        write has succeeded), does not store ("failed": the write failed or was dropped) or
        loses ("removed": evicted, or dropped as damaged). It runs in the writing or evicting
        thread: it must be quick and never raise."""
        self._on_chunk = callback
        for tier in self.tiers:
            tier.on_evict = partial(callback, "removed", tier.name)

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_config(
        cls,
        cfg: KvtierConfig,
        fingerprint: str,
        object_chunks: int = 1,
        *,
        disk_maintain: bool = True,
        disk_peers: frozenset[str] = frozenset(),
        remote_maintain: bool = False,
        cpu_slot_bytes: int | None = None,
        cpu_pin: PinHost | None = None,
    ) -> TieredStore:
        """A store over the tiers ``cfg`` enables (:func:`kvtier.tiers.tiers_from_config`); the
        remote tier's runs are cut every ``object_chunks`` chunks (the connector derives it
        from the layout: :func:`kvtier.format.chunks_per_object`). ``disk_maintain``,
        ``disk_peers``, ``remote_maintain``, ``cpu_slot_bytes``, ``cpu_pin``: see
        `kvtier.tiers.tiers_from_config`."""
        from kvtier.tiers import tiers_from_config

        tiers = tiers_from_config(
            cfg,
            disk_maintain=disk_maintain,
            disk_peers=disk_peers,
            remote_maintain=remote_maintain,
            cpu_slot_bytes=cpu_slot_bytes,
            cpu_pin=cpu_pin,
        )
        return cls(
            tiers,
            fingerprint,
            cfg.namespace,
            verify_checksums=cfg.verify_checksums,
            io_threads=min(cfg.extra_config.s3_max_io_concurrency, 64),
            max_inflight_writes=cfg.extra_config.s3_max_inflight_reqs,
            max_backlog_bytes=cfg.write_backlog_bytes,
            stats_dir=cfg.stats_path,
            stats_interval=cfg.stats_interval_secs,
            object_chunks=object_chunks,
        )

    def key(self, chunk_hash: str) -> str:
        """The tier key of a chunk id (`kvtier.keys.ChunkKey.of`): under the store's namespace,
        or the one a request chose."""
        return str(ChunkKey.of(chunk_hash, self.namespace, self.fingerprint))

    # ------------------------------------------------------------------ guarded tier calls
    def _count_error(self, tier: Tier, cause: str) -> None:
        with self._lock:
            errs = self._stats.tiers[tier.name].errors
            errs[cause] = errs.get(cause, 0) + 1

    def _guard(self, tier: Tier, what: str, key: str, fn: Callable[[], T], default: T) -> T:
        """Run one tier call; any failure is counted by cause, logged, and returns ``default``."""
        try:
            return fn()
        except TierError as exc:
            self._count_error(tier, exc.cause)
            if exc.cause != "circuit_open":  # the breaker logs its own changes, once
                message = f"{what} {key} on {tier.name} failed ({exc.cause}): {exc}"
                self._warnings.warning((tier.name, exc.cause), message)
        except Exception as exc:  # a data-path failure must become a miss, never a crash
            cause = type(exc).__name__
            self._count_error(tier, cause)
            message = f"{what} {key} on {tier.name} failed: {exc}"
            self._warnings.warning((tier.name, cause), message, exc_info=True)
        return default

    # ------------------------------------------------------------------ lookup
    def _present(self, tier: Tier, keys: list[str]) -> list[bool]:
        if not keys:
            return []
        return self._guard(
            tier, "lookup", keys[0], partial(tier.contains_many, keys), [False] * len(keys)
        )

    @property
    def local_tiers(self) -> list[Tier]:
        return [t for t in self.tiers if not t.remote]

    @property
    def remote_tier(self) -> Tier | None:
        return next((t for t in self.tiers if t.remote), None)

    def lookup_local(self, hashes: Sequence[str]) -> int:
        """Leading chunks of ``hashes`` that some local tier (CPU, disk) holds, asked now."""
        keys = [self.key(h) for h in hashes]
        found = 0
        while found < len(keys):
            window = keys[found : found + _LOOKUP_WINDOW]
            present = [False] * len(window)
            for tier in self.local_tiers:
                todo = [i for i, p in enumerate(present) if not p]
                for i, ok in zip(todo, self._present(tier, [window[i] for i in todo]), strict=True):
                    present[i] = ok
            lead = next((i for i, p in enumerate(present) if not p), len(window))
            found += lead
            if lead < len(window):
                break
        return found

    def lookup_remote(self, hashes: Sequence[str], start: int = 0) -> RemotePrefix:
        """Leading chunks of ``hashes`` the remote tier holds, and the objects that hold them:
        a search of a few requests (kvtier.prefix). With one chunk per object, it searches from
        chunk ``start`` on (the local tiers hold the ones before); with runs of chunks, it
        walks the objects from the first chunk (an object may start before ``start``).
        ``found`` counts from the first chunk; without a remote tier, or when it fails
        (counted, logged), it is ``start``: nothing beyond what the local tiers hold."""
        remote = self.remote_tier
        if remote is None or start >= len(hashes):
            return RemotePrefix(found=start)
        keys = [self.key(h) for h in hashes]
        begin = time.perf_counter()

        def search() -> RemotePrefix:
            if self.object_chunks == 1:
                found, asked = leading_present(remote.contains_many, keys[start:])
                return RemotePrefix(start + found, (), asked)
            shorts = [short_hash(h) for h in hashes]
            return walk_objects(remote.heads, keys, shorts, self.object_chunks)

        result = self._guard(remote, "lookup", keys[start], search, RemotePrefix(found=start))
        with self._lock:
            self._stats.remote_lookups += 1
            self._stats.remote_lookup_requests += result.requests
            self._stats.remote_lookup_seconds += time.perf_counter() - begin
        return result

    def lookup_prefix(self, hashes: Sequence[str]) -> int:
        """Leading chunks of ``hashes`` present in some tier (asked now, not cached): the local
        tiers first, the remote tier for what follows."""
        found = self.lookup_local(hashes)
        if found < len(hashes):
            found = max(found, self.lookup_remote(hashes, found).found)
        self.count_lookup(len(hashes), found)
        return found

    def count_lookup(self, chunks: int, found: int) -> None:
        with self._lock:
            self._stats.lookups += 1
            self._stats.lookup_chunks += chunks
            self._stats.lookup_hit_chunks += found

    # ------------------------------------------------------------------ read
    def get(self, chunk_hash: str) -> bytes | None:
        """The verified payload of a chunk, promoted into faster tiers; ``None`` is a miss."""
        return self.get_many([chunk_hash])[0]

    def get_many(self, refs: Sequence[str | ChunkRef]) -> list[bytes | None]:
        """Verified payloads, in the order asked (``None``: a miss). Each chunk comes from the
        fastest local tier that holds it (asked one by one: memory and page cache answer
        faster than a thread hand-off), the rest from the remote tier, its objects fetched in
        parallel (one GET for the chunks of one object)."""
        wanted = [r if isinstance(r, ChunkRef) else ChunkRef(r) for r in refs]
        results = [self._get_local(r.chunk_id) for r in wanted]
        remote = self.remote_tier
        missing: dict[str, list[int]] = {}
        for i, payload in enumerate(results):
            if payload is None and remote is not None:
                missing.setdefault(wanted[i].object_id or wanted[i].chunk_id, []).append(i)
        if remote is not None and missing:

            def fetch(item: tuple[str, list[int]]) -> list[bytes | None]:
                return self._get_object(remote, item[0], [wanted[i] for i in item[1]])

            jobs = list(missing.items())
            batches = map(fetch, jobs) if len(jobs) == 1 else self._io.map(fetch, jobs)
            for (_, indices), payloads in zip(jobs, batches, strict=True):
                for i, payload in zip(indices, payloads, strict=True):
                    results[i] = payload
        with self._lock:
            self._stats.gets += len(wanted)
            self._stats.get_hits += sum(p is not None for p in results)
        return results

    def _verified(self, tier: Tier, key: str, item: Stored, chunk_id: str) -> bytes | None:
        """The payload of a blob read from ``tier`` if it passes verification; else the blob
        (the object holding it) is dropped from the tier and None returned."""
        checked = time.perf_counter()
        try:
            verify(item[0], item[1], self._layout, _hash_bytes(chunk_id), self.verify_checksums)
            return item[1]
        except FormatError as exc:
            self._drop(tier, key, exc)
            return None
        finally:
            with self._lock:
                self._stats.verify_seconds += time.perf_counter() - checked

    def _drop(self, tier: Tier, key: str, exc: FormatError) -> None:
        """A blob that must not be read as KV: counted by cause, logged, deleted."""
        self._count_error(tier, exc.cause)
        self._warnings.warning(
            (tier.name, exc.cause), f"dropping {key} from {tier.name}: {exc} ({exc.cause})"
        )
        self._guard(tier, "delete", key, partial(tier.delete, key), None)
        if self._on_chunk is not None:
            self._on_chunk("removed", tier.name, key)

    def _count_read(self, tier: Tier, seconds: float, payloads: Sequence[bytes | None]) -> None:
        with self._lock:
            ts = self._stats.tiers[tier.name]
            ts.get_seconds += seconds
            ts.get_max_seconds = max(ts.get_max_seconds, seconds)
            for payload in payloads:
                if payload is None:
                    ts.misses += 1
                else:
                    ts.hits += 1
                    ts.bytes_read += len(payload)

    def _get_local(self, chunk_id: str) -> bytes | None:
        """The chunk from the fastest local tier holding it (promoted into the faster ones)."""
        key = self.key(chunk_id)
        for level, tier in enumerate(self.local_tiers):
            start = time.perf_counter()
            item = self._guard(tier, "get", key, partial(tier.get, key), None)
            payload = self._verified(tier, key, item, chunk_id) if item is not None else None
            self._count_read(tier, time.perf_counter() - start, [payload])
            if payload is not None and item is not None:
                self._promote([(key, item)], level)
                return self._pinned_copy(key, payload) if level else payload
        return None

    def _get_object(
        self, remote: Tier, object_id: str, refs: Sequence[ChunkRef]
    ) -> list[bytes | None]:
        """The chunks ``refs`` from the remote tier's object of ``object_id``: one GET, each
        chunk verified at its position, in order. The first one that fails verification (or
        that a damaged object no longer holds) drops the object (counted by cause, logged),
        and the chunks after it are misses, as after a missing chunk."""
        key = self.key(object_id)
        start = time.perf_counter()
        item = self._guard(remote, "get", key, partial(remote.get, key), None)
        payloads: list[bytes | None] = [None] * len(refs)
        blobs, broken = split_object(*item) if item is not None else ([], None)
        promoted: list[tuple[str, Stored]] = []
        for i, ref in sorted(enumerate(refs), key=lambda iref: iref[1].position):
            if ref.position >= len(blobs):
                if broken is not None:
                    self._drop(remote, key, broken)
                break
            payloads[i] = self._verified(remote, key, blobs[ref.position], ref.chunk_id)
            if payloads[i] is None:
                break  # dropped: the chunks after this one are not read
            promoted.append((self.key(ref.chunk_id), blobs[ref.position]))
        self._count_read(remote, time.perf_counter() - start, payloads)
        self._promote(promoted, self.tiers.index(remote))
        if not getattr(self.tiers[0], "pinned", False):
            return payloads
        return [
            self._pinned_copy(self.key(ref.chunk_id), p) if p is not None else None
            for ref, p in zip(refs, payloads, strict=True)
        ]

    def _pinned_copy(self, key: str, payload: bytes) -> bytes:
        """The CPU tier's copy of a chunk just promoted into it, where that tier is pinned
        (kvtier.tiers.cpu.CpuSlabTier on CUDA): the load then goes to the GPU from there with
        no bounce, and the promotion's copy is the only one. Else ``payload``."""
        cpu = self.tiers[0]
        if not getattr(cpu, "pinned", False):
            return payload
        item = self._guard(cpu, "get", key, partial(cpu.get, key), None)
        return item[1] if item is not None else payload

    def _promote(self, items: Sequence[tuple[str, Stored]], level: int) -> None:
        for tier in self.tiers[:level]:
            for key, item in items:
                if tier.name == "cpu":
                    self._write(tier, [(key, item)])
                else:
                    self._write_async(tier, [(key, item)])

    # ------------------------------------------------------------------ write
    def put(self, chunk_hash: str, payload: bytes | memoryview, num_tokens: int) -> None:
        """Store a chunk: CPU tier now, slower tiers in the background. Never raises on I/O."""
        self.put_run([(chunk_hash, payload, num_tokens)])

    def put_run(
        self,
        chunks: Sequence[tuple[str, bytes | memoryview, int]],
        on_done: Callable[[], None] | None = None,
        tiers: SaveTiers = "all",
    ) -> None:
        """Store consecutive chunks of one prompt, each (hash, payload, tokens): every tier but
        the remote one as chunks; the remote tier as one object keyed by the first chunk.
        ``tiers``: "local" leaves the remote tier out, "remote" writes it only (the remote
        tier's admission rule, kvtier.admission). Never raises on I/O.

        A payload given as a view is lent: with ``on_done`` the background writes (disk, S3)
        read the view itself, and ``on_done`` is called once the last of them has ended
        (written, failed or dropped), after which the buffer may be reused; the CPU tier
        copies it before this returns. Without ``on_done`` a view is copied once, here, for
        every tier."""
        if not chunks:
            if on_done is not None:
                on_done()
            return
        lent = on_done is not None
        items: list[tuple[str, Stored]] = []
        for chunk_hash, data, num_tokens in chunks:
            # A view of a buffer the caller reuses is copied once, here; a lent view goes to
            # the writers as it is (they only read it: os.writev, a PUT body's reader), typed
            # as the bytes it stands for.
            payload = (
                cast(bytes, data) if lent and not isinstance(data, bytes) else owned_copy(data)
            )
            header = pack_header(self._layout, _hash_bytes(chunk_hash), num_tokens, payload)
            items.append((self.key(chunk_hash), (header, payload)))
        with self._lock:
            self._stats.puts += len(items)
            self._stats.put_bytes += sum(len(item[1]) for _, item in items)
        latch = _Latch(on_done)
        for tier in self.tiers:
            if not writes_to(tiers, tier.remote):
                continue
            if tier.remote:
                self._write_async(tier, items, latch)
            elif tier.name == "cpu":
                for one in items:  # it copies what it keeps (kvtier.tiers.cpu), now
                    self._write(tier, [one])
            else:
                for one in items:
                    self._write_async(tier, [one], latch)
        latch.arm()

    def _write(self, tier: Tier, items: Sequence[tuple[str, Stored]]) -> None:
        start = time.perf_counter()
        key = items[0][0]
        ok = self._guard(tier, "put", key, partial(_put_ok, tier, items), False)
        elapsed = time.perf_counter() - start
        with self._lock:
            ts = self._stats.tiers[tier.name]
            ts.put_seconds += elapsed
            if ok:
                ts.puts += len(items)
                ts.bytes_written += sum(len(h) + len(p) for _, (h, p) in items)
        if self._on_chunk is not None:
            for written, _ in items:
                self._on_chunk("stored" if ok else "failed", tier.name, written)

    def _write_async(
        self, tier: Tier, items: Sequence[tuple[str, Stored]], latch: _Latch | None = None
    ) -> None:
        size = sum(len(h) + len(p) for _, (h, p) in items)
        if latch is not None:
            latch.add()
        write = partial(self._write_then, tier, items, latch)
        if not self._writer.submit(size, write):
            if latch is not None:
                latch.done()
            if self._on_chunk is not None:
                for dropped, _ in items:
                    self._on_chunk("failed", tier.name, dropped)
            with self._lock:  # over the caps (or closing): skipped and counted, never waited for
                self._stats.dropped_writes += len(items)
                errs = self._stats.tiers[tier.name].errors
                errs["backpressure"] = errs.get("backpressure", 0) + len(items)

    def _write_then(
        self, tier: Tier, items: Sequence[tuple[str, Stored]], latch: _Latch | None
    ) -> None:
        try:
            self._write(tier, items)
        finally:
            if latch is not None:
                latch.done()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until background writes are done; ``False`` if ``timeout`` passed first."""
        return self._writer.flush(timeout)

    # ------------------------------------------------------------------ admin
    def delete(self, chunk_hash: str) -> None:
        key = self.key(chunk_hash)
        for tier in self.tiers:
            self._guard(tier, "delete", key, partial(tier.delete, key), None)

    def stats(self) -> StoreStats:
        """A snapshot (a copy): mergeable with ``+``, serialisable with ``to_dict``."""
        with self._lock:
            snap = copy.deepcopy(self._stats)
        for tier in self.tiers:
            snap.tiers[tier.name].evictions = tier.evictions()
            usage = tier.usage()
            if usage is not None:
                snap.tiers[tier.name].used_bytes, snap.tiers[tier.name].capacity_bytes = usage
            breaker = getattr(tier, "breaker", None)
            if breaker is not None:
                snap.tiers[tier.name].circuit_opened = breaker.opened
                snap.tiers[tier.name].circuit_closed = breaker.closed
                snap.tiers[tier.name].circuit_open = int(not breaker.allows())
        return snap

    def close(self, timeout: float | None = 30.0) -> None:
        """Finish background writes (up to ``timeout``), write the stats file, release tiers."""
        if self._closed:
            return
        if not self.flush(timeout):
            log.warning("kvtier: closing with background writes still in flight")
        self._closed = True
        if self._stats_file is not None:
            self._stats_file.close()
        self._writer.close()
        self._io.shutdown(wait=True)
        for tier in self.tiers:
            self._guard(tier, "close", "-", tier.close, None)

    def __enter__(self) -> TieredStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
