"""Experiment (by hand, H200): the Triton kernel reading/writing the pinned host slot directly
(zero-copy over PCIe) instead of device staging + one DMA, for one chunk at a time; and the
same copy on a few SMs only (a persistent grid of P programs looping over the pieces), timed
alone and beside a loop of matmuls on another stream (what it costs the forward pass).

    PYTHONPATH=connector:connector/tests/cuda python connector/tests/cuda/exp_zero_copy.py
"""

from __future__ import annotations

import random
import statistics
import time
from typing import Any

import torch
import triton
import triton.language as tl
import vllm032_kv as vk
from bench_gpu_copy import BLOCK, NUM_BLOCKS, SHAPES, _layout

from kvtier.vllm import _triton_copy
from kvtier.vllm.copier import BlockCopier
from kvtier.vllm.layout import check_tensors


@triton.jit
def _persistent_copy(
    kv,
    payload,
    layer_offsets,
    block_ids,
    num_ids,
    block_stride,
    run_stride,
    run_words,
    runs,
    pieces,
    total,
    TO_PAYLOAD: tl.constexpr,
    VEC: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """_triton_copy's kernel, each of a few programs looping over (page, piece) items."""
    per_page = runs * pieces
    for w in range(tl.program_id(0), total, tl.num_programs(0)):
        page = w // per_page
        piece = w - page * per_page
        layer = page // num_ids
        j = page - layer * num_ids
        r = piece // pieces
        p = piece - r * pieces
        kv_off = (
            tl.load(layer_offsets + layer)
            + tl.load(block_ids + j) * block_stride
            + r.to(tl.int64) * run_stride
            + p * BLOCK
        )
        kv_off = tl.multiple_of(kv_off, VEC)
        pl_off = (page.to(tl.int64) * runs + r) * run_words
        pl_off = tl.multiple_of(pl_off + p * BLOCK, VEC)
        idx = tl.arange(0, BLOCK)
        mask = p * BLOCK + idx < run_words
        if TO_PAYLOAD:
            tl.store(payload + pl_off + idx, tl.load(kv + kv_off + idx, mask=mask), mask=mask)
        else:
            tl.store(kv + kv_off + idx, tl.load(payload + pl_off + idx, mask=mask), mask=mask)


def persistent_launch(
    cuda: Any, payload: Any, ids: Any, n: int, programs: int, to_payload: bool
) -> None:
    g = cuda.geometry
    block = min(4096, triton.next_power_of_2(g.run_words))
    pieces = triton.cdiv(g.run_words, block)
    _persistent_copy[(programs,)](
        cuda._kv_words,
        payload.view(cuda._word_dtype),
        cuda._layer_offsets,
        ids,
        n,
        g.block_stride,
        g.run_stride,
        g.run_words,
        g.runs,
        pieces,
        cuda.layout.num_layers * n * g.runs * pieces,
        TO_PAYLOAD=to_payload,
        VEC=max(1, g.align // g.word),
        BLOCK=block,
        num_warps=4 if block <= 1024 else 8,
    )


def overlap(run_copy: Any, size: int) -> tuple[float, float]:
    """(matmul loop alone ms, with lone chunks copied meanwhile on another stream ms)."""
    a = torch.randn(size, size, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(size, size, dtype=torch.bfloat16, device="cuda")
    mm = torch.cuda.Stream()
    iters = 40 * (8192 // size) ** 3

    def loop() -> tuple[Any, Any]:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(mm):
            start.record(mm)
            for _ in range(iters):
                torch.mm(a, b)
            end.record(mm)
        return start, end

    def alone() -> float:
        start, end = loop()
        end.synchronize()
        return float(start.elapsed_time(end))

    def with_copies() -> float:
        start, end = loop()
        while not end.query():
            run_copy()
        return float(start.elapsed_time(end))

    for _ in range(2):
        alone()
        with_copies()
    base = statistics.median(alone() for _ in range(5))
    return base, statistics.median(with_copies() for _ in range(3))


def med(fn: Any, reps: int = 50, warm: int = 5) -> float:
    for _ in range(warm):
        fn()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def few_sms(
    cuda: Any,
    copier: Any,
    slot_t: Any,
    ids_host: Any,
    table: Any,
    plain: Any,
    gather_one: Any,
    with_overlap: bool,
) -> None:
    """The persistent kernel on P programs: correct, its lone-chunk rate, and what it costs a
    matmul loop on another stream (beside the staged copier's lone gather)."""
    n = ids_host.numel()
    ids_np = ids_host.numpy()
    nbytes = slot_t.numel()
    side = torch.cuda.Stream()

    def pers(to_payload: bool, programs: int) -> Any:
        def run() -> None:
            ids_np[:] = table()
            with torch.cuda.stream(side):
                persistent_launch(cuda, slot_t, ids_host, n, programs, to_payload)
            side.synchronize()

        return run

    for programs in (4, 16):
        t = table()
        ids_np[:] = t
        slot_t.fill_(0xA5)
        persistent_launch(cuda, slot_t, ids_host, n, programs, True)
        torch.cuda.synchronize()
        with copier.gather_to_host(t) as ref:
            same = bytes(ref.view()) == bytes(slot_t.numpy().tobytes())
        print(f"persistent P={programs} gather correct: {same}", flush=True)
    base = med(plain)
    for programs in (2, 4, 8, 16, 32, 132):
        for to_payload in (True, False):
            t = med(pers(to_payload, programs))
            kind = "gather" if to_payload else "scatter"
            print(
                f"  P={programs:3} {kind:7} {t * 1e6:8.1f} us {nbytes / t / 1e9:6.1f} GB/s "
                f"{base / t:5.2f} of plain",
                flush=True,
            )
    if not with_overlap:
        return
    for size in (4096, 8192):
        alone, with_ = overlap(gather_one, size)
        print(f"  overlap {size}^3: staged lone gather {with_ / alone - 1:+.1%}", flush=True)
        for programs in (2, 4, 8, 16):
            for to_payload in (True, False):
                alone, with_ = overlap(pers(to_payload, programs), size)
                kind = "gather" if to_payload else "scatter"
                print(
                    f"  overlap {size}^3: P={programs} {kind} {with_ / alone - 1:+.1%} "
                    f"(alone {alone:.1f} ms)",
                    flush=True,
                )


def case(shape: str, chunk: int, cache_layout: str = "LBNHC", with_overlap: bool = False) -> None:
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
    few_sms(cuda, copier, slot_t, ids_host, table, plain, gather_one, with_overlap)
    src.release()
    pool.release(slot)
    copier.close()
    del tensors
    torch.cuda.empty_cache()


if __name__ == "__main__":
    print(torch.__version__, torch.cuda.get_device_name())
    for shape, chunk in (("7B", 256), ("7B", 512), ("70B", 256), ("70B", 512)):
        case(shape, chunk, with_overlap=(shape, chunk) in (("7B", 256), ("70B", 512)))
