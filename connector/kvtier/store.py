"""TieredStore: longest-prefix lookup across tiers, verified reads with promotion, write-through.

Tiers are ordered fastest first (CPU, disk, S3). ``put`` stores into the CPU tier at once and
writes the slower tiers in the background (bounded: beyond ``s3_max_inflight_reqs`` writes or
``max_write_backlog_size`` bytes in flight, new ones are dropped and counted rather than queued
without limit). A remote tier sits behind a circuit breaker (kvtier.tiers.guard), and its
lookup is a search of a few requests (kvtier.prefix), not one per chunk. ``get`` reads the
fastest tier holding the chunk, verifies the header and checksum, and copies the chunk into the
faster tiers. Payloads are passed by reference between tiers (bytes are immutable): the CPU tier
holds the caller's object, and a read returns the payload object the tier produced. Every
failure in the data path (I/O error, timeout, corrupt blob, full disk) is a miss: counted per
tier by cause and logged (at most once per cause and tier every few seconds: a dead endpoint
must not write a warning per chunk), never raised into the caller.
"""

from __future__ import annotations

import copy
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial
from typing import TypeVar

from kvtier.config import KvtierConfig
from kvtier.format import FormatError, pack_header, verify
from kvtier.prefix import leading_present
from kvtier.ratelimit import RateLimitedLog
from kvtier.stats import StoreStats, TierStats, stats_file_name, write_stats_file
from kvtier.tiers.base import Stored, Tier, TierError

log = logging.getLogger(__name__)
T = TypeVar("T")

#: Chunks asked of a local tier per round in ``lookup_local``.
_LOOKUP_WINDOW = 32


def _hash_bytes(chunk_id: str) -> bytes:
    """The chunk hash of an id (``<hash>`` or ``<namespace>/<hash>``), as the header holds it."""
    return bytes.fromhex(chunk_id.rpartition("/")[2])


def _put_ok(tier: Tier, key: str, item: Stored) -> bool:
    tier.put(key, item[0], item[1])
    return True


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
    ) -> None:
        if not tiers:
            raise ValueError("TieredStore needs at least one tier")
        self.tiers = list(tiers)
        self.fingerprint = fingerprint
        self.namespace = namespace
        self.verify_checksums = verify_checksums
        self._layout = bytes.fromhex(fingerprint)
        self._prefix = f"{namespace}/{fingerprint}/"
        self._lock = threading.Lock()
        self._stats = StoreStats(tiers={t.name: TierStats() for t in self.tiers})
        self._io = ThreadPoolExecutor(max_workers=io_threads, thread_name_prefix="kvtier-io")
        self._writer = ThreadPoolExecutor(max_workers=io_threads, thread_name_prefix="kvtier-write")
        self._max_inflight = max_inflight_writes
        self._max_backlog = max_backlog_bytes
        self._inflight = 0
        self._backlog = 0
        self._warnings = RateLimitedLog(log)
        self._idle = threading.Condition(self._lock)
        self._closed = False
        self._stats_path = os.path.join(stats_dir, stats_file_name()) if stats_dir else None
        self._stop = threading.Event()
        self._stats_thread: threading.Thread | None = None
        if stats_dir:
            self._stats_thread = threading.Thread(
                target=self._stats_loop, args=(stats_interval,), name="kvtier-stats", daemon=True
            )
            self._stats_thread.start()

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_config(cls, cfg: KvtierConfig, fingerprint: str) -> TieredStore:
        """Build the tiers ``cfg`` enables (CPU, disk, S3), fastest first."""
        tiers: list[Tier] = []
        if cfg.local_cpu and cfg.cpu_bytes > 0:
            from kvtier.tiers.cpu import CpuTier

            tiers.append(CpuTier(cfg.cpu_bytes))
        if cfg.local_disk:
            from kvtier.tiers.disk import DiskTier

            tiers.append(DiskTier(cfg.local_disk, cfg.disk_bytes))
        if cfg.remote_url:
            from kvtier.tiers.guard import CircuitBreaker, GuardedTier
            from kvtier.tiers.s3 import make_s3_tier

            s3 = make_s3_tier(cfg)
            breaker = CircuitBreaker(
                s3.name,
                s3.probe,
                threshold=cfg.remote_failure_threshold,
                retry_secs=cfg.remote_retry_secs,
            )
            tiers.append(GuardedTier(s3, breaker))
        if not tiers:
            raise ValueError(f"no tier enabled in {cfg.source}")
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
        )

    def key(self, chunk_hash: str) -> str:
        """The tier key of a chunk: ``<namespace>/<fingerprint>/<hash>``.

        A chunk id ``<namespace>/<hash>`` (a request that chose its own namespace) is filed
        under that namespace instead of the store's.
        """
        namespace, sep, digest = chunk_hash.rpartition("/")
        if sep:
            return f"{namespace}/{self.fingerprint}/{digest}"
        return self._prefix + chunk_hash

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

    def lookup_remote(self, hashes: Sequence[str]) -> int:
        """Leading chunks of ``hashes`` the remote tier holds: a search of a few requests
        (kvtier.prefix). 0 without a remote tier, or when it fails (counted, logged)."""
        remote = self.remote_tier
        if remote is None or not hashes:
            return 0
        keys = [self.key(h) for h in hashes]
        start = time.perf_counter()

        def search() -> tuple[int, int]:
            return leading_present(remote.contains_many, keys)

        found, asked = self._guard(remote, "lookup", keys[0], search, (0, 0))
        with self._lock:
            self._stats.remote_lookups += 1
            self._stats.remote_lookup_requests += asked
            self._stats.remote_lookup_seconds += time.perf_counter() - start
        return found

    def lookup_prefix(self, hashes: Sequence[str]) -> int:
        """Leading chunks of ``hashes`` present in some tier (asked now, not cached): the local
        tiers first, the remote tier for what follows."""
        found = self.lookup_local(hashes)
        if found < len(hashes):
            found += self.lookup_remote(hashes[found:])
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
        key = self.key(chunk_hash)
        chunk = _hash_bytes(chunk_hash)
        result: bytes | None = None
        for level, tier in enumerate(self.tiers):
            start = time.perf_counter()
            item = self._guard(tier, "get", key, partial(tier.get, key), None)
            elapsed = time.perf_counter() - start
            payload: bytes | None = None
            verified = 0.0
            if item is not None:
                checked = time.perf_counter()
                try:
                    verify(item[0], item[1], self._layout, chunk, self.verify_checksums)
                    payload = item[1]
                except FormatError as exc:
                    self._count_error(tier, exc.cause)
                    message = f"dropping {key} from {tier.name}: {exc} ({exc.cause})"
                    self._warnings.warning((tier.name, exc.cause), message)
                    self._guard(tier, "delete", key, partial(tier.delete, key), None)
                verified = time.perf_counter() - checked
            with self._lock:
                self._stats.verify_seconds += verified
                ts = self._stats.tiers[tier.name]
                ts.get_seconds += elapsed
                ts.get_max_seconds = max(ts.get_max_seconds, elapsed)
                if payload is None:
                    ts.misses += 1
                else:
                    ts.hits += 1
                    ts.bytes_read += len(payload)
            if payload is not None and item is not None:
                self._promote(key, item, level)
                result = payload
                break
        with self._lock:
            self._stats.gets += 1
            self._stats.get_hits += result is not None
        return result

    def get_many(self, hashes: Sequence[str]) -> list[bytes | None]:
        """``get`` for each hash, in parallel; same order as ``hashes``."""
        if len(hashes) <= 1:
            return [self.get(h) for h in hashes]
        return list(self._io.map(self.get, hashes))

    def _promote(self, key: str, item: Stored, level: int) -> None:
        for tier in self.tiers[:level]:
            if tier.name == "cpu":
                self._write(tier, key, item)
            else:
                self._write_async(tier, key, item)

    # ------------------------------------------------------------------ write
    def put(self, chunk_hash: str, payload: bytes | memoryview, num_tokens: int) -> None:
        """Store a chunk: CPU tier now, slower tiers in the background. Never raises on I/O."""
        key = self.key(chunk_hash)
        if not isinstance(payload, bytes):  # a view of a buffer the caller will reuse
            payload = bytes(payload)
        item = (pack_header(self._layout, _hash_bytes(chunk_hash), num_tokens, payload), payload)
        with self._lock:
            self._stats.puts += 1
            self._stats.put_bytes += len(payload)
        for tier in self.tiers:
            if tier.name == "cpu":
                self._write(tier, key, item)
            else:
                self._write_async(tier, key, item)

    def _write(self, tier: Tier, key: str, item: Stored) -> None:
        start = time.perf_counter()
        ok = self._guard(tier, "put", key, partial(_put_ok, tier, key, item), False)
        elapsed = time.perf_counter() - start
        with self._lock:
            ts = self._stats.tiers[tier.name]
            ts.put_seconds += elapsed
            if ok:
                ts.puts += 1
                ts.bytes_written += len(item[0]) + len(item[1])

    def _write_async(self, tier: Tier, key: str, item: Stored) -> None:
        size = len(item[0]) + len(item[1])
        with self._lock:
            full = self._inflight >= self._max_inflight or self._backlog + size > self._max_backlog
            if self._closed or full:
                self._stats.dropped_writes += 1
                errs = self._stats.tiers[tier.name].errors
                errs["backpressure"] = errs.get("backpressure", 0) + 1
                return
            self._inflight += 1
            self._backlog += size
        try:
            fut: Future[None] = self._writer.submit(self._write, tier, key, item)
        except RuntimeError:  # executor shut down between the check and the submit
            self._write_done(size, None)
            return
        fut.add_done_callback(partial(self._write_done, size))

    def _write_done(self, size: int, _fut: Future[None] | None) -> None:
        with self._lock:
            self._inflight -= 1
            self._backlog -= size
            if self._inflight == 0:
                self._idle.notify_all()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until background writes are done; ``False`` if ``timeout`` passed first."""
        with self._lock:
            return self._idle.wait_for(lambda: self._inflight == 0, timeout)

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

    def _stats_loop(self, interval: float) -> None:
        while not self._stop.wait(interval):
            self._write_stats()

    def _write_stats(self) -> None:
        if not self._stats_path:
            return
        try:
            write_stats_file(self._stats_path, self.stats())
        except OSError as exc:
            log.warning("kvtier: cannot write stats to %s: %s", self._stats_path, exc)

    def close(self, timeout: float | None = 30.0) -> None:
        """Finish background writes (up to ``timeout``), write the stats file, release tiers."""
        if self._closed:
            return
        if not self.flush(timeout):
            log.warning("kvtier: closing with background writes still in flight")
        with self._lock:
            self._closed = True
        self._stop.set()
        if self._stats_thread is not None:
            self._stats_thread.join()
        self._write_stats()
        self._writer.shutdown(wait=True, cancel_futures=True)
        self._io.shutdown(wait=True)
        for tier in self.tiers:
            self._guard(tier, "close", "-", tier.close, None)

    def __enter__(self) -> TieredStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
