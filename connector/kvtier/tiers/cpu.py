"""CPU tier: a byte-capped LRU of chunks in process memory.

Two kinds of memory. `CpuTier` holds each chunk as a ``bytes`` object (the one it is given; a
view is copied). `CpuSlabTier` (the connector's, where every chunk of a layout has one size)
holds them in a slab: one anonymous mapping of chunk-sized slots, each chunk copied into a free
slot. Why a slab: a fresh ``bytes`` per chunk gets fresh pages from the kernel, and the page
faults bound the copy (1.6 GB/s in one thread, 5.0 in four, on an H100 host) where memory that is
reused copies at 5.1 and 17.6; and a slab can be pinned once (``pin``), so that a load from it
goes to the GPU with no bounce through another buffer.
"""

from __future__ import annotations

import ctypes
import mmap
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Any

from kvtier.hostmem import copy_into, owned_copy
from kvtier.tiers.base import Stored, Tier, TierError

#: ``pin(address, nbytes)`` page-locks host memory for device copies and returns the function
#: that unlocks it, or None where it could not (kvtier.vllm.blockcopy.pinned.pin_host_region).
PinHost = Callable[[int, int], Callable[[], None] | None]


class CpuTier(Tier):
    """Holds at most ``capacity_bytes`` of chunks; the least recently used go first."""

    name = "cpu"

    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self._items: OrderedDict[str, Stored] = OrderedDict()
        self._used = 0
        self._evictions = 0
        self._lock = threading.RLock()

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
        size = self._check_size(header, payload)
        payload = owned_copy(payload)  # the tier keeps it: a lent view is copied, out of the lock
        with self._lock:
            evicted = self._make_room_locked(key, size)
            self._items[key] = (header, payload)
            self._used += size
        self._report(evicted)

    def _check_size(self, header: bytes, payload: bytes) -> int:
        size = len(header) + len(payload)
        if size > self.capacity_bytes:
            raise TierError("too_large", f"{size} bytes exceed the CPU tier cap")
        return size

    def _make_room_locked(self, key: str, size: int) -> list[str]:
        """Forget ``key`` and evict the least recently used until ``size`` more bytes fit."""
        self._forget_locked(key)
        evicted: list[str] = []
        while self._used + size > self.capacity_bytes and self._items:
            evicted.append(self._evict_oldest_locked())
        return evicted

    def _evict_oldest_locked(self) -> str:
        old, (header, payload) = self._items.popitem(last=False)
        self._used -= len(header) + len(payload)
        self._evictions += 1
        return old

    def _report(self, evicted: list[str]) -> None:
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


class CpuSlabTier(CpuTier):
    """A CPU tier whose chunks live in ``capacity_bytes // slot_bytes`` slots of one mapping.

    ``get`` returns a view of the chunk's slot, leased: the slot is not reused until every view
    of it, and everything made from one (a tensor over it), is gone, even if the chunk was
    evicted or replaced meanwhile. So a reader never sees another chunk's bytes, and needs
    nothing but to drop its reference (CPython frees it at once). ``pin``: page-lock the slab
    at start (CUDA: loads from it need no bounce; the memory is then taken at once).
    """

    def __init__(self, capacity_bytes: int, slot_bytes: int, pin: PinHost | None = None) -> None:
        slots = capacity_bytes // slot_bytes if slot_bytes > 0 else 0
        if slots < 1:
            raise ValueError(
                f"the CPU tier of {capacity_bytes} bytes holds no chunk of {slot_bytes} bytes: "
                "raise max_local_cpu_size or set local_cpu: false"
            )
        super().__init__(capacity_bytes)
        self.slot_bytes = slot_bytes
        self.slots = slots
        self._slab = mmap.mmap(-1, slots * slot_bytes, flags=mmap.MAP_PRIVATE)
        #: One export of the whole slab for its address (ctypes keeps it alive).
        self._whole = (ctypes.c_char * (slots * slot_bytes)).from_buffer(self._slab)
        self._base = ctypes.addressof(self._whole)
        self._slot_type: Any = ctypes.c_char * slot_bytes
        self._index: OrderedDict[str, tuple[bytes, int, int]] = OrderedDict()
        self._free = list(range(slots - 1, -1, -1))  # pop() takes the lowest first
        self._leases = [0] * slots
        self._evicted_leased: set[int] = set()
        self._closed = False
        self._unpin = pin(self._base, slots * slot_bytes) if pin is not None else None

    @property
    def pinned(self) -> bool:
        """Page-locked for device copies (a load from it needs no bounce)."""
        return self._unpin is not None

    def contains(self, key: str) -> bool:
        with self._lock:
            return key in self._index

    def get(self, key: str) -> Stored | None:
        with self._lock:
            entry = self._index.get(key)
            if entry is None:
                return None
            self._index.move_to_end(key)
            header, slot, nbytes = entry
            self._leases[slot] += 1
        try:
            lease = self._slot_type.from_buffer(self._slab, slot * self.slot_bytes)
            # Not at interpreter exit: a device copy may still read the slot then.
            weakref.finalize(lease, self._unlease, slot).atexit = False
        except BaseException:
            self._unlease(slot)
            raise
        # Typed as the bytes it stands for: readers only read it (verify, a copy to the GPU).
        payload: bytes = memoryview(lease).cast("B")[:nbytes]  # type: ignore[assignment]
        return header, payload

    def _unlease(self, slot: int) -> None:
        # May run in any thread, whenever the last view goes (the lock is re-entrant: a
        # garbage collection inside a locked section can end one).
        with self._lock:
            self._leases[slot] -= 1
            if self._leases[slot] == 0 and slot in self._evicted_leased:
                self._evicted_leased.discard(slot)
                self._free.append(slot)
            unpin = self._unpin if self._closed and not any(self._leases) else None
            if unpin is not None:
                self._unpin = None
        if unpin is not None:
            unpin()  # closed while read: unpinned once the last reader is done

    def put(self, key: str, header: bytes, payload: bytes) -> None:
        size = self._check_size(header, payload)
        nbytes = memoryview(payload).nbytes  # what copy_into copies, whatever the item size
        if nbytes > self.slot_bytes:
            raise TierError("too_large", f"{nbytes} bytes exceed the slot of {self.slot_bytes}")
        with self._lock:
            evicted = self._make_room_locked(key, size)
            # In no index yet: nobody reads it while it is filled.
            slot = self._free.pop() if self._free else None
        if slot is None:
            self._report(evicted)
            raise TierError("slots_leased", "every slot of the CPU tier is being read")
        try:
            copy_into(self._base + slot * self.slot_bytes, payload)
        except BaseException:
            with self._lock:
                self._free.append(slot)
            self._report(evicted)
            raise
        with self._lock:
            evicted += self._make_room_locked(key, size, slot_held=True)
            self._index[key] = (header, slot, nbytes)
            self._used += size
        self._report(evicted)

    def _make_room_locked(self, key: str, size: int, slot_held: bool = False) -> list[str]:
        """Forget ``key``; evict the least recently used until ``size`` more bytes fit, then,
        unless the caller holds a slot, the least recently used chunk nobody reads until a
        slot is free (evicting a chunk being read frees no slot: it would only empty the
        tier)."""
        self._forget_locked(key)
        evicted: list[str] = []
        while self._index and self._used + size > self.capacity_bytes:
            evicted.append(self._evict_locked(next(iter(self._index))))
        while not (slot_held or self._free):
            unread = next((k for k, e in self._index.items() if not self._leases[e[1]]), None)
            if unread is None:
                break
            evicted.append(self._evict_locked(unread))
        return evicted

    def _evict_locked(self, key: str) -> str:
        self._release_locked(self._index.pop(key))
        self._evictions += 1
        return key

    def _release_locked(self, entry: tuple[bytes, int, int]) -> None:
        header, slot, nbytes = entry
        self._used -= len(header) + nbytes
        # Marked first, then freed by whoever takes it out of the set: here if nobody reads
        # it, else the last lease (`_unlease`), even one that ends in between.
        self._evicted_leased.add(slot)
        if self._leases[slot] == 0 and slot in self._evicted_leased:
            self._evicted_leased.discard(slot)
            self._free.append(slot)

    def _forget_locked(self, key: str) -> None:
        entry = self._index.pop(key, None)
        if entry is not None:
            self._release_locked(entry)

    def list_keys(self, prefix: str = "") -> Iterator[tuple[str, int]]:
        with self._lock:
            snapshot = [
                (k, len(h) + n) for k, (h, _, n) in self._index.items() if k.startswith(prefix)
            ]
        return iter(snapshot)

    def close(self) -> None:
        with self._lock:
            for key in list(self._index):
                self._forget_locked(key)
            self._closed = True
            # A slot still leased stays pinned: its reader may be copying from it.
            unpin = self._unpin if not any(self._leases) else None
            if unpin is not None:
                self._unpin = None
        if unpin is not None:
            unpin()
