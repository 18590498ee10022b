"""A cap on the shared (remote) tier, kept by every process that writes it.

Several servers write one prefix of one bucket; none of them is in charge. Each one, in a
thread of its own, every ``interval_secs`` (with jitter, and at once when its own writes take
the prefix over the cap):

1. lists the prefix: every object's size and last-modified time. The bucket is the only state,
   so a restart loses nothing that bounds the tier;
2. *touches* (copies onto itself) the objects it has read since its last pass: their
   last-modified time becomes now (RGW's clock; this host's is never compared with it). So an
   object's last-modified time is its last write or its last read, to within one interval: an
   approximate LRU across hosts, at one HEAD + one COPY per object read in an interval (not
   per read). A touch that fails costs that object its recency, never the pass;
3. when the listed bytes exceed the cap (or would, with the writes it skipped since its last
   pass), deletes the least recently used objects down to ``low_water`` of it, or lower to
   make room for those writes (1000 per request). Two writers evicting at once pick from the same
   oldest end, so they mostly delete the same objects, never each other's new work in a loop;
   a writer that is down only stops its own passes.

Between two passes a writer keeps adding its own writes to the fill it listed. A write that
would take that sum past the cap plus ``slack_bytes`` starts a pass that makes room for it and
waits for it (up to ``admit_wait_secs``; writes run in the background, not in requests); if it
still does not fit it is skipped (``TierError`` cause ``over_cap``: the store counts it, the
chunk is not shared). Before its first listing a writer writes at most ``slack_bytes``. The
prefix therefore stays under the cap plus, per writer, its slack plus what the *other* writers
wrote since its last pass: the bound stated in docs/store.md.
"""

from __future__ import annotations

import logging
import math
import random
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence

from kvtier.tiers.base import Stored, Tier, TierError

log = logging.getLogger(__name__)

#: Objects read since the last pass that are remembered for touching (the oldest are forgotten).
MAX_TRACKED_READS = 65536


class BoundedTier(Tier):
    """``inner`` (the remote tier, behind its circuit breaker) kept under ``capacity_bytes``."""

    def __init__(
        self,
        inner: Tier,
        capacity_bytes: int,
        *,
        interval_secs: float = 30.0,
        low_water: float = 0.9,
        slack_bytes: int | None = None,
    ) -> None:
        self.inner = inner
        self.name = inner.name
        self.remote = inner.remote
        #: The circuit breaker of the tier inside, for the store's stats.
        self.breaker = getattr(inner, "breaker", None)
        self.capacity_bytes = capacity_bytes
        self.low_bytes = int(capacity_bytes * low_water)
        self.slack_bytes = capacity_bytes // 20 if slack_bytes is None else slack_bytes
        self.interval_secs = interval_secs
        self._lock = threading.Lock()
        #: Notified at the end of each pass (writes waiting for room).
        self._passed = threading.Condition(self._lock)
        #: Longest a write waits for a pass to make room for it (it waits only while passes
        #: take less: a huge prefix's listing must not hold the background writers).
        self.admit_wait_secs = min(interval_secs, 2.0)
        self._listed = False
        self._fill = 0  # bytes listed at the last pass
        #: Bytes of this process's writes under way (reserved as they start), and of those
        #: that ended since the last pass's listing began (not in that listing for sure).
        self._inflight = 0
        self._completed = 0
        self._read: OrderedDict[str, None] = OrderedDict()
        self._evicted = 0
        self._passes = 0  # passes completed
        self._ended = 0  # passes ended, completed or failed (waiting writers watch it)
        self._in_pass = False
        self._last_pass_secs = 0.0
        #: Bytes of writes skipped since the last pass: the next pass frees room for them.
        self._demand = 0
        self._wake = threading.Event()
        self._closing = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name=f"kvtier-{self.name}-cap", daemon=True
        )
        self._thread.start()

    # ------------------------------------------------------------------ writes
    def _held(self) -> int:
        """Bytes under the prefix as this process knows them (the lock held)."""
        return (self._fill if self._listed else 0) + self._completed + self._inflight

    def _fits(self, nbytes: int) -> bool:
        limit = self.capacity_bytes + self.slack_bytes if self._listed else self.slack_bytes
        return self._held() + nbytes <= limit

    def _admit(self, nbytes: int) -> None:
        """Reserve ``nbytes`` of room (writes run in parallel: each counts from its start). A
        write that does not fit asks for a pass that makes room for it and, while passes are
        quick, waits for it (it runs in a background writer, never in a request); then it is
        skipped if it still does not fit."""
        with self._passed:
            if not self._fits(nbytes) and not self._closing.is_set():
                self._demand = min(self.capacity_bytes // 2, self._demand + nbytes)
                self._wake.set()
                if self._listed and self._last_pass_secs <= self.admit_wait_secs:
                    # The pass under way listed before this demand: wait for the next one.
                    after = self._ended + int(self._in_pass)
                    self._passed.wait_for(lambda: self._ended > after, self.admit_wait_secs)
            if not self._fits(nbytes):
                raise TierError(
                    "over_cap",
                    f"the {self.name} tier is at its cap ({self.capacity_bytes} bytes, "
                    f"{self._held()} held as last listed plus written since): write skipped, "
                    "eviction did not free room in time",
                )
            self._inflight += nbytes
            over = self._listed and self._held() > self.capacity_bytes
        if over:
            self._wake.set()

    def _write(self, nbytes: int, write: Callable[[], None]) -> None:
        self._admit(nbytes)
        try:
            write()
        except BaseException:
            with self._lock:
                self._inflight -= nbytes
            raise
        with self._lock:
            self._inflight -= nbytes
            self._completed += nbytes

    def put(self, key: str, header: bytes, payload: bytes) -> None:
        self._write(len(header) + len(payload), lambda: self.inner.put(key, header, payload))

    def put_object(self, key: str, parts: Sequence[bytes], chunk_list: str) -> None:
        nbytes = sum(len(p) for p in parts)
        self._write(nbytes, lambda: self.inner.put_object(key, parts, chunk_list))

    # ------------------------------------------------------------------ reads
    def get(self, key: str) -> Stored | None:
        item = self.inner.get(key)
        if item is not None:
            with self._lock:
                self._read[key] = None
                self._read.move_to_end(key)
                if len(self._read) > MAX_TRACKED_READS:
                    self._read.popitem(last=False)
        return item

    def contains(self, key: str) -> bool:
        return self.inner.contains(key)

    def contains_many(self, keys: Sequence[str]) -> list[bool]:
        return self.inner.contains_many(keys)

    def heads(self, keys: Sequence[str]) -> list[list[str] | None]:
        return self.inner.heads(keys)

    def delete(self, key: str) -> None:
        self.inner.delete(key)

    def delete_many(self, keys: Sequence[str]) -> int:
        return self.inner.delete_many(keys)

    def list_keys(self, prefix: str = "") -> Iterator[tuple[str, int]]:
        return self.inner.list_keys(prefix)

    def list_objects(self, prefix: str = "") -> Iterator[tuple[str, int, float]]:
        return self.inner.list_objects(prefix)

    def touch(self, key: str) -> None:
        self.inner.touch(key)

    def probe(self) -> None:
        self.inner.probe()

    # ------------------------------------------------------------------ the pass
    def run_pass(self) -> None:
        """List, touch what was read, evict down to the low-water mark (one pass)."""
        started = time.monotonic()
        with self._lock:
            read, self._read = list(self._read), OrderedDict()
            # Writes that ended before the listing begins are in it; later ones may not be.
            completed_before = self._completed
            demand, self._demand = self._demand, 0
        listed = {key: (size, mtime) for key, size, mtime in self.inner.list_objects()}
        # Recency: RGW's last-modified times (write or touch), never this host's clock; the
        # objects touched now rank after every listed one.
        order = {key: mtime for key, (_, mtime) in listed.items()}
        touched = 0
        for key in read:
            if key in listed and self._touch(key):
                order[key] = math.inf
                touched += 1
        fill = sum(size for size, _ in listed.values())
        victims: list[str] = []
        if fill + demand > self.capacity_bytes:
            target = min(self.low_bytes, self.capacity_bytes - demand)
            for key in sorted(listed, key=order.__getitem__):
                if fill <= target:
                    break
                victims.append(key)
                fill -= listed[key][0]
            self.inner.delete_many(victims)
            if self.on_evict is not None:
                for key in victims:
                    self.on_evict(key)
        with self._lock:
            self._fill = fill
            self._completed -= completed_before
            self._listed = True
            self._evicted += len(victims)
            self._passes += 1
            self._last_pass_secs = time.monotonic() - started
        if victims:
            log.info(
                "kvtier: %s tier over its cap of %d bytes: evicted %d objects, %d bytes left, "
                "touched %d (pass took %.1f s)",
                self.name,
                self.capacity_bytes,
                len(victims),
                fill,
                touched,
                time.monotonic() - started,
            )

    def _touch(self, key: str) -> bool:
        """Touch one object read since the last pass; a failure (the object gone, RGW busy)
        only costs that object its recency, never the pass its eviction."""
        try:
            self.inner.touch(key)
        except TierError as exc:
            if exc.cause != "circuit_open":
                log.debug("kvtier: %s tier: touching %s failed (%s)", self.name, key, exc.cause)
            return False
        return True

    def _run(self) -> None:
        wait = 0.0  # the first pass at once: the fill is unknown until listed
        while not self._closing.is_set():
            self._wake.wait(wait)
            self._wake.clear()
            if self._closing.is_set():
                return
            with self._lock:
                self._in_pass = True
            try:
                self.run_pass()
            except TierError as exc:  # the breaker, open, has said so once already
                level = logging.DEBUG if exc.cause == "circuit_open" else logging.WARNING
                log.log(
                    level, "kvtier: %s tier cap pass failed (%s): %s", self.name, exc.cause, exc
                )
            except Exception:  # the thread must outlive any failure: it bounds the tier
                log.exception("kvtier: %s tier cap pass failed", self.name)
            with self._passed:  # a failed pass wakes the writers waiting for room too
                self._in_pass = False
                self._ended += 1
                self._passed.notify_all()
            wait = self.interval_secs * random.uniform(0.8, 1.2)

    # ------------------------------------------------------------------ stats
    def evictions(self) -> int:
        return self._evicted

    def usage(self) -> tuple[int, int] | None:
        with self._lock:
            return self._held(), self.capacity_bytes

    @property
    def passes(self) -> int:
        """Passes completed since start."""
        return self._passes

    def close(self) -> None:
        self._closing.set()
        self._wake.set()
        self._thread.join(timeout=10)
        self.inner.close()
