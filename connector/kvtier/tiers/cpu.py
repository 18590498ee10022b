"""CPU tier: a byte-capped LRU of chunks in process memory (references, no copies)."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterator

from kvtier.tiers.base import Stored, Tier, TierError


class CpuTier(Tier):
    """Holds at most ``capacity_bytes`` of chunks; the least recently used go first."""

    name = "cpu"

    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self._items: OrderedDict[str, Stored] = OrderedDict()
        self._used = 0
        self._evictions = 0
        self._lock = threading.Lock()

    @property
    def used_bytes(self) -> int:
        return self._used

    def contains(self, key: str) -> bool:
        with self._lock:
            return key in self._items

    def get(self, key: str) -> Stored | None:
        with self._lock:
            item = self._items.get(key)
            if item is not None:
                self._items.move_to_end(key)
            return item

    def put(self, key: str, header: bytes, payload: bytes) -> None:
        size = len(header) + len(payload)
        if size > self.capacity_bytes:
            raise TierError("too_large", f"{size} bytes exceed the CPU tier cap")
        evicted: list[str] = []
        with self._lock:
            self._forget_locked(key)
            while self._used + size > self.capacity_bytes and self._items:
                old, (h, p) = self._items.popitem(last=False)
                self._used -= len(h) + len(p)
                self._evictions += 1
                evicted.append(old)
            self._items[key] = (header, payload)
            self._used += size
        if self.on_evict is not None:
            for old in evicted:
                self.on_evict(old)

    def _forget_locked(self, key: str) -> None:
        old = self._items.pop(key, None)
        if old is not None:
            self._used -= len(old[0]) + len(old[1])

    def delete(self, key: str) -> None:
        with self._lock:
            self._forget_locked(key)

    def list_keys(self, prefix: str = "") -> Iterator[tuple[str, int]]:
        with self._lock:
            snapshot = [
                (k, len(h) + len(p)) for k, (h, p) in self._items.items() if k.startswith(prefix)
            ]
        return iter(snapshot)

    def evictions(self) -> int:
        return self._evictions

    def usage(self) -> tuple[int, int]:
        return self._used, self.capacity_bytes

    def close(self) -> None:
        with self._lock:
            self._items.clear()
            self._used = 0
