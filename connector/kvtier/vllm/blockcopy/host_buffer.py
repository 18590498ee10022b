"""A chunk payload in host memory: what the block copiers hand out and take back."""

from __future__ import annotations

import time
from collections.abc import Callable

from kvtier.vllm.layout import LayoutError


class SlotsBusy(LayoutError):
    """No pinned buffer came free within the time the caller would wait (a save is then
    dropped and counted: backpressure)."""


def slot_deadline(wait_secs: float | None) -> float | None:
    """When a wait for save slots of ``wait_secs`` (None: the pool's default) ends: one bound
    for all the chunks of a call (a bound per chunk let a step of 32 chunks wait 44 ms for
    slots freed one by one)."""
    return None if wait_secs is None else time.monotonic() + wait_secs


def seconds_left(deadline: float | None) -> float | None:
    """Seconds until ``deadline`` (`slot_deadline`), at least 0; None: no deadline."""
    return None if deadline is None else max(0.0, deadline - time.monotonic())


class HostBuffer:
    """A chunk payload in host memory, lent by a BlockCopier.

    `view()` is the payload (a writable memoryview of exactly `nbytes`); `release()` (or leaving
    a ``with`` block) gives the memory back, after which the view must not be used. On CUDA
    this is a slot of the copier's pinned buffer pool: `view()` first waits for a device copy
    still writing into it, and a released slot is reused only once the device is done with it.
    On CPU it is plain memory and release does nothing.
    """

    def __init__(self, data: memoryview, on_release: Callable[[], None] | None = None) -> None:
        self._data = data
        self._on_release = on_release
        self._released = False

    @property
    def nbytes(self) -> int:
        return self._data.nbytes

    def __len__(self) -> int:
        return self._data.nbytes

    def wait(self) -> None:
        """Block until no device copy is still writing into the buffer."""

    def view(self) -> memoryview:
        if self._released:
            raise LayoutError("HostBuffer used after release()")
        self.wait()
        return self._data

    def release(self) -> None:
        if self._released:
            return
        self._released = True
        if self._on_release is not None:
            self._on_release()

    def __enter__(self) -> HostBuffer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


Payload = bytes | memoryview | HostBuffer
