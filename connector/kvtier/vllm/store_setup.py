"""The connector's stores, opened at start with the remote tier checked once.

A remote tier that cannot be used at start (wrong credentials, endpoint down or hung, missing
bucket) is, by default, logged once with its cause and fix and served without: its circuit
breaker starts open, and a background probe brings it back when it answers, with no restart.
With ``remote_required: true`` the connector refuses to start instead (vLLM exits with the
message). A configuration the S3 client cannot even be built from (a profile that does not
exist) is treated the same way; a file that does not validate never gets here (load_config
refuses it).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

from kvtier.config import ConfigError, KvtierConfig
from kvtier.prefix import RemotePrefix
from kvtier.store import TieredStore
from kvtier.tiers.base import TierError
from kvtier.tiers.cpu import PinHost

log = logging.getLogger("kvtier.vllm")

#: Threads that run remote lookups beside vLLM's scheduler (each lookup: a few requests).
LOOKUP_THREADS = 4


class RemoteTierUnavailable(RuntimeError):
    """The remote tier cannot be used at start and the config says it is required."""


def open_store(
    cfg: KvtierConfig,
    fingerprint: str,
    who: str,
    object_chunks: int = 1,
    *,
    disk_maintain: bool = True,
    disk_peers: frozenset[str] = frozenset(),
    remote_maintain: bool = False,
    cpu_slot_bytes: int | None = None,
    cpu_pin: PinHost | None = None,
) -> TieredStore | None:
    """The store of ``cfg`` (None when it has no tier left to use); ``who`` names the process
    side in messages ("scheduler", "worker tp0"). ``disk_maintain``, ``disk_peers``,
    ``remote_maintain``: see `kvtier.tiers.tiers_from_config` (a scheduler that only looks up,
    the other TP ranks, the workers that keep the remote tier's cap); ``cpu_slot_bytes``,
    ``cpu_pin``: the worker's CPU tier as a slab (`kvtier.tiers.cpu.CpuSlabTier`)."""

    def store_of(c: KvtierConfig, chunks: int) -> TieredStore:
        return TieredStore.from_config(
            c,
            fingerprint,
            chunks,
            disk_maintain=disk_maintain,
            disk_peers=disk_peers,
            remote_maintain=remote_maintain,
            cpu_slot_bytes=cpu_slot_bytes,
            cpu_pin=cpu_pin,
        )

    try:
        store = store_of(cfg, object_chunks)
    except ConfigError as exc:
        if not cfg.remote_url:
            raise
        _unavailable(cfg, who, "config", str(exc))
        without = cfg.model_copy(update={"remote_url": None})
        if not (without.local_cpu and without.cpu_bytes) and not without.local_disk:
            return None
        return store_of(without, 1)
    remote = store.remote_tier
    if remote is not None:
        try:
            remote.probe()
        except TierError as exc:
            from kvtier.tiers.s3 import fix_for

            fix = fix_for(exc.cause, cfg)
            _unavailable(cfg, who, exc.cause, f"{exc}" + (f"; {fix}" if fix else ""))
            breaker = getattr(remote, "breaker", None)
            if breaker is not None:
                breaker.trip(exc.cause, "it failed its check at start")
    return store


def _unavailable(cfg: KvtierConfig, who: str, cause: str, detail: str) -> None:
    message = f"the S3 tier {cfg.remote_url} of {cfg.source} cannot be used ({cause}): {detail}"
    if cfg.remote_required:
        raise RemoteTierUnavailable(
            f"kvtier ({who}): {message}. remote_required is true: refusing to start "
            "(set it to false to serve without the S3 tier until it answers)"
        )
    log.warning(
        "kvtier (%s): %s. Serving without it (remote_required: false); it is probed again "
        "in the background",
        who,
        message,
    )


class RemoteLookups:
    """Remote lookups of the scheduler side, run in threads: ``submit`` returns a future."""

    def __init__(self, store: TieredStore) -> None:
        self._store = store
        self._pool = ThreadPoolExecutor(LOOKUP_THREADS, thread_name_prefix="kvtier-lookup")

    def submit(self, hashes: Sequence[str], start: int) -> Future[RemotePrefix]:
        """Look up what the remote tier holds of ``hashes`` (the local tiers hold the first
        ``start`` chunks), in a thread."""
        return self._pool.submit(self._store.lookup_remote, list(hashes), start)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class StoreLookups:
    """The scheduler side's lookups (`kvtier.vllm.scheduler.ChunkLookups`) in its store of the
    shared tiers: the disk tier asked now, the remote tier in threads (`RemoteLookups`). Without
    a store (no shared tier configured, or none left to use) no tier holds anything beyond the
    scheduler's own index of the worker's CPU tier."""

    def __init__(self, store: TieredStore | None) -> None:
        self._store = store
        self._remote = (
            RemoteLookups(store) if store is not None and store.remote_tier is not None else None
        )
        self._disk = next((t for t in store.tiers if t.name == "disk"), None) if store else None

    def local_prefix(self, hashes: Sequence[str]) -> int:
        return self._store.lookup_local(hashes) if self._store is not None else 0

    def remote_prefix(self, hashes: Sequence[str], start: int) -> Future[RemotePrefix] | None:
        return self._remote.submit(hashes, start) if self._remote is not None else None

    def count_lookup(self, asked: int, found: int) -> None:
        if self._store is not None:
            self._store.count_lookup(asked, found)

    def on_disk(self, hashes: Sequence[str]) -> list[bool]:
        store, disk = self._store, self._disk
        if store is None or disk is None:
            return [False] * len(hashes)
        return disk.contains_many([store.key(h) for h in hashes])

    def close(self) -> None:
        """Stop the remote lookups' threads (the store is its opener's to close)."""
        if self._remote is not None:
            self._remote.close()
