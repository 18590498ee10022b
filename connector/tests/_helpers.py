"""Helpers shared by kvtier's store tests (no fixtures from conftest.py are redefined here)."""

from __future__ import annotations

import os

from kvtier.keys import LayoutFingerprint, chunk_hashes

FINGERPRINT = LayoutFingerprint(
    "tiny@0123456789abcdef", "bfloat16", 2, 2, 64, 16, 256, 0, 1, "cpu:vec16"
).digest()


def chunks(n: int, size: int = 64 * 1024, seed: int = 0) -> list[tuple[str, bytes]]:
    """``n`` (hash, payload) pairs of a made-up prompt; payloads are random bytes."""
    hashes = chunk_hashes([seed * 1_000_003 + i for i in range(n * 256)], 256)
    return [(h, os.urandom(size)) for h in hashes]


def rss_bytes() -> int:
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")
