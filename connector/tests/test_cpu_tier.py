"""CPU tier: byte-capped LRU, and memory really stays within the cap."""

from __future__ import annotations

import gc

import pytest
from _helpers import rss_bytes

from kvtier.tiers.base import TierError
from kvtier.tiers.cpu import CpuTier


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
