"""A circuit breaker around a remote tier: a tier that keeps failing is not asked again until a
background probe says it answers.

A hung or partitioned endpoint (a black hole: the connection is accepted, no answer ever comes)
costs every call its full timeout, and the calls pile up behind each other. After
``threshold`` consecutive failures of availability (timeouts, refused connections, 5xx, refused
credentials: not an absent object, not a corrupt one) the breaker *opens*: every call fails at
once with cause ``circuit_open`` (the store counts it, the request is served without the tier).
A background thread then probes the tier (``Tier.probe``) after ``retry_secs``, doubling the
wait up to ``max_retry_secs`` while it keeps failing; the first probe that succeeds *closes* the
breaker and calls go through again, with no restart. Each change of state is logged once.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import TypeVar

from kvtier.tiers.base import Stored, Tier, TierError

log = logging.getLogger(__name__)
T = TypeVar("T")

CLOSED, OPEN = "closed", "open"

#: Failure causes that say nothing about the tier's availability: the call reached it.
_DATA_CAUSES = frozenset(
    {
        "checksum",
        "truncated",
        "bad_magic",
        "version",
        "layout_mismatch",
        "key_mismatch",
        "bad_key",
        # an object deleted meanwhile (another writer's eviction), as boto3 and awscrt say it
        "404",
        "http_404",
        "NoSuchKey",
        # the bucket's quota refused a write: reads go on (rgw_bucket_quota_max_size_gb)
        "QuotaExceeded",
    }
)


class CircuitBreaker:
    """Thread-safe state of one tier: closed (calls go through) or open (calls fail at once)."""

    def __init__(
        self,
        name: str,
        probe: Callable[[], None],
        *,
        threshold: int = 3,
        retry_secs: float = 2.0,
        max_retry_secs: float = 60.0,
    ) -> None:
        self.name = name
        self._probe = probe
        self.threshold = threshold
        self.retry_secs = retry_secs
        self.max_retry_secs = max_retry_secs
        self._state = CLOSED
        self._failures = 0
        self._cause = ""
        self._wait = retry_secs
        self._opened = 0
        self._closed = 0
        self._cond = threading.Condition()
        self._closing = False
        self._thread: threading.Thread | None = None

    @property
    def state(self) -> str:
        return self._state

    @property
    def opened(self) -> int:
        """Times the breaker opened since start."""
        return self._opened

    @property
    def closed(self) -> int:
        """Times a probe closed it again since start."""
        return self._closed

    def allows(self) -> bool:
        return self._state == CLOSED

    def success(self) -> None:
        with self._cond:
            self._failures = 0

    def failure(self, cause: str) -> None:
        """A call failed with ``cause``; the threshold-th consecutive one opens the breaker."""
        if cause in _DATA_CAUSES:
            return
        with self._cond:
            self._failures += 1
            if self._state == CLOSED and self._failures >= self.threshold:
                self._open_locked(cause, f"{self._failures} calls in a row failed")

    def trip(self, cause: str, why: str) -> None:
        """Open now (e.g. the tier failed its check at start)."""
        with self._cond:
            if self._state == CLOSED:
                self._open_locked(cause, why)

    def _open_locked(self, cause: str, why: str) -> None:
        self._state, self._cause, self._wait = OPEN, cause, self.retry_secs
        self._opened += 1
        log.warning(
            "kvtier: %s tier unavailable (%s: %s): served without it; probing it again in %.0f s",
            self.name,
            cause,
            why,
            self._wait,
        )
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._probe_loop, name=f"kvtier-{self.name}-probe", daemon=True
            )
            self._thread.start()
        self._cond.notify_all()

    def _probe_loop(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._state == OPEN or self._closing)
                if self._closing:
                    return
                wait = self._wait
                if self._cond.wait_for(lambda: self._closing, timeout=wait):
                    return
            start = time.monotonic()
            try:
                self._probe()
            except TierError as exc:
                self._probe_failed(exc.cause)
                continue
            except Exception as exc:  # a probe must never end the thread
                self._probe_failed(type(exc).__name__)
                continue
            with self._cond:
                self._state, self._failures = CLOSED, 0
                self._closed += 1
            log.warning(
                "kvtier: %s tier answers again (probe took %.0f ms): using it again",
                self.name,
                1000 * (time.monotonic() - start),
            )

    def _probe_failed(self, cause: str) -> None:
        with self._cond:
            self._cause = cause
            self._wait = min(self.max_retry_secs, 2 * self._wait)
        log.debug("kvtier: %s tier probe failed (%s); next in %.0f s", self.name, cause, self._wait)

    def close(self) -> None:
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=5)


class GuardedTier(Tier):
    """``inner`` behind a :class:`CircuitBreaker`: same interface, fails fast while open."""

    def __init__(self, inner: Tier, breaker: CircuitBreaker) -> None:
        self.inner = inner
        self.name = inner.name
        self.remote = inner.remote
        self.breaker = breaker

    def _call(self, fn: Callable[[], T]) -> T:
        if not self.breaker.allows():
            raise TierError("circuit_open", f"the {self.name} tier is unavailable (circuit open)")
        try:
            result = fn()
        except TierError as exc:
            self.breaker.failure(exc.cause)
            raise
        self.breaker.success()
        return result

    def contains(self, key: str) -> bool:
        return self._call(lambda: self.inner.contains(key))

    def contains_many(self, keys: Sequence[str]) -> list[bool]:
        return self._call(lambda: self.inner.contains_many(keys))

    def heads(self, keys: Sequence[str]) -> list[list[str] | None]:
        return self._call(lambda: self.inner.heads(keys))

    def get(self, key: str) -> Stored | None:
        return self._call(lambda: self.inner.get(key))

    def put(self, key: str, header: bytes, payload: bytes) -> None:
        self._call(lambda: self.inner.put(key, header, payload))

    def put_object(self, key: str, parts: Sequence[bytes], chunk_list: str) -> None:
        self._call(lambda: self.inner.put_object(key, parts, chunk_list))

    def delete(self, key: str) -> None:
        self._call(lambda: self.inner.delete(key))

    def list_keys(self, prefix: str = "") -> Iterator[tuple[str, int]]:
        return self.inner.list_keys(prefix)

    def list_objects(self, prefix: str = "") -> Iterator[tuple[str, int, float]]:
        # Listed whole inside the call: a failure midway counts against the breaker.
        return iter(self._call(lambda: list(self.inner.list_objects(prefix))))

    def touch(self, key: str) -> None:
        self._call(lambda: self.inner.touch(key))

    def delete_many(self, keys: Sequence[str]) -> int:
        return self._call(lambda: self.inner.delete_many(keys))

    def probe(self) -> None:
        self.inner.probe()

    def evictions(self) -> int:
        return self.inner.evictions()

    def usage(self) -> tuple[int, int] | None:
        return self.inner.usage()

    def close(self) -> None:
        self.breaker.close()
        self.inner.close()
