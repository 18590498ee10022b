"""Host memory rates on a GPU host: where a CPU tier's copy of a save slot can go (by hand):

    PYTHONPATH=connector python3 connector/tests/cuda/bench_host_copy.py [--out F.json]

In 1, 2 and 4 threads, for a 7B model's chunk (14.7 MB): copies into fresh ``bytes`` (what the
CPU tier keeps, `kvtier.hostmem.owned_copy`; new pages each time, as a tier that fills), into
slots of a buffer faulted in once and reused, and xxh3 (the store's checksum); then the CPU
tiers themselves, `put` of lent views into a tier of 32 chunks that evicts: ``CpuTier`` (a
``bytes`` per chunk) and ``CpuSlabTier`` (the connector's slab, unpinned here). No GPU needed.
"""

from __future__ import annotations

import argparse
import collections
import ctypes
import json
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

import xxhash

from kvtier.hostmem import owned_copy
from kvtier.tiers.cpu import CpuSlabTier, CpuTier

CHUNK = 14_680_064  # 28 layers x 4 KV heads x 128 x 2 (K, V) x 2 bytes x 256 tokens
SLOTS = 8


def _rate(fn: Callable[[int], None], threads: int, reps: int) -> float:
    def work(i: int) -> None:
        for _ in range(reps):
            fn(i)

    pool = [threading.Thread(target=work, args=(i,)) for i in range(threads)]
    t0 = time.perf_counter()
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    return threads * reps * CHUNK / (time.perf_counter() - t0) / 1e9


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    sources = [bytearray(os.urandom(CHUNK)) for _ in range(4)]
    arena = bytearray(4 * SLOTS * CHUNK)  # zero-filled: faulted in once, then reused
    base = ctypes.addressof((ctypes.c_char * len(arena)).from_buffer(arena))
    src_arrays = [(ctypes.c_char * CHUNK).from_buffer(s) for s in sources]
    next_slot = [0] * 4
    kept = [collections.deque[bytes](maxlen=40) for _ in range(4)]  # a tier that evicts

    def fresh(i: int) -> None:
        kept[i].append(owned_copy(memoryview(sources[i])))

    def reused(i: int) -> None:
        next_slot[i] = (next_slot[i] + 1) % SLOTS
        ctypes.memmove(base + (i * SLOTS + next_slot[i]) * CHUNK, src_arrays[i], CHUNK)

    def hashed(i: int) -> None:
        xxhash.xxh3_64_intdigest(sources[i])

    tiers = {"bytes": CpuTier(32 * CHUNK), "slab": CpuSlabTier(32 * CHUNK, CHUNK)}
    puts = [0] * 4

    def put_into(kind: str) -> Callable[[int], None]:
        def put(i: int) -> None:
            puts[i] += 1
            tiers[kind].put(f"{i}-{puts[i]}", b"", memoryview(sources[i]))  # type: ignore[arg-type]

        return put

    result: dict[str, dict[str, float]] = {}
    for name, fn in [
        ("fresh bytes", fresh),
        ("reused slots", reused),
        ("xxh3", hashed),
        ("CpuTier.put", put_into("bytes")),
        ("CpuSlabTier.put", put_into("slab")),
    ]:
        _rate(fn, 1, 40)  # warm-up: the slab's pages are faulted in on first use, once
        result[name] = {f"{t} threads": _rate(fn, t, 40 if t == 1 else 20) for t in (1, 2, 4)}
        print(f"{name:16s}", " | ".join(f"{k} {v:.1f} GB/s" for k, v in result[name].items()))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
