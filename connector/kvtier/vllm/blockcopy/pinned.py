"""Pinned host memory for the CUDA copier: a pool of chunk-sized page-locked buffers, allocated
once and lent out as HostBuffers (kvtier.vllm.blockcopy.cuda; imported only on CUDA)."""

from __future__ import annotations

import contextlib
import ctypes
import logging
import mmap
import threading
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch

from kvtier.vllm.blockcopy.host_buffer import HostBuffer, SlotsBusy
from kvtier.vllm.layout import LayoutError

log = logging.getLogger(__name__)

#: How long an exhausted pool waits for a slot to come back before the copy fails (a miss).
POOL_WAIT_SECS = 30.0


def _clear_runtime_error() -> None:
    """Take back the error a failed CUDA runtime call left as this thread's last error: torch
    checks each kernel launch with cudaGetLastError, so the next unrelated launch would raise
    it as its own (vLLM PR #50070). torch binds no cudaGetLastError: it is called in the
    libcudart torch loaded (none found, e.g. a static build: nothing to do)."""
    try:
        with open("/proc/self/maps", encoding="ascii", errors="replace") as maps:
            path = next((ln.split()[-1] for ln in maps if "libcudart" in ln.split()[-1]), None)
        if path is not None:
            ctypes.CDLL(path).cudaGetLastError()
    except OSError as exc:
        log.debug("kvtier: cannot clear the CUDA runtime's last error: %s", exc)


def _pinned_host_memory(nbytes: int) -> tuple[Any, str, Any]:
    """A CPU uint8 tensor of exactly `nbytes` page-locked bytes: page-aligned anonymous memory
    registered with cudaHostRegister (torch's pinned allocator would round the size up to a
    power of two), or torch's pinned allocator where registering fails."""
    try:
        cudart = torch.cuda.cudart()
        mem = mmap.mmap(-1, nbytes)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            host = torch.frombuffer(mem, dtype=torch.uint8)
        err = cudart.cudaHostRegister(host.data_ptr(), nbytes, 0)
        if int(err) == 0:
            return host, "cudaHostRegister", mem
        _clear_runtime_error()
        log.debug("kvtier: cudaHostRegister failed (%s); using torch's pinned allocator", err)
    except (AttributeError, RuntimeError, OSError) as exc:
        log.debug("kvtier: cudaHostRegister unavailable (%s); using torch's pinned allocator", exc)
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True), "pin_memory", None


#: Host memory page-locked by `pin_host_region` (others' buffers, e.g. the CPU tier's slab):
#: (start, end) address ranges. A payload inside one goes to the device with no bounce.
_regions: list[tuple[int, int]] = []
_regions_lock = threading.Lock()


def pin_host_region(address: int, nbytes: int) -> Callable[[], None] | None:
    """Page-lock ``nbytes`` of host memory at ``address`` (`kvtier.tiers.cpu.PinHost`): the
    CPU tier's slab, so that loads from it need no bounce. Returns the function that unlocks
    it; None where the memory cannot be locked (a memlock limit), logged: the region stays
    pageable and loads from it bounce, as from any other tier."""
    err = torch.cuda.cudart().cudaHostRegister(address, nbytes, 0)
    if int(err) != 0:
        _clear_runtime_error()
        log.warning(
            "kvtier: cannot pin the CPU tier's %d bytes (cudaHostRegister: %s); loads from it "
            "go through a bounce buffer (raise the memlock limit: LimitMEMLOCK=infinity)",
            nbytes,
            err,
        )
        return None
    with _regions_lock:
        _regions.append((address, address + nbytes))

    def unpin() -> None:
        with _regions_lock:
            if (address, address + nbytes) not in _regions:
                return
            _regions.remove((address, address + nbytes))
        if int(torch.cuda.cudart().cudaHostUnregister(address)) != 0:
            _clear_runtime_error()

    return unpin


def in_pinned_region(address: int, nbytes: int) -> bool:
    """Whether ``nbytes`` at ``address`` lie inside memory `pin_host_region` locked."""
    with _regions_lock:
        return any(start <= address and address + nbytes <= end for start, end in _regions)


class PinnedPool:
    """`slots` pinned host buffers of `slot_bytes` each, in one allocation."""

    def __init__(self, slot_bytes: int, slots: int) -> None:
        if slots < 1 or slot_bytes < 1:
            raise LayoutError(f"a pinned pool needs slots >= 1 and bytes >= 1 ({slots=})")
        self.slot_bytes = slot_bytes
        self.slots = slots
        self.host, self.pinned_via, self._mem = _pinned_host_memory(slot_bytes * slots)
        self.base = int(self.host.data_ptr())
        self._tensors = [self.host[k * slot_bytes : (k + 1) * slot_bytes] for k in range(slots)]
        self._views = [memoryview(t.numpy()).cast("B") for t in self._tensors]
        self._free = list(range(slots))
        #: The event after the last device operation on each slot (in stream order, so it
        #: covers the earlier ones): the slot's own (`_own`, re-recorded by `record`), or one
        #: shared by several slots (`record_shared`); `_used`: recorded at least once.
        self._own = [torch.cuda.Event() for _ in range(slots)]
        self._events = list(self._own)
        self._used = [False] * slots
        self._cond = threading.Condition()
        self._closed = False

    def tensor(self, slot: int, nbytes: int, offset: int = 0) -> Any:
        return self._tensors[slot][offset : offset + nbytes]

    def view(self, slot: int, nbytes: int) -> memoryview:
        return self._views[slot][:nbytes]

    def acquire(self, timeout: float | None = None) -> int:
        timeout = POOL_WAIT_SECS if timeout is None else timeout
        with self._cond:
            if not self._cond.wait_for(lambda: bool(self._free), timeout):
                raise SlotsBusy(
                    f"all {self.slots} pinned buffers of {self.slot_bytes} bytes are in use "
                    f"after {timeout} s: release HostBuffers once done with them"
                )
            slot = self._free.pop(0)
        self.wait(slot)
        return slot

    def acquire_many(self, count: int) -> list[int]:
        """Up to `count` free slots at once, without waiting (lowest first, so that slots
        taken together tend to be adjacent: one device -> host copy for a run of them)."""
        with self._cond:
            if count >= len(self._free):
                taken, self._free = sorted(self._free), []
            else:
                self._free.sort()
                taken, self._free = self._free[:count], self._free[count:]
        seen: set[int] = set()
        for slot in taken:  # one wait per event (several slots may share one)
            ev = self._events[slot]
            if self._used[slot] and id(ev) not in seen:
                seen.add(id(ev))
                ev.synchronize()
        return taken

    def wait(self, slot: int) -> None:
        if self._used[slot]:
            self._events[slot].synchronize()

    def record(self, slot: int, stream: Any) -> None:
        """The device operation just queued on `stream` uses `slot`."""
        ev = self._own[slot]
        ev.record(stream)
        self._events[slot] = ev
        self._used[slot] = True

    def record_shared(self, slots: Sequence[int], event: Any) -> None:
        """`event`, already recorded, follows the last device operation on each of `slots`."""
        for slot in slots:
            self._events[slot] = event
            self._used[slot] = True

    def release(self, slot: int) -> None:
        with self._cond:
            self._free.append(slot)
            self._cond.notify()

    def slot_at(self, address: int, nbytes: int) -> tuple[int, int] | None:
        """(slot, offset) of a buffer lying inside one slot, else None."""
        offset = address - self.base
        if offset < 0 or offset + nbytes > self.slot_bytes * self.slots:
            return None
        slot, within = divmod(offset, self.slot_bytes)
        if within + nbytes > self.slot_bytes:
            return None
        return slot, within

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for slot in range(self.slots):
            self.wait(slot)
        if self.pinned_via == "cudaHostRegister":
            torch.cuda.cudart().cudaHostUnregister(self.base)

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # interpreter shutdown: nothing left to protect
            self.close()


class PinnedHostBuffer(HostBuffer):
    """One slot of a PinnedPool, lent until `release()`."""

    def __init__(self, pool: PinnedPool, slot: int, nbytes: int) -> None:
        self.pool = pool
        self.slot = slot
        self._tensor: Any = None
        super().__init__(pool.view(slot, nbytes), on_release=self._give_back)

    @property
    def tensor(self) -> Any:
        """The slot's bytes as a CPU uint8 tensor (made when first asked: a step's saves
        create many buffers and only a load from one needs it)."""
        if self._tensor is None:
            self._tensor = self.pool.tensor(self.slot, self.nbytes)
        return self._tensor

    def wait(self) -> None:
        self.pool.wait(self.slot)

    def _give_back(self) -> None:
        self.pool.release(self.slot)
