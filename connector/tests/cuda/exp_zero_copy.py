"""Experiment (by hand, H200): the Triton kernel reading/writing the pinned host slot directly
(zero-copy over PCIe) instead of device staging + one DMA, for one chunk at a time.

    PYTHONPATH=connector:connector/tests/cuda python connector/tests/cuda/exp_zero_copy.py
"""

from __future__ import annotations

import random
import statistics
import time
from typing import Any

import torch
import vllm032_kv as vk
from bench_gpu_copy import BLOCK, NUM_BLOCKS, SHAPES, _layout

from kvtier.vllm import _triton_copy
from kvtier.vllm.copier import BlockCopier
from kvtier.vllm.layout import check_tensors


def med(fn: Any, reps: int = 50, warm: int = 5) -> float:
    for _ in range(warm):
        fn()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def case(shape: str, chunk: int, cache_layout: str = "LBNHC") -> None:
    layers, heads, head = SHAPES[shape]
    layout = _layout(cache_layout, layers, heads, head)
    tensors = vk.allocate_kv_caches(
        cache_layout,
        num_layers=layers,
        num_blocks=NUM_BLOCKS,
        num_kv_heads=heads,
        block_size=BLOCK,
        head_size=head,
        dtype=torch.bfloat16,
        device="cuda",
    )
    for t in tensors:
        t.view(torch.int16).copy_(
            torch.randint(-(2**15), 2**15, t.shape, dtype=torch.int16, device="cuda")
        )
    tensors = check_tensors(layout, dict(zip(layout.layer_names, tensors, strict=True)))
    n = chunk // BLOCK
    nbytes = layout.payload_nbytes(n)
    copier = BlockCopier(layout, tensors, max_blocks=n, pinned_buffers=4, cuda_mode="triton")
    cuda = copier._cuda
    rng = random.Random(1)
    tables = [rng.sample(range(NUM_BLOCKS), n) for _ in range(32)]
    it = iter(range(10**9))

    def table() -> list[int]:
        return tables[next(it) % 32]

    cur = torch.cuda.current_stream()
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def plain() -> None:
        host.copy_(dev, non_blocking=True)
        cur.synchronize()

    def gather_one() -> None:
        buf = copier.gather_to_host(table())
        buf.view()
        buf.release()

    pool = cuda.pool
    slot = pool.acquire()
    slot_t = pool.tensor(slot, nbytes)
    ids_host = torch.empty(n, dtype=torch.int64, pin_memory=True)
    ids_np = ids_host.numpy()
    wd = cuda._word_dtype

    def zc_launch(payload: Any, to_payload: bool) -> None:
        """The copier's kernel, reading the ids and reading/writing the payload in host memory."""
        _triton_copy.launch(
            cuda._kv_words,
            payload.view(wd),
            cuda._layer_offsets,
            ids_host,
            num_layers=layout.num_layers,
            num_ids=n,
            payload_blocks=n,
            payload_first=0,
            geometry=cuda.geometry,
            to_payload=to_payload,
        )
        cur.synchronize()

    def zc(payload: Any, to_payload: bool) -> Any:
        def run() -> None:
            ids_np[:] = table()
            zc_launch(payload, to_payload)

        return run

    # correctness of the zero-copy gather against gather_to_host
    ok = {}
    for name, payload in (("pin_memory", host), ("registered", slot_t)):
        try:
            t = table()
            ids_np[:] = t
            payload.fill_(0xA5)
            zc_launch(payload, True)
            with copier.gather_to_host(t) as ref:
                ok[name] = bytes(ref.view()) == bytes(payload.numpy().tobytes())
        except Exception as exc:
            ok[name] = f"error: {exc}"
    print(shape, chunk, "zero-copy correct:", ok, flush=True)

    def scatter_one() -> None:
        copier.scatter_many([(src, n, 0, table())])
        cur.synchronize()

    src = copier.host_buffer(nbytes)
    src.view()[:] = bytes(slot_t.numpy().tobytes())
    rows = {
        "plain D2H": plain,
        "gather_to_host": gather_one,
        "scatter_many": scatter_one,
    }
    if ok.get("pin_memory") is True:
        rows["zc gather pin_memory"] = zc(host, True)
        rows["zc scatter pin_memory"] = zc(host, False)
    if ok.get("registered") is True:
        rows["zc gather registered"] = zc(slot_t, True)
        rows["zc scatter registered"] = zc(slot_t, False)
    for rep in range(2):
        base = None
        for name, fn in rows.items():
            t = med(fn)
            gbps = nbytes / t / 1e9
            base = base or gbps
            print(
                f"{shape:4} {chunk:4} r{rep} {name:24} {t * 1e6:8.1f} us {gbps:6.1f} GB/s "
                f"{gbps / base:5.2f}",
                flush=True,
            )
    # scatter round trip correct through zero-copy (registered)
    if ok.get("registered") is True:
        t = table()
        ids_np[:] = t
        zc_launch(slot_t, False)
        with copier.gather_to_host(t) as back:
            print("zc scatter round trip:", bytes(back.view()) == bytes(slot_t.numpy().tobytes()))
    src.release()
    pool.release(slot)
    copier.close()
    del tensors
    torch.cuda.empty_cache()


if __name__ == "__main__":
    print(torch.__version__, torch.cuda.get_device_name())
    for shape, chunk in (("7B", 256), ("7B", 512), ("70B", 256), ("70B", 512)):
        case(shape, chunk)
