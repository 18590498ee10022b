"""owned_copy and copy_into: the CPU tier's copy of a lent buffer (kvtier.hostmem)."""

from __future__ import annotations

import ctypes
import os

import pytest
from _helpers import rss_bytes

from kvtier import hostmem
from kvtier.hostmem import GIL_FREE_MIN_BYTES, owned_copy


def test_a_large_writable_buffer_is_copied_into_memory_it_does_not_share() -> None:
    data = os.urandom(3 * GIL_FREE_MIN_BYTES + 5)
    slot = bytearray(data)
    copy = owned_copy(memoryview(slot))
    slot[:] = bytes(len(slot))  # the lender reuses its buffer
    assert type(copy) is bytes and copy == data  # the CPU tier's copy stays as saved


def test_a_view_of_another_format_is_copied_as_its_bytes() -> None:
    words = memoryview(bytearray(os.urandom(GIL_FREE_MIN_BYTES))).cast("I")
    assert owned_copy(words) == words.tobytes()


def test_small_and_read_only_buffers_are_copied_too_and_bytes_are_kept() -> None:
    small = bytearray(b"kv" * 10)
    assert type(owned_copy(memoryview(small))) is bytes
    assert owned_copy(memoryview(small)) == bytes(small)
    big = os.urandom(GIL_FREE_MIN_BYTES)
    assert owned_copy(big) is big  # immutable: nothing to copy
    read_only = memoryview(bytearray(big)).toreadonly()
    assert type(owned_copy(read_only)) is bytes and owned_copy(read_only) == big


def test_copies_are_freed_once_dropped() -> None:
    """The bytes come from the C API through ctypes: no reference may leak (400 MB of copies
    made and dropped one by one leave the process about as large as before)."""
    source = memoryview(bytearray(os.urandom(4 << 20)))
    owned_copy(source)  # the allocator's first large block
    before = rss_bytes()
    for _ in range(100):
        owned_copy(source)
    assert rss_bytes() - before < 64 << 20


@pytest.mark.parametrize("size", [(32 << 20) + 3, 48 << 20])
def test_a_large_copy_in_parts_lands_whole(monkeypatch: pytest.MonkeyPatch, size: int) -> None:
    """On a host with cores to spare a large copy goes in parts side by side (here forced):
    every byte lands, from bytes and from a view, whatever the remainder."""
    monkeypatch.setattr(hostmem, "_COPY_THREADS", 4)
    data = os.urandom(size)
    for source in (data, memoryview(bytearray(data))):
        target = bytearray(size)
        hostmem.copy_into(ctypes.addressof((ctypes.c_char * size).from_buffer(target)), source)
        assert target == data
