"""Store counters as a plain, picklable, mergeable snapshot.

The vLLM connector surfaces these through KVConnectorStats (workers' snapshots are summed with
``+``/``merge``); ``kvtier stats`` sums the per-process JSON files the store writes to
``stats_dir``. Hit figures are honest by construction: ``lookup_chunks`` counts every chunk asked
about and ``lookup_hit_chunks`` only the leading ones actually found, and a tier's ``hits`` count
only reads that passed verification.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import socket
import tempfile
import threading
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any, TypeVar

log = logging.getLogger(__name__)

_Stats = TypeVar("_Stats", "TierStats", "StoreStats")


def _added(a: _Stats, b: _Stats, maxima: tuple[str, ...] = ()) -> _Stats:
    """Field by field: numbers added (the ``maxima`` fields: the larger one), mappings merged
    key by key. A new snapshot: nothing in it is shared with ``a`` or ``b``."""
    values: dict[str, Any] = {}
    for f in fields(a):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if isinstance(x, dict):
            merged = {k: type(v)() + v for k, v in x.items()}  # int() is 0, TierStats() empty
            for k, v in y.items():
                merged[k] = merged.get(k, type(v)()) + v
            values[f.name] = merged
        else:
            values[f.name] = max(x, y) if f.name in maxima else x + y
    return type(a)(**values)


@dataclass
class TierStats:
    """Counters of one tier."""

    hits: int = 0
    misses: int = 0
    bytes_read: int = 0
    puts: int = 0
    bytes_written: int = 0
    evictions: int = 0
    get_seconds: float = 0.0
    get_max_seconds: float = 0.0
    put_seconds: float = 0.0
    #: Times the tier's circuit breaker opened, and whether it is open now (summed over
    #: processes: how many of them do not ask the tier at the moment).
    circuit_opened: int = 0
    circuit_closed: int = 0
    circuit_open: int = 0
    #: Bytes held now and the cap, for a tier with a cap of its own (CPU, disk); 0 otherwise.
    used_bytes: int = 0
    capacity_bytes: int = 0
    #: Failures by cause (e.g. ``checksum``, ``timeout``, ``no_space``, ``ConnectionError``).
    errors: dict[str, int] = field(default_factory=dict)

    def __add__(self, other: TierStats) -> TierStats:
        return _added(self, other, maxima=("get_max_seconds",))

    @property
    def mean_get_ms(self) -> float:
        n = self.hits + self.misses
        return 1000.0 * self.get_seconds / n if n else 0.0


@dataclass
class StoreStats:
    """Counters of one TieredStore (or the sum of several)."""

    #: ``lookup_prefix`` calls, chunks asked about, leading chunks found.
    lookups: int = 0
    lookup_chunks: int = 0
    lookup_hit_chunks: int = 0
    #: Searches of the remote tier, the requests they made, and their time.
    remote_lookups: int = 0
    remote_lookup_requests: int = 0
    remote_lookup_seconds: float = 0.0
    #: Seconds spent checking headers and checksums of what the tiers returned.
    verify_seconds: float = 0.0
    #: ``get`` calls, and those answered with verified data by some tier.
    gets: int = 0
    get_hits: int = 0
    #: ``put`` calls, payload bytes, and background writes dropped because too many were in flight.
    puts: int = 0
    put_bytes: int = 0
    dropped_writes: int = 0
    tiers: dict[str, TierStats] = field(default_factory=dict)

    def __add__(self, other: StoreStats) -> StoreStats:
        return _added(self, other)

    def merge(self, other: StoreStats) -> StoreStats:
        """Same as ``self + other`` (returns a new snapshot)."""
        return self + other

    @property
    def lookup_hit_rate(self) -> float:
        return self.lookup_hit_chunks / self.lookup_chunks if self.lookup_chunks else 0.0

    def is_empty(self) -> bool:
        return self == StoreStats(tiers={k: TierStats() for k in self.tiers})

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> StoreStats:
        tiers = {k: TierStats(**v) for k, v in data.get("tiers", {}).items()}
        top = {k: v for k, v in data.items() if k != "tiers"}
        return cls(**top, tiers=tiers)


#: A tier's fill: how full it is (``used_bytes``, ``capacity_bytes``: gauges built from deltas) and
#: what staying under its cap cost (``evictions``).
FILL_FIELDS = ("evictions", "used_bytes", "capacity_bytes")


def without_fill(stats: StoreStats) -> StoreStats:
    """``stats`` with every tier's fill at zero: the baseline whose first delta reports a tier's
    whole fill (what it held and its cap at start, not only what changed since)."""
    tiers = {
        name: replace(tier, evictions=0, used_bytes=0, capacity_bytes=0)
        for name, tier in stats.tiers.items()
    }
    return replace(stats, tiers=tiers)


def store_deltas(prev: StoreStats, now: StoreStats, *, include_fill: bool = True) -> dict[str, Any]:
    """What a store did between two snapshots, as stats keys (see the module docstring).

    ``include_fill=False`` leaves out the tiers' fill (FILL_FIELDS): for a store that only
    looks chunks up (the scheduler's), whose disk index is the one it read at start while the
    worker's store writes, evicts and reports the same directory.
    """
    out: dict[str, Any] = {}
    counted = (
        "hits",
        "misses",
        "bytes_read",
        "puts",
        "bytes_written",
        "circuit_opened",
        "circuit_closed",
    ) + (FILL_FIELDS if include_fill else ())
    for name, tier in now.tiers.items():
        before = prev.tiers.get(name)
        for field_name in counted:
            delta = getattr(tier, field_name) - (getattr(before, field_name) if before else 0)
            if delta:
                out[f"tier.{name}.{field_name}"] = delta
        for cause, count in tier.errors.items():
            delta = count - (before.errors.get(cause, 0) if before else 0)
            if delta:
                out[f"tier.{name}.errors.{cause}"] = delta
                out[f"tier.{name}.errors"] = out.get(f"tier.{name}.errors", 0) + delta
    for field_name in ("dropped_writes", "remote_lookup_requests"):
        delta = getattr(now, field_name) - getattr(prev, field_name)
        if delta:
            out[field_name] = delta
    return out


_instances = itertools.count()


def stats_file_name() -> str:
    """``<host>-<pid>-<n>.json``: unique per store, also when one process holds several (vLLM's
    scheduler and worker share a process in single-process mode)."""
    return f"{socket.gethostname()}-{os.getpid()}-{next(_instances)}.json"


def write_stats_file(path: str, stats: StoreStats) -> str:
    """Write ``stats`` atomically to ``path`` (creating its directory); return the path."""
    directory = os.path.dirname(path)
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".stats-", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(stats.to_dict(), f, indent=1, sort_keys=True)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
    return path


def read_stats_dir(directory: str) -> dict[str, StoreStats]:
    """Every process's last snapshot in ``directory`` by file name (unreadable files skipped)."""
    out: dict[str, StoreStats] = {}
    try:
        names = sorted(os.listdir(directory))
    except FileNotFoundError:
        return out
    for name in names:
        if not name.endswith(".json"):
            continue
        try:
            with open(os.path.join(directory, name), encoding="utf-8") as f:
                out[name] = StoreStats.from_dict(json.load(f))
        except (OSError, ValueError, TypeError):
            continue
    return out


class StatsFile:
    """A store's snapshot written to ``<directory>/<stats_file_name()>`` every ``interval``
    seconds by a thread, and once more at ``close`` (``kvtier stats`` reads them)."""

    def __init__(self, directory: str, interval: float, snapshot: Callable[[], StoreStats]) -> None:
        self.path = os.path.join(directory, stats_file_name())
        self._snapshot = snapshot
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._loop, args=(interval,), name="kvtier-stats", daemon=True
        )
        self._thread.start()

    def _loop(self, interval: float) -> None:
        while not self._stop.wait(interval):
            self.write()

    def write(self) -> None:
        try:
            write_stats_file(self.path, self._snapshot())
        except OSError as exc:
            log.warning("kvtier: cannot write stats to %s: %s", self.path, exc)

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self.write()
