"""Bounded background writes: the slower tiers (disk, S3) are written in threads, and what waits
for them is capped in count and bytes.

A write beyond ``max_inflight`` writes or ``max_backlog_bytes`` bytes in flight is refused
(``submit`` answers False: the store counts it as dropped) rather than queued without limit
behind a slow bucket; a cache write can always be skipped, a full memory cannot be undone.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial


class BackgroundWriter:
    """Runs writes in ``threads`` threads, at most ``max_inflight`` / ``max_backlog_bytes``."""

    def __init__(self, threads: int, max_inflight: int, max_backlog_bytes: int) -> None:
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="kvtier-write")
        self._max_inflight = max_inflight
        self._max_backlog = max_backlog_bytes
        self._inflight = 0
        self._backlog = 0
        self._closed = False
        self._idle = threading.Condition()

    def submit(self, size: int, write: Callable[[], None]) -> bool:
        """Run ``write`` (of ``size`` bytes) in the background; False when it would go over the
        caps, or after close (the write is not run)."""
        with self._idle:
            full = self._inflight >= self._max_inflight or self._backlog + size > self._max_backlog
            if self._closed or full:
                return False
            self._inflight += 1
            self._backlog += size
        try:
            fut: Future[None] = self._pool.submit(write)
        except RuntimeError:  # shut down between the check and the submit
            self._done(size, None)
            return False
        fut.add_done_callback(partial(self._done, size))
        return True

    def _done(self, size: int, _fut: Future[None] | None) -> None:
        with self._idle:
            self._inflight -= 1
            self._backlog -= size
            if self._inflight == 0:
                self._idle.notify_all()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until the writes in flight are done; ``False`` if ``timeout`` passed first."""
        with self._idle:
            return self._idle.wait_for(lambda: self._inflight == 0, timeout)

    def close(self) -> None:
        """Refuse new writes, drop those not started, wait for the running ones."""
        with self._idle:
            self._closed = True
        self._pool.shutdown(wait=True, cancel_futures=True)
