"""CPU tier: a byte-capped LRU of blobs in process memory."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterator

from kvtier.tiers.base import Tier, TierError


class CpuTier(Tier):
    """Holds at most ``capacity_bytes`` of blobs; the least recently used go first."""

    name = "cpu"

    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self._items: OrderedDict[str, bytes] = OrderedDict()
        self._used = 0
        self._evictions = 0
        self._lock = threading.Lock()

    @property
    def used_bytes(self) -> int:
        return self._used

    def contains(self, key: str) -> bool:
        with self._lock:
            return key in self._items

    def get(self, key: str) -> bytes | None:
        with self._lock:
            blob = self._items.get(key)
            if blob is not None:
                self._items.move_to_end(key)
            return blob

    def put(self, key: str, blob: bytes) -> None:
        size = len(blob)
        if size > self.capacity_bytes:
            raise TierError("too_large", f"{size} bytes exceed the CPU tier cap")
        with self._lock:
            old = self._items.pop(key, None)
            if old is not None:
                self._used -= len(old)
            while self._used + size > self.capacity_bytes and self._items:
                _, evicted = self._items.popitem(last=False)
                self._used -= len(evicted)
                self._evictions += 1
            self._items[key] = blob
            self._used += size

    def delete(self, key: str) -> None:
        with self._lock:
            old = self._items.pop(key, None)
            if old is not None:
                self._used -= len(old)

    def list_keys(self, prefix: str = "") -> Iterator[tuple[str, int]]:
        with self._lock:
            snapshot = [(k, len(v)) for k, v in self._items.items() if k.startswith(prefix)]
        return iter(snapshot)

    def evictions(self) -> int:
        return self._evictions

    def close(self) -> None:
        with self._lock:
            self._items.clear()
            self._used = 0
