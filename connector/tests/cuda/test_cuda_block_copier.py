"""The connector's CUDA data path: BlockCopier on CUDA tensors laid out as vLLM 0.32 gives them
to connectors (``[blocks, kv_heads, block_size, 2 * head_size]`` per layer, bf16).

Needs a CUDA GPU and torch, so CI (CPU only) skips it; it runs on the device machine:
``PYTHONPATH=connector python3 connector/tests/cuda/test_cuda_block_copier.py``. vLLM's CUDA
build itself is not there, so this covers the copies, not the scheduler wiring.
"""

from __future__ import annotations

import sys
import time

import pytest

torch = pytest.importorskip("torch")

from kvtier.vllm.layout import BlockCopier, KVLayout  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

LAYERS, HEADS, BLOCK, HEAD = 4, 8, 16, 128
NUM_BLOCKS = 256


def _layout() -> KVLayout:
    return KVLayout(
        backend="FLASH_ATTN",
        variant="NHD",
        device="cuda",
        dtype="bfloat16",
        itemsize=2,
        layer_names=tuple(f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)),
        num_kv_heads=HEADS,
        head_size=HEAD,
        block_size=BLOCK,
        block_shape=(HEADS, BLOCK, 2 * HEAD),
    )


def _caches(fill: bool) -> list[object]:
    shape = (NUM_BLOCKS, HEADS, BLOCK, 2 * HEAD)
    make = torch.randn if fill else torch.zeros
    return [make(shape, dtype=torch.bfloat16, device="cuda") for _ in range(LAYERS)]


def test_gather_then_scatter_reproduces_the_blocks_elsewhere() -> None:
    src, dst = _caches(True), _caches(False)
    blocks = [5, 77, 3, 200, 42, 9, 128, 255]  # one 128-token chunk, scattered in the pool
    payload = BlockCopier(_layout(), src).gather(blocks)
    assert len(payload) == _layout().payload_nbytes(len(blocks))
    target = [10, 11, 12, 13, 14, 15, 16, 17]
    BlockCopier(_layout(), dst).scatter(payload, len(blocks), 0, target)
    torch.cuda.synchronize()
    for s, d in zip(src, dst, strict=True):
        assert torch.equal(s[blocks], d[target])
        untouched = [b for b in range(NUM_BLOCKS) if b not in target]
        assert not d[untouched].any()


def test_scatter_of_a_partial_range_writes_only_those_blocks() -> None:
    src, dst = _caches(True), _caches(False)
    payload = BlockCopier(_layout(), src).gather([1, 2, 3, 4])
    BlockCopier(_layout(), dst).scatter(payload, 4, 2, [50, 51])  # blocks 3 and 4 of the chunk
    torch.cuda.synchronize()
    for s, d in zip(src, dst, strict=True):
        assert torch.equal(s[[3, 4]], d[[50, 51]])
        assert not d[[49, 52]].any()


def copy_rates() -> dict[str, float]:
    """GB/s of gather (device -> host bytes) and scatter (bytes -> device), 16 blocks x 4 layers."""
    src, dst = _caches(True), _caches(False)
    blocks = list(range(0, 32, 2))
    src_copier, dst_copier = BlockCopier(_layout(), src), BlockCopier(_layout(), dst)
    payload = src_copier.gather(blocks)
    out: dict[str, float] = {}
    for name, fn in (
        ("gather", lambda: src_copier.gather(blocks)),
        ("scatter", lambda: dst_copier.scatter(payload, len(blocks), 0, blocks)),
    ):
        fn()
        torch.cuda.synchronize()
        reps = 50
        start = time.perf_counter()
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
        out[name] = reps * len(payload) / (time.perf_counter() - start) / 1e9
    out["chunk_mib"] = len(payload) / 2**20
    return out


if __name__ == "__main__":
    test_gather_then_scatter_reproduces_the_blocks_elsewhere()
    test_scatter_of_a_partial_range_writes_only_those_blocks()
    print("cuda block copier: 2 tests passed on", torch.cuda.get_device_name(0))
    print("copy rates:", {k: round(v, 2) for k, v in copy_rates().items()})
    sys.exit(0)
