"""Warnings that a failing dependency cannot turn into a flood: one per kind every few seconds,
carrying how many like it were held back since."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Hashable

#: Seconds between two warnings of one kind.
EVERY = 10.0


class RateLimitedLog:
    def __init__(self, logger: logging.Logger, every: float = EVERY) -> None:
        self._log = logger
        self._every = every
        self._lock = threading.Lock()
        self._last: dict[Hashable, tuple[float, int]] = {}

    def warning(self, kind: Hashable, message: str, *, exc_info: bool = False) -> None:
        """Log ``message`` unless one of the same ``kind`` was logged less than ``every`` s ago
        (then it is only counted, and the next one logged says how many were held back)."""
        now = time.monotonic()
        with self._lock:
            last, held = self._last.get(kind, (-self._every, 0))
            if now - last < self._every:
                self._last[kind] = (last, held + 1)
                return
            self._last[kind] = (now, 0)
        more = f" ({held} more like it in the last {now - last:.0f} s)" if held else ""
        self._log.warning("kvtier: %s%s", message, more, exc_info=exc_info)
