"""GPU benchmark of the connector's CUDA data path (a by-hand benchmark, torch alone; not a test).

    PYTHONPATH=connector python connector/tests/cuda/bench_gpu_copy.py --out DIR
    python connector/tests/cuda/bench_gpu_copy.py --plot DIR/bench_gpu_copy.json --png FILE.png

For a 7B-class (28 layers, 4 KV heads, head 128) and a 70B-class (80 layers, 8 KV heads) bf16
KV cache, built as vLLM 0.32 allocates it (vllm032_kv.py) in the default CUDA layout LBNHC (NHD)
and in LBHNC (HND), block size 16, 4096 blocks, chunks of 256 and 512 tokens (16 / 32 random
blocks, a fresh random block table each repetition), it times side by side:

- plain pinned D2H / H2D copies of the same number of bytes (one contiguous device buffer <->
  a pinned host buffer): the link's rate, the goal's yardstick;
- gather (paged blocks of all layers -> a pinned pool slot, ``BlockCopier.gather_to_host`` +
  ``view()``) and scatter (a pinned slot -> paged blocks, ``scatter_many`` + the current
  stream's sync), one chunk at a time (latency, host overheads included) and streamed (chunks
  back to back, two slots in flight: double buffering);
- the same through the bytes API (``gather() -> bytes``, scatter from ``bytes``), and the
  BlockCopier this replaces (issue 15's "before"; one chunk size);
- both copy modes: one Triton launch for all layers, and torch's own ops (index_select /
  index_copy_ per layer);
- overlap: a loop of bf16 8192^3 matmuls on its own stream, alone and while chunks stream
  (gather, scatter, both) through the copier's stream: the loop's slowdown (8192^3 and 4096^3);
- profile (``--profile``): host time to queue one gather / scatter, device time of the kernel
  and of the DMA alone.

Medians of `--reps` repetitions after warm-up, host clock around each operation (every figure
includes its launch and sync costs). Prints a table, writes bench_gpu_copy.json to --out.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import sys
import time
import traceback
import warnings
from pathlib import Path
from typing import Any

SHAPES = {"7B": (28, 4, 128), "70B": (80, 8, 128)}  # layers, KV heads, head size
BLOCK = 16
NUM_BLOCKS = 4096
GOAL_RATIO = 0.8
OVERLAP_GOAL = 0.10


def _layout(cache_layout: str, layers: int, heads: int, head: int) -> Any:
    import vllm032_kv as vk

    from kvtier.vllm.layout import cuda_kv_layout

    return cuda_kv_layout(
        backend="FLASH_ATTN",
        cache_layout=cache_layout,
        layer_view_order=vk.layer_view_order(cache_layout),
        num_heads=heads,
        num_states=BLOCK,
        content_elems=2 * head,
        common={
            "dtype": "bfloat16",
            "itemsize": 2,
            "layer_names": tuple(f"model.layers.{i}.self_attn.attn" for i in range(layers)),
            "num_kv_heads": heads,
            "head_size": head,
            "block_size": BLOCK,
        },
    )


class LegacyCopier:
    """The CUDA path of BlockCopier before issue 15 (connector/kvtier/vllm/layout.py at main):
    a stack of per-layer index_selects copied into a pinned buffer then into bytes; scatter
    copies each layer's part from pageable memory."""

    def __init__(self, tensors: list[Any]) -> None:
        self.tensors = tensors
        self._pinned: dict[tuple[int, ...], Any] = {}

    def gather(self, block_ids: list[int]) -> bytes:
        import torch

        idx = torch.tensor(block_ids, dtype=torch.long, device=self.tensors[0].device)
        on_device = torch.stack([t.index_select(0, idx) for t in self.tensors])
        shape = tuple(on_device.shape)
        staging = self._pinned.get(shape)
        if staging is None:
            staging = torch.empty(shape, dtype=on_device.dtype, pin_memory=True)
            self._pinned[shape] = staging
        staging.copy_(on_device)
        raw: bytes = staging.view(torch.uint8).numpy().tobytes()
        return raw

    def scatter(self, payload: bytes, stored: int, block_ids: list[int]) -> None:
        import torch

        t0 = self.tensors[0]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            src = torch.frombuffer(payload, dtype=torch.uint8)
        part = src.view(t0.dtype).view(len(self.tensors), stored, *t0.shape[1:])
        idx = torch.tensor(block_ids, dtype=torch.long, device=t0.device)
        for i, t in enumerate(self.tensors):
            t.index_copy_(0, idx, part[i].to(t.device))


def _median_time(fn: Any, reps: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


def bench_copies(
    shape: str, cache_layout: str, modes: list[str], chunks: list[int], reps: int, legacy: bool
) -> list[dict[str, Any]]:
    import torch
    import vllm032_kv as vk

    from kvtier.vllm.blockcopy.copier import BlockCopier
    from kvtier.vllm.layout import check_tensors

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
    rng = random.Random(f"{shape}{cache_layout}")
    rows: list[dict[str, Any]] = []
    cur = torch.cuda.current_stream()
    for chunk in chunks:
        n = chunk // BLOCK
        nbytes = layout.payload_nbytes(n)
        tables = [rng.sample(range(NUM_BLOCKS), n) for _ in range(32)]
        it = iter(range(10**9))

        def table(it: Any = it, tables: list[list[int]] = tables) -> list[int]:
            return tables[next(it) % len(tables)]

        dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

        def d2h(dev: Any = dev, host: Any = host) -> None:
            host.copy_(dev, non_blocking=True)
            torch.cuda.current_stream().synchronize()

        def h2d(dev: Any = dev, host: Any = host) -> None:
            dev.copy_(host, non_blocking=True)
            torch.cuda.current_stream().synchronize()

        def d2h_stream(dev: Any = dev, host: Any = host, k: int = 8) -> None:
            for _ in range(k):
                host.copy_(dev, non_blocking=True)
            torch.cuda.current_stream().synchronize()

        def h2d_stream(dev: Any = dev, host: Any = host, k: int = 8) -> None:
            for _ in range(k):
                dev.copy_(host, non_blocking=True)
            torch.cuda.current_stream().synchronize()

        plain_d2h = _gbps(nbytes, _median_time(d2h, reps))
        plain_h2d = _gbps(nbytes, _median_time(h2d, reps))
        plain_d2h_stream = _gbps(8 * nbytes, _median_time(d2h_stream, 5))
        plain_h2d_stream = _gbps(8 * nbytes, _median_time(h2d_stream, 5))
        for mode in modes:
            copier = BlockCopier(layout, tensors, max_blocks=n, pinned_buffers=4, cuda_mode=mode)
            cuda = copier._cuda
            # The scatters' sources are pinned slots of another pool (as a fetched payload may
            # be): gather_iter takes all but one of the copier's own slots.
            feeder = BlockCopier(layout, tensors, max_blocks=n, pinned_buffers=2, cuda_mode=mode)

            def gather_one(copier: Any = copier) -> None:
                buf = copier.gather_to_host(table())
                buf.view()
                buf.release()

            src = feeder.host_buffer(nbytes)
            with copier.gather_to_host(table()) as g:
                src.view()[:] = g.view()
            src2 = feeder.host_buffer(nbytes)
            src2.view()[:] = src.view()

            def scatter_one(copier: Any = copier, src: Any = src, n: int = n) -> None:
                copier.scatter_many([(src, n, 0, table())])
                cur.synchronize()

            k = 8

            # Streamed as the worker does it: a save's chunks through gather_iter, a load's
            # chunks in one scatter_many (one chunk's DMA overlaps another's kernel).
            def gather_stream(copier: Any = copier, k: int = k) -> None:
                for _, buf in copier.gather_iter([table() for _ in range(k)]):
                    buf.view()
                    buf.release()

            def scatter_stream(
                copier: Any = copier, k: int = k, bufs: tuple[Any, Any] = (src, src2), n: int = n
            ) -> None:
                copier.scatter_many([(bufs[i % 2], n, 0, table()) for i in range(k)])
                cur.synchronize()

            payload = bytes(src.view())

            def gather_bytes(copier: Any = copier) -> None:
                copier.gather(table())

            def scatter_bytes(copier: Any = copier, payload: bytes = payload, n: int = n) -> None:
                copier.scatter(payload, n, 0, table())
                cur.synchronize()

            row = {
                "shape": shape,
                "layers": layers,
                "kv_heads": heads,
                "head_size": head,
                "cache_layout": cache_layout,
                "variant": layout.variant,
                "mode": mode,
                "chunk_tokens": chunk,
                "blocks": n,
                "bytes": nbytes,
                "plain_d2h_gbps": plain_d2h,
                "plain_h2d_gbps": plain_h2d,
                "plain_d2h_stream_gbps": plain_d2h_stream,
                "plain_h2d_stream_gbps": plain_h2d_stream,
                "gather_gbps": _gbps(nbytes, _median_time(gather_one, reps)),
                "scatter_gbps": _gbps(nbytes, _median_time(scatter_one, reps)),
                "gather_stream_gbps": _gbps(k * nbytes, _median_time(gather_stream, 5)),
                "scatter_stream_gbps": _gbps(k * nbytes, _median_time(scatter_stream, 5)),
                "gather_bytes_gbps": _gbps(nbytes, _median_time(gather_bytes, 5, 1)),
                "scatter_bytes_gbps": _gbps(nbytes, _median_time(scatter_bytes, 5, 1)),
                "pinned_via": cuda.pool.pinned_via,
            }
            for key in ("gather", "gather_stream"):
                row[f"{key}_ratio"] = row[f"{key}_gbps"] / plain_d2h
            for key in ("scatter", "scatter_stream"):
                row[f"{key}_ratio"] = row[f"{key}_gbps"] / plain_h2d
            src.release()
            src2.release()
            copier.close()
            feeder.close()
            rows.append(row)
            print(_fmt_row(row), flush=True)
        if legacy:
            old = LegacyCopier(tensors)

            def old_gather(old: LegacyCopier = old) -> None:
                old.gather(table())

            old_payload = old.gather(table())

            def old_scatter(old: LegacyCopier = old, p: bytes = old_payload, n: int = n) -> None:
                old.scatter(p, n, table())
                cur.synchronize()

            before = {
                "shape": shape,
                "cache_layout": cache_layout,
                "mode": "before (issue 15)",
                "chunk_tokens": chunk,
                "bytes": nbytes,
                "plain_d2h_gbps": plain_d2h,
                "plain_h2d_gbps": plain_h2d,
                "gather_bytes_gbps": _gbps(nbytes, _median_time(old_gather, 5, 1)),
                "scatter_bytes_gbps": _gbps(nbytes, _median_time(old_scatter, 5, 1)),
            }
            rows.append(before)
            print(
                f"  before: gather {before['gather_bytes_gbps']:.1f} GB/s, scatter "
                f"{before['scatter_bytes_gbps']:.1f} GB/s (bytes API)",
                flush=True,
            )
        del dev, host
    del tensors
    torch.cuda.empty_cache()
    return rows


def bench_overlap(
    shape: str, chunk: int, mode: str, cache_layout: str, size: int = 8192
) -> dict[str, Any]:
    """A loop of `size`^3 bf16 matmuls on its own stream (about 65 ms), alone and while chunks
    stream through the copier."""
    import torch
    import vllm032_kv as vk

    from kvtier.vllm.blockcopy.copier import BlockCopier

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
    n = chunk // BLOCK
    nbytes = layout.payload_nbytes(n)
    copier = BlockCopier(layout, tensors, max_blocks=n, pinned_buffers=4, cuda_mode=mode)
    rng = random.Random(1)
    src = copier.host_buffer(nbytes)
    src.view()[:] = bytes(nbytes)
    a = torch.randn(size, size, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(size, size, dtype=torch.bfloat16, device="cuda")
    mm_stream = torch.cuda.Stream()
    iters = 40 * (8192 // size) ** 3

    def matmuls() -> tuple[Any, Any]:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(mm_stream):
            start.record(mm_stream)
            for _ in range(iters):
                torch.mm(a, b)
            end.record(mm_stream)
        return start, end

    def alone() -> float:
        start, end = matmuls()
        end.synchronize()
        return float(start.elapsed_time(end))

    def with_copies(kind: str) -> tuple[float, float, int]:
        start, end = matmuls()
        moved = 0
        t0 = time.perf_counter()
        i = 0
        prev = None
        while not end.query():
            if kind == "gather" or (kind == "both" and i % 2 == 0):
                buf = copier.gather_to_host(rng.sample(range(NUM_BLOCKS), n))
                if prev is not None:
                    prev.view()
                    prev.release()
                prev = buf
            else:
                copier.scatter_many([(src, n, 0, rng.sample(range(NUM_BLOCKS), n))])
                torch.cuda.current_stream().synchronize()
            moved += nbytes
            i += 1
        if prev is not None:
            prev.view()
            prev.release()
        copier._cuda.synchronize()
        elapsed = time.perf_counter() - t0
        return float(start.elapsed_time(end)), moved / elapsed / 1e9, i

    for _ in range(3):
        alone()
    base = [alone() for _ in range(5)]
    out: dict[str, Any] = {
        "shape": shape,
        "chunk_tokens": chunk,
        "mode": mode,
        "cache_layout": cache_layout,
        "bytes": nbytes,
        "matmul": f"bf16 {size}x{size}x{size}",
        "iters": iters,
        "alone_ms": statistics.median(base),
        "alone_ms_all": base,
    }
    for kind in ("gather", "scatter", "both"):
        with_copies(kind)  # warm-up
        runs = [with_copies(kind) for _ in range(3)]
        ms = statistics.median(r[0] for r in runs)
        out[kind] = {
            "with_copies_ms": ms,
            "slowdown": ms / out["alone_ms"] - 1,
            "copy_gbps": statistics.median(r[1] for r in runs),
            "chunks": statistics.median(r[2] for r in runs),
        }
    after = [alone() for _ in range(5)]
    out["alone_after_ms_all"] = after
    src.release()
    copier.close()
    del tensors
    torch.cuda.empty_cache()
    return out


def bench_profile(shape: str, chunk: int, cache_layout: str, reps: int) -> dict[str, Any]:
    """Where one chunk's time goes (Triton mode): host time to queue a gather / scatter, host
    time until the payload is there, and device times of the kernel and of the DMA alone."""
    import torch
    import vllm032_kv as vk

    from kvtier.vllm.blockcopy.copier import BlockCopier

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
    n = chunk // BLOCK
    nbytes = layout.payload_nbytes(n)
    copier = BlockCopier(layout, tensors, max_blocks=n, cuda_mode="triton")
    cuda = copier._cuda
    rng = random.Random(3)
    cur = torch.cuda.current_stream()
    src = copier.host_buffer(nbytes)
    src.view()[:] = bytes(nbytes)
    issue_g, total_g, issue_s, total_s, launch = [], [], [], [], []
    for i in range(reps + 3):
        t0 = time.perf_counter()
        buf = copier.gather_to_host(rng.sample(range(NUM_BLOCKS), n))
        t1 = time.perf_counter()
        buf.view()
        t2 = time.perf_counter()
        buf.release()
        t3 = time.perf_counter()
        copier.scatter_many([(src, n, 0, rng.sample(range(NUM_BLOCKS), n))])
        t4 = time.perf_counter()
        cur.synchronize()
        t5 = time.perf_counter()
        if i >= 3:
            issue_g.append(t1 - t0)
            total_g.append(t2 - t0)
            issue_s.append(t4 - t3)
            total_s.append(t5 - t3)
    ids = torch.tensor(rng.sample(range(NUM_BLOCKS), n), dtype=torch.int64, device="cuda")

    def device_ms(fn: Any, k: int = 20) -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(cuda.stream):
            fn()
            start.record(cuda.stream)
            for _ in range(k):
                fn()
            end.record(cuda.stream)
        end.synchronize()
        return float(start.elapsed_time(end)) / k

    slot = cuda.pool.tensor(0, nbytes)
    out = {
        "shape": shape,
        "chunk_tokens": chunk,
        "cache_layout": cache_layout,
        "bytes": nbytes,
        "gather_issue_us": 1e6 * statistics.median(issue_g),
        "gather_total_us": 1e6 * statistics.median(total_g),
        "scatter_issue_us": 1e6 * statistics.median(issue_s),
        "scatter_total_us": 1e6 * statistics.median(total_s),
        "gather_kernel_us": 1e3
        * device_ms(lambda: cuda._copy_pages(ids, n, n, 0, to_payload=True)),
        "scatter_kernel_us": 1e3
        * device_ms(lambda: cuda._copy_pages(ids, n, n, 0, to_payload=False)),
        "d2h_us": 1e3 * device_ms(lambda: slot.copy_(cuda._staging[:nbytes], non_blocking=True)),
        "h2d_us": 1e3 * device_ms(lambda: cuda._staging[:nbytes].copy_(slot, non_blocking=True)),
    }
    for _ in range(reps):
        t0 = time.perf_counter()
        with torch.cuda.stream(cuda.stream):
            cuda._copy_pages(ids, n, n, 0, to_payload=True)
        launch.append(time.perf_counter() - t0)
    out["kernel_launch_host_us"] = 1e6 * statistics.median(launch)
    cuda.synchronize()
    out["kernel_gbps"] = 2 * nbytes / out["gather_kernel_us"] / 1e3
    src.release()
    copier.close()
    del tensors
    torch.cuda.empty_cache()
    return out


def _fmt_row(r: dict[str, Any]) -> str:
    return (
        f"{r['shape']:>4} {r['cache_layout']}({r['variant']}) {r['mode']:>6} "
        f"{r['chunk_tokens']:>4} tok {r['bytes'] / 1e6:7.1f} MB | D2H {r['plain_d2h_gbps']:5.1f} "
        f"gather {r['gather_gbps']:5.1f} ({r['gather_ratio']:.2f}) stream "
        f"{r['gather_stream_gbps']:5.1f} ({r['gather_stream_ratio']:.2f}) bytes "
        f"{r['gather_bytes_gbps']:5.1f} | H2D {r['plain_h2d_gbps']:5.1f} scatter "
        f"{r['scatter_gbps']:5.1f} ({r['scatter_ratio']:.2f}) stream "
        f"{r['scatter_stream_gbps']:5.1f} ({r['scatter_stream_ratio']:.2f}) bytes "
        f"{r['scatter_bytes_gbps']:5.1f}"
    )


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {
        "command": " ".join(["python", *sys.argv]),
        "device": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": triton_version,
        "python": platform.python_version(),
        "goal_ratio": GOAL_RATIO,
        "overlap_goal": OVERLAP_GOAL,
        "rows": [],
        "overlap": [],
        "profile": [],
        "errors": [],
    }
    print(f"{result['device']}, torch {result['torch']}, triton {triton_version}", flush=True)
    chunks = [int(c) for c in args.chunks.split(",")]
    modes = args.modes.split(",")
    for shape in args.shapes.split(","):
        for i, cache_layout in enumerate(args.layouts.split(",")):
            for j, mode in enumerate(modes):
                try:  # one failure must not cost the rest of the run (device time is scarce)
                    result["rows"] += bench_copies(
                        shape,
                        cache_layout,
                        [mode],
                        chunks,
                        args.reps,
                        legacy=args.legacy and i == 0 and j == 0,
                    )
                except Exception as exc:
                    traceback.print_exc()
                    result["errors"].append(f"{shape} {cache_layout} {mode}: {exc!r}")
                (out_dir / "bench_gpu_copy.json").write_text(json.dumps(result, indent=1))
    for spec in args.profile.split(","):
        if not spec:
            continue
        shape, chunk = spec.split(":")
        try:
            prof = bench_profile(shape, int(chunk), args.layouts.split(",")[0], args.reps)
        except Exception as exc:
            traceback.print_exc()
            result["errors"].append(f"profile {spec}: {exc!r}")
            continue
        result["profile"].append(prof)
        print("profile", {k: round(v, 1) if isinstance(v, float) else v for k, v in prof.items()})
    for spec in args.overlap.split(","):
        if not spec:
            continue
        shape, chunk, mode, size = spec.split(":")
        try:
            ov = bench_overlap(shape, int(chunk), mode, args.layouts.split(",")[0], int(size))
        except Exception as exc:
            traceback.print_exc()
            result["errors"].append(f"overlap {spec}: {exc!r}")
            continue
        result["overlap"].append(ov)
        print(
            f"overlap {shape} {chunk} tok {mode}, {ov['iters']} x {ov['matmul']}: alone "
            f"{ov['alone_ms']:.1f} ms; "
            + "; ".join(
                f"{k} {ov[k]['with_copies_ms']:.1f} ms ({ov[k]['slowdown']:+.1%}, copies "
                f"{ov[k]['copy_gbps']:.1f} GB/s)"
                for k in ("gather", "scatter", "both")
            ),
            flush=True,
        )
        (out_dir / "bench_gpu_copy.json").write_text(json.dumps(result, indent=1))
    print_summary(result)
    for error in result["errors"]:
        print("ERROR", error)
    return result


def print_summary(result: dict[str, Any]) -> None:
    print(
        "\nshape chunk layout      mode    MB    | D2H  gather (x) stream (x) | "
        "H2D  scatter (x) stream (x)"
    )
    for r in result["rows"]:
        if "gather_gbps" not in r:
            continue
        print(
            f"{r['shape']:>4} {r['chunk_tokens']:>5} {r['cache_layout']}({r['variant']}) "
            f"{r['mode']:>6} {r['bytes'] / 1e6:6.1f} | {r['plain_d2h_gbps']:4.1f} "
            f"{r['gather_gbps']:4.1f} ({r['gather_ratio']:.2f}) {r['gather_stream_gbps']:4.1f} "
            f"({r['gather_stream_ratio']:.2f}) | {r['plain_h2d_gbps']:4.1f} "
            f"{r['scatter_gbps']:4.1f} ({r['scatter_ratio']:.2f}) "
            f"{r['scatter_stream_gbps']:4.1f} ({r['scatter_stream_ratio']:.2f})"
        )
    for ov in result["overlap"]:
        print(
            f"overlap {ov['shape']} {ov['chunk_tokens']} {ov['mode']} {ov['matmul']}: alone "
            f"{ov['alone_ms']:.1f} ms, "
            + ", ".join(f"{k} {ov[k]['slowdown']:+.1%}" for k in ("gather", "scatter", "both"))
        )


def plot(json_path: str, png: str) -> None:
    """Bar chart of the JSON (run where matplotlib is; the GPU machine may lack it)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    result = json.loads(Path(json_path).read_text())
    rows = [r for r in result["rows"] if "gather_gbps" in r]
    fig, axes = plt.subplots(1, 2, figsize=(13, 5), sharey=True)
    for ax, (direction, plain) in zip(
        axes, (("gather", "plain_d2h_gbps"), ("scatter", "plain_h2d_gbps")), strict=True
    ):
        labels = [
            f"{r['shape']} {r['chunk_tokens']}\n{r['cache_layout']} {r['mode']}" for r in rows
        ]
        x = range(len(rows))
        w = 0.27
        ax.bar([i - w for i in x], [r[plain] for r in rows], w, label="plain pinned copy")
        ax.bar(x, [r[f"{direction}_gbps"] for r in rows], w, label=f"{direction}, one chunk")
        ax.bar(
            [i + w for i in x],
            [r[f"{direction}_stream_gbps"] for r in rows],
            w,
            label=f"{direction}, streamed",
        )
        goal = GOAL_RATIO * statistics.median(r[plain] for r in rows)
        ax.axhline(goal, color="k", ls="--", lw=1, label=f"{GOAL_RATIO} x plain copy")
        ax.set_xticks(list(x), labels, fontsize=7, rotation=90)
        ax.set_title(f"{direction} ({'GPU -> host' if direction == 'gather' else 'host -> GPU'})")
        ax.set_ylabel("GB/s")
        ax.set_ylim(0, 1.3 * max(r[plain] for r in rows))
        ax.legend(fontsize=8, loc="upper left", ncol=2)
    fig.suptitle(f"kvtier BlockCopier on {result['device']} (torch {result['torch']})")
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", help="directory for bench_gpu_copy.json")
    parser.add_argument("--shapes", default="7B,70B")
    parser.add_argument("--layouts", default="LBNHC,LBHNC")
    parser.add_argument("--modes", default="triton,torch")
    parser.add_argument("--chunks", default="256,512")
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument(
        "--overlap",
        default="7B:256:triton:8192,70B:512:triton:8192,70B:512:torch:8192,"
        "7B:256:triton:4096,70B:512:triton:4096",
        help="shape:chunk:mode:matmul size, comma-separated",
    )
    parser.add_argument("--profile", default="7B:256,70B:512")
    parser.add_argument("--no-legacy", dest="legacy", action="store_false")
    parser.add_argument("--plot", help="a bench_gpu_copy.json to plot (no GPU needed)")
    parser.add_argument("--png", default="bench-gpu-copy.png")
    args = parser.parse_args()
    if args.plot:
        plot(args.plot, args.png)
        return
    if not args.out:
        parser.error("--out is required (or --plot)")
    run(args)


if __name__ == "__main__":
    main()
