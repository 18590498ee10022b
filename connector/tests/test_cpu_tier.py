"""CPU tier: byte-capped LRU, memory really stays within the cap; the slab's leases."""

from __future__ import annotations

import gc
from collections.abc import Callable

import pytest
from _helpers import rss_bytes

from kvtier.tiers.base import TierError
from kvtier.tiers.cpu import CpuSlabTier, CpuTier


def test_lru_order_and_cap() -> None:
    tier = CpuTier(300)
    for k in "abc":
        tier.put(k, b"", b"x" * 100)
    assert tier.get("a") is not None  # a becomes most recent
    tier.put("d", b"", b"y" * 100)  # evicts b, the least recently used
    assert not tier.contains("b")
    assert all(tier.contains(k) for k in "acd")
    assert tier.used_bytes == 300 and tier.evictions() == 1
    tier.put("a", b"", b"z" * 50)  # replacing frees the old size
    assert tier.used_bytes == 250
    with pytest.raises(TierError) as err:
        tier.put("huge", b"", b"h" * 301)
    assert err.value.cause == "too_large"
    tier.delete("a")
    assert sorted(k for k, _ in tier.list_keys()) == ["c", "d"]


def test_memory_stays_within_cap_after_3x_inserts() -> None:
    cap = 64 << 20
    blob_size = 1 << 20
    gc.collect()
    before = rss_bytes()
    tier = CpuTier(cap)
    for i in range(3 * cap // blob_size):
        tier.put(f"k{i}", b"", bytes([i % 256]) * blob_size)
        assert tier.used_bytes <= cap
    gc.collect()
    growth = rss_bytes() - before
    assert tier.used_bytes == cap
    assert len(list(tier.list_keys())) == cap // blob_size
    # allocator slack: at most 2 blobs beyond the cap
    assert growth <= cap + 2 * blob_size, f"RSS grew {growth >> 20} MiB for a {cap >> 20} MiB cap"
    tier.close()


# ---------------------------------------------------------------------------- the slab
SLOT = 1000


def _slab(slots: int = 3, pin: object = None) -> CpuSlabTier:
    return CpuSlabTier(slots * SLOT, SLOT, pin)  # type: ignore[arg-type]


def test_slab_round_trip_lru_and_replace() -> None:
    tier = _slab(3)
    for i, k in enumerate("abc"):
        tier.put(k, b"h", bytes([i]) * 900)  # 901 bytes each: three fit
    got = tier.get("a")  # a becomes most recent
    assert got is not None and got[0] == b"h" and bytes(got[1]) == b"\x00" * 900
    del got
    tier.put("d", b"h", b"d" * 900)  # evicts b, the least recently used
    assert not tier.contains("b") and all(tier.contains(k) for k in "acd")
    assert tier.evictions() == 1 and tier.used_bytes == 3 * 901
    tier.put("a", b"h", b"z" * 10)  # a shorter payload in a slot of its own, the old one freed
    got = tier.get("a")
    assert got is not None and bytes(got[1]) == b"z" * 10
    assert tier.used_bytes == 2 * 901 + 11
    assert sorted(k for k, _ in tier.list_keys()) == ["a", "c", "d"]
    tier.delete("c")
    assert not tier.contains("c") and tier.used_bytes == 901 + 11


def test_slab_keeps_a_copy_of_a_lent_view() -> None:
    tier = _slab(2)
    lent = bytearray(b"x" * 900)
    tier.put("a", b"", memoryview(lent))  # type: ignore[arg-type]
    lent[:] = b"y" * 900  # the lender reuses its buffer
    got = tier.get("a")
    assert got is not None and bytes(got[1]) == b"x" * 900


def test_slab_slot_of_a_read_chunk_is_not_reused_until_the_reader_lets_go() -> None:
    tier = _slab(2)
    tier.put("a", b"", b"a" * 900)
    _, view = tier.get("a") or (b"", b"")
    part = memoryview(view)[100:200]  # anything made from the view holds the lease too
    del view
    tier.put("b", b"", b"b" * 900)
    tier.put("c", b"", b"c" * 900)  # evicts a, whose slot is still read, then b for a slot
    assert not tier.contains("a") and not tier.contains("b")
    assert bytes(part) == b"a" * 100  # never another chunk's bytes
    reading_c = tier.get("c")
    with pytest.raises(TierError) as err:  # no slot is free, and c's is read: c stays
        tier.put("d", b"", b"d" * 900)
    assert err.value.cause == "slots_leased" and tier.contains("c")
    assert reading_c is not None and bytes(reading_c[1]) == b"c" * 900
    del part  # the last reader of a's slot lets go: it is free again
    tier.put("d", b"", b"d" * 900)
    got = tier.get("d")
    assert got is not None and bytes(got[1]) == b"d" * 900


def test_slab_refuses_what_does_not_fit() -> None:
    tier = _slab(2)
    with pytest.raises(TierError) as err:
        tier.put("big", b"", b"x" * (SLOT + 1))
    assert err.value.cause == "too_large"
    with pytest.raises(ValueError, match="holds no chunk of 1000 bytes: raise max_local_cpu_size"):
        CpuSlabTier(999, SLOT)


def test_slab_pins_once_and_unpins_after_the_last_reader() -> None:
    calls: list[tuple[str, int, int]] = []

    def pin(address: int, nbytes: int) -> Callable[[], None]:
        calls.append(("pin", address, nbytes))
        return lambda: calls.append(("unpin", address, nbytes))

    tier = _slab(2, pin)
    assert calls == [("pin", calls[0][1], 2 * SLOT)]
    tier.put("a", b"", b"a" * 10)
    got = tier.get("a")
    tier.close()
    assert len(calls) == 1  # a reader may still be copying from the pinned memory
    del got
    assert calls[-1] == ("unpin", calls[0][1], 2 * SLOT)


def test_slab_memory_is_the_slab_whatever_is_put() -> None:
    cap = 64 << 20
    blob_size = 1 << 20
    gc.collect()
    before = rss_bytes()
    tier = CpuSlabTier(cap, blob_size)
    for i in range(3 * cap // blob_size):
        tier.put(f"k{i}", b"", bytes([i % 256]) * blob_size)
    gc.collect()
    growth = rss_bytes() - before
    assert tier.used_bytes == cap and len(list(tier.list_keys())) == cap // blob_size
    got = tier.get(f"k{3 * cap // blob_size - 1}")
    assert got is not None and bytes(got[1][:4]) == bytes([(3 * cap // blob_size - 1) % 256]) * 4
    assert growth <= cap + 2 * blob_size, f"RSS grew {growth >> 20} MiB for a {cap >> 20} MiB slab"
    del got
    tier.close()


def test_slab_makes_a_slot_by_evicting_what_nobody_reads() -> None:
    """With the oldest chunks being read, a put evicts the oldest one nobody reads, never the
    read ones (evicting them frees no slot; it would only empty the tier)."""
    tier = _slab(3)
    for k in "abc":
        tier.put(k, b"", k.encode() * 300)  # 900 bytes of 3000: the slots, not the bytes, run out
    reading = [tier.get("a"), tier.get("b")]
    tier.get("c")  # c is the most recent, and nobody holds it
    tier.put("d", b"", b"d" * 300)
    assert [tier.contains(k) for k in "abcd"] == [True, True, False, True]
    assert all(r is not None for r in reading)
