"""The worker's GPU paths on a real GPU (a by-hand harness and benchmark; torch, no vLLM):

    PYTHONPATH=connector:connector/tests/cuda python connector/tests/cuda/bench_gpu_paths.py \
        --out DIR [--iters 1000]
    python connector/tests/cuda/bench_gpu_paths.py --plot DIR/bench_gpu_paths.json --png F.png
    python connector/tests/cuda/bench_gpu_paths.py --plot-steps OLD.json NEW.json --png F.png
    python connector/tests/cuda/bench_gpu_paths.py --plot-cpu-tiers SAVES.json... LOADS.json \
        --png F.png

1. **Stream order** (``order``): vLLM's threading reproduced. The main thread computes on a
   dedicated stream it set (as vLLM's GPU model runner does), and clears the target blocks on
   it; the copier's stream is busy (a long kernel: a save's gather still in flight); a request
   is loaded in the background through `WorkerSide` (its loading thread); as soon as
   `take_finished` reports it, the main thread reads its blocks on the compute stream and
   compares them with the payload. ``before``: the copier as it was (orders against the
   thread-local current stream, reports the load once queued); ``after``: this code. A stale
   read is a block that does not hold the payload.
2. **Saves** (``saves``): `WorkerSide.save` of 8K-token steps (32 chunks of 256 tokens) for a
   7B and a 70B shape: host time inside the call (vLLM's thread) per step, and the sustained
   rate until every chunk reached the store, against a plain pinned D2H copy of the same bytes
   in the same chunk-sized pieces. The store is a sink that gets the payloads as views of the
   pinned slots (no ``bytes`` copy on the path: checked), checksums them or not (xxh3, as the
   real store's header does) and gives the slots back; or the real TieredStore with a CPU tier
   (``--cpu-tier-gib``, 16), which checksums the chunks and copies them out of the slots:
   ``+cpu`` a ``bytes`` per chunk (the tier before the slab), ``+slab`` the connector's pinned
   slab of chunk slots (a tier smaller than the run's bytes evicts and reuses). A probe
   thread sleeping 1 ms in a loop measures how long the save path held the GIL (how late it
   woke: vLLM's thread would have waited as long).
3. **Loads** (``loads``): `scatter_many` of 32 chunks from fetched payloads (``bytes``: pageable
   memory, as the disk and S3 tiers return them), streamed, against a plain pinned H2D copy of
   the same bytes; of the same chunks read from the CPU tier's pinned slab (no bounce); and whole
   loads through the real store of chunks the disk tier holds (read, verify, promote, copy),
   with the CPU tier before the slab and with the slab.
4. **Lone chunk** (``lone``): one 7B/256-token chunk gathered and scattered alone.
5. **FP8** (``fp8``): an FP8 KV cache (uint8 pages, as vLLM allocates them for
   ``--kv-cache-dtype fp8``) gathered and scattered into another: bit-exact.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

BLOCK = 16
CHUNK = 256
STEP_TOKENS = 8192
SHAPES = {"7B": (28, 4, 128), "70B": (80, 8, 128)}  # layers, KV heads, head size


def _layout(layers: int, heads: int, head: int, dtype: str = "bfloat16", itemsize: int = 2) -> Any:
    import vllm032_kv as vk

    from kvtier.vllm.layout import cuda_kv_layout

    return cuda_kv_layout(
        backend="FLASH_ATTN",
        cache_layout="LBNHC",
        layer_view_order=vk.layer_view_order("LBNHC"),
        num_heads=heads,
        num_states=BLOCK,
        content_elems=2 * head,
        common={
            "dtype": dtype,
            "itemsize": itemsize,
            "layer_names": tuple(f"model.layers.{i}.self_attn.attn" for i in range(layers)),
            "num_kv_heads": heads,
            "head_size": head,
            "block_size": BLOCK,
        },
    )


def _caches(shape: str, num_blocks: int, dtype: Any = None) -> tuple[Any, list[Any]]:
    import torch
    import vllm032_kv as vk

    from kvtier.vllm.layout import check_tensors

    layers, heads, head = SHAPES[shape]
    dtype = dtype or torch.bfloat16
    fp8 = dtype == torch.uint8
    layout = _layout(layers, heads, head, "fp8_e4m3" if fp8 else "bfloat16", 1 if fp8 else 2)
    tensors = vk.allocate_kv_caches(
        "LBNHC",
        num_layers=layers,
        num_blocks=num_blocks,
        num_kv_heads=heads,
        block_size=BLOCK,
        head_size=head,
        dtype=dtype,
        device="cuda",
    )
    for t in tensors:
        t.view(torch.uint8).copy_(
            torch.randint(0, 256, t.view(torch.uint8).shape, device="cuda", dtype=torch.uint8)
        )
    return layout, check_tensors(layout, dict(zip(layout.layer_names, tensors, strict=True)))


class _Store:
    """The part of TieredStore the worker uses: fetches from a dict (``bytes``), and a save
    sink that checksums what it is lent and gives it back at once."""

    def __init__(self, checksum: bool = True) -> None:
        from kvtier.stats import StoreStats

        self.checksum = checksum
        self.held: dict[str, bytes] = {}
        self.saved_bytes = 0
        self.saved_chunks = 0
        self.lent_views = True
        self._stats = StoreStats()
        self.done = threading.Condition()

    def get_many(self, refs: Sequence[Any]) -> list[bytes | None]:
        return [self.held.get(r.chunk_id) for r in refs]

    def put_run(
        self,
        chunks: Sequence[tuple[str, Any, int]],
        on_done: Callable[[], None] | None = None,
        tiers: str = "all",
    ) -> None:
        self.lent_views &= all(isinstance(p, memoryview) for _, p, _ in chunks)
        self._take(chunks, on_done, tiers)
        with self.done:
            self.saved_chunks += len(chunks)
            self.saved_bytes += sum(len(p) for _, p, _ in chunks)
            self.done.notify_all()

    def _take(
        self, chunks: Sequence[tuple[str, Any, int]], on_done: Callable[[], None] | None, tiers: str
    ) -> None:
        from kvtier.format import checksum

        if self.checksum:
            for _, payload, _ in chunks:
                checksum(payload)
        if on_done is not None:
            on_done()

    def stats(self) -> Any:
        return self._stats

    def close(self, timeout: float | None = None) -> None:
        pass


class _TieredSink(_Store):
    """The real store's save path: a TieredStore with a CPU tier (the chunks checksummed and
    copied out of the lent slots, evicting the oldest), counted like `_Store`. ``slot_bytes``:
    the connector's CPU tier, a pinned slab of such slots; None: a ``bytes`` per chunk (the
    tier before the slab)."""

    def __init__(self, capacity_bytes: int, slot_bytes: int | None = None) -> None:
        from kvtier.store import TieredStore
        from kvtier.tiers.cpu import CpuSlabTier, CpuTier
        from kvtier.vllm.blockcopy.pinned import pin_host_region

        super().__init__()
        tier = (
            CpuTier(capacity_bytes)
            if slot_bytes is None
            else CpuSlabTier(capacity_bytes, slot_bytes, pin_host_region)
        )
        self.store = TieredStore([tier], "00" * 16)

    def get_many(self, refs: Sequence[Any]) -> list[bytes | None]:
        return self.store.get_many(refs)

    def _take(
        self, chunks: Sequence[tuple[str, Any, int]], on_done: Callable[[], None] | None, tiers: str
    ) -> None:
        self.store.put_run(chunks, on_done=on_done, tiers=tiers)  # type: ignore[arg-type]

    def stats(self) -> Any:
        return self.store.stats()

    def close(self, timeout: float | None = None) -> None:
        self.store.close(timeout)


class _GilProbe:
    """A thread that sleeps 1 ms in a loop: how late it wakes is how long another thread held
    the GIL (vLLM's main thread waits as long for any Python work of its own)."""

    def __init__(self) -> None:
        self.late_ms: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            t0 = time.perf_counter()
            time.sleep(0.001)
            self.late_ms.append(1000 * (time.perf_counter() - t0) - 1.0)

    def stop(self) -> dict[str, float]:
        self._stop.set()
        self._thread.join()
        late = sorted(self.late_ms) or [0.0]
        return {
            "gil_late_ms_p99": late[int(0.99 * (len(late) - 1))],
            "gil_late_ms_max": late[-1],
        }


class _BeforeCopier:
    """The copier as it was before this change, for the harness's control: a background load
    orders against the loading thread's own current stream (the default stream) and returns
    once its copies are queued (no fence, no wait)."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def fence(self) -> None:
        return None

    def scatter_many(self, items: Any, *, after: Any = None, wait: bool = False) -> None:
        import torch

        cuda = self._inner._cuda
        saved = cuda._compute_stream
        cuda._compute_stream = lambda: torch.cuda.current_stream()  # the thread's own
        try:
            cuda.scatter_many(items)
        finally:
            cuda._compute_stream = saved


def stream_order(iters: int, sleep_cycles: int) -> dict[str, Any]:
    import torch

    from kvtier.vllm.blockcopy.copier import BlockCopier
    from kvtier.vllm.step_plan import LoadSpec
    from kvtier.vllm.worker import WorkerSide

    out: dict[str, Any] = {"iters": iters, "sleep_cycles": sleep_cycles}
    layout, src = _caches("7B", 512)
    _, dst = _caches("7B", 512)
    compute = torch.cuda.Stream()
    torch.cuda.set_stream(compute)  # vLLM's model runner computes on a stream of its own
    rng = random.Random(5)
    blocks = CHUNK // BLOCK
    payloads = []
    for _ in range(4):
        ids = rng.sample(range(512), blocks)
        payloads.append((ids, BlockCopier(layout, src).gather(ids)))
    for mode in ("before", "after"):
        store = _Store()
        real = BlockCopier(layout, dst, max_blocks=blocks, compute_stream=lambda c=compute: c)
        copier: Any = _BeforeCopier(real) if mode == "before" else real
        worker = WorkerSide(store, copier, timeout_secs=30)  # type: ignore[arg-type]
        stale = 0
        waited = []
        for i in range(iters):
            src_ids, payload = payloads[i % len(payloads)]
            ids = rng.sample(range(512), blocks)
            idx = torch.tensor(ids, device="cuda")
            for t in dst:  # the blocks' previous content, on the compute stream
                t.index_fill_(0, idx, 0)
            with torch.cuda.stream(real._cuda.stream):
                torch.cuda._sleep(sleep_cycles)  # the copy stream is busy (a save in flight)
            store.held[f"c{i}"] = payload
            req = f"r{i}"
            t0 = time.perf_counter()
            worker.load([LoadSpec(req, f"c{i}", blocks, 0, tuple(ids), CHUNK, background=True)])
            while req not in worker.take_finished():
                time.sleep(0.0001)
            waited.append(time.perf_counter() - t0)
            # The request's first forward: its blocks read on the compute stream.
            src_idx = torch.tensor(src_ids, device="cuda")
            same = all(
                torch.equal(
                    d.index_select(0, idx).view(torch.int16),
                    s.index_select(0, src_idx).view(torch.int16),
                )
                for d, s in zip(dst, src, strict=True)
            )
            stale += not same
            assert not worker.take_failed_blocks()
        worker.close(5)
        out[mode] = {
            "stale_reads": stale,
            "reported_after_ms_median": 1000 * statistics.median(waited),
        }
        print(
            f"order {mode}: {stale} stale reads of {iters}; reported after "
            f"{out[mode]['reported_after_ms_median']:.2f} ms (median)",
            flush=True,
        )
    torch.cuda.set_stream(torch.cuda.default_stream())
    return out


def _plain(nbytes: int, pieces: int, to_host: bool) -> float:
    """Seconds for a plain pinned copy of `pieces` pieces of `nbytes`, streamed."""
    import torch

    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    host = [torch.empty(nbytes, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
    best = []
    for _ in range(3):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for k in range(pieces):
            if to_host:
                host[k % 2].copy_(dev, non_blocking=True)
            else:
                dev.copy_(host[k % 2], non_blocking=True)
        torch.cuda.synchronize()
        best.append(time.perf_counter() - t0)
    return statistics.median(best)


SINKS = ("views", "checksum", "cpu", "slab")


def saves(
    steps: int, forward_ms: float = 0.0, sinks: Sequence[str] = SINKS, cpu_tier_gib: float = 16
) -> dict[str, Any]:
    """``forward_ms`` 0: steps back to back (the save path's rate); else each step's forward
    runs that long on the compute stream and the host waits for it before the next step, as
    vLLM waits for a step's output (the host time of a step's saves, the copies riding
    beside the next forward)."""
    import torch

    from kvtier.keys import chunk_hashes
    from kvtier.vllm.blockcopy.copier import BlockCopier
    from kvtier.vllm.step_plan import SaveSpec
    from kvtier.vllm.worker import WorkerSide

    out: dict[str, Any] = {}
    chunks = STEP_TOKENS // CHUNK
    blocks = CHUNK // BLOCK
    cases = [(s, sink) for s in SHAPES for sink in sinks]
    for shape, sink in cases:
        summed = sink != "views"
        layout, kv = _caches(shape, 1024)
        compute = torch.cuda.Stream()
        torch.cuda.set_stream(compute)
        tier_bytes = int(cpu_tier_gib * (1 << 30))
        store: Any = (
            _TieredSink(tier_bytes, layout.payload_nbytes(blocks) if sink == "slab" else None)
            if sink in ("cpu", "slab")
            else _Store(checksum=summed)
        )
        copier = BlockCopier(
            layout,
            kv,
            max_blocks=blocks,
            save_buffers=2 * (chunks + 1),
            compute_stream=lambda c=compute: c,
        )
        worker = WorkerSide(store, copier, timeout_secs=30, save_wait_secs=0.005)  # type: ignore[arg-type]
        rng = random.Random(3)
        host_times = []
        total_chunks = 0
        t_start = None
        probe = None
        for step in range(steps + 2):  # two warm-up steps
            ids = rng.sample(range(1024), chunks * blocks)
            hashes = chunk_hashes([step * STEP_TOKENS + t for t in range(STEP_TOKENS)], CHUNK)
            specs = [
                SaveSpec(f"r{step}", hashes[k], tuple(ids[k * blocks : (k + 1) * blocks]), CHUNK)
                for k in range(chunks)
            ]
            with torch.cuda.stream(compute):  # the step's forward, still running
                torch.cuda._sleep(int(forward_ms * 1.98e6) if forward_ms else 2_000_000)
            if step == 2:
                # The warm-up's saves reached the store (or were dropped: counted apart).
                warm = 2 * chunks - int(worker.take_stats().get("save_dropped_chunks", 0))
                with store.done:
                    store.done.wait_for(lambda s=store, n=warm: s.saved_chunks >= n, 60)
                torch.cuda.synchronize()
                t_start = time.perf_counter()
                base = store.saved_chunks
                probe = _GilProbe()
            t0 = time.perf_counter()
            worker.save(specs)
            if step >= 2:
                host_times.append(time.perf_counter() - t0)
                total_chunks += chunks
            if forward_ms:
                compute.synchronize()  # vLLM waits for the step's output
        stats = worker.take_stats()
        dropped = int(stats.get("save_dropped_chunks", 0))
        with store.done:
            store.done.wait_for(
                lambda s=store, n=base + total_chunks - dropped: s.saved_chunks >= n, 120
            )
        elapsed = time.perf_counter() - t_start  # type: ignore[operator]
        gil = probe.stop() if probe is not None else {}
        nbytes = layout.payload_nbytes(blocks)
        total_chunks -= dropped  # the rate is of what was saved
        # The forwards' sleeps are on the compute stream, not the copy stream: the copies run
        # beside them; the plain copy has no such wait, so the ratio is conservative.
        plain = _plain(nbytes, total_chunks, to_host=True)
        rate = total_chunks * nbytes / elapsed / 1e9
        plain_rate = total_chunks * nbytes / plain / 1e9
        name = shape if sink == "views" else f"{shape} +{sink}"
        out[name] = {
            "forward_ms": forward_ms,
            "checksum_in_sink": summed,
            "sink": sink,
            "cpu_tier_gib": cpu_tier_gib if sink in ("cpu", "slab") else 0,
            **gil,
            "chunk_bytes": nbytes,
            "step_bytes": chunks * nbytes,
            "steps": steps,
            "host_ms_median": 1000 * statistics.median(host_times),
            "host_ms_max": 1000 * max(host_times),
            "host_ms_steps": [round(1000 * t, 3) for t in host_times],
            "saved_GBps": rate,
            "plain_d2h_GBps": plain_rate,
            "ratio": rate / plain_rate,
            "lent_views_only": store.lent_views,
            "dropped_chunks": dropped,
        }
        print(f"saves {name}: {out[name]}", flush=True)
        worker.close(30)
        copier.close()
        torch.cuda.set_stream(torch.cuda.default_stream())
        del kv
        torch.cuda.empty_cache()
    return out


def loads(reps: int) -> dict[str, Any]:
    import torch

    from kvtier.vllm.blockcopy.copier import BlockCopier

    out: dict[str, Any] = {}
    chunks = STEP_TOKENS // CHUNK
    blocks = CHUNK // BLOCK
    for shape in SHAPES:
        layout, kv = _caches(shape, 1024)
        compute = torch.cuda.Stream()
        torch.cuda.set_stream(compute)
        copier = BlockCopier(layout, kv, max_blocks=blocks, compute_stream=lambda c=compute: c)
        rng = random.Random(4)
        nbytes = layout.payload_nbytes(blocks)
        payloads = [bytes(rng.randbytes(nbytes)) for _ in range(4)]
        times = []
        for _ in range(reps + 1):
            ids = rng.sample(range(1024), chunks * blocks)
            items = [
                (payloads[k % 4], blocks, 0, ids[k * blocks : (k + 1) * blocks])
                for k in range(chunks)
            ]
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            copier.scatter_many(items)
            compute.synchronize()
            times.append(time.perf_counter() - t0)
        took = statistics.median(times[1:])
        plain = _plain(nbytes, chunks, to_host=False)
        from kvtier.vllm.blockcopy.cuda import _parallel_copy

        pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        src = torch.frombuffer(bytearray(payloads[0]), dtype=torch.uint8)
        t0 = time.perf_counter()
        for _ in range(8):
            _parallel_copy(pinned, src)
        bounce = 8 * nbytes / (time.perf_counter() - t0) / 1e9
        slab_took = _loads_from_slab(copier, compute, payloads, blocks, chunks, reps, rng)
        disk = {
            kind: _loads_from_disk(copier, compute, payloads, blocks, chunks, reps, rng, kind)
            for kind in ("bytes", "slab")
        }
        out[shape] = {
            "chunk_bytes": nbytes,
            "chunks": chunks,
            "load_GBps": chunks * nbytes / took / 1e9,
            "plain_h2d_GBps": chunks * nbytes / plain / 1e9,
            "ratio": plain / took,
            "bounce_GBps": bounce,
            "slab_load_GBps": chunks * nbytes / slab_took / 1e9,
            "slab_ratio": plain / slab_took,
            **{f"disk_via_{k}_GBps": chunks * nbytes / t / 1e9 for k, t in disk.items()},
        }
        print(f"loads {shape}: {out[shape]}", flush=True)
        copier.close()
        torch.cuda.set_stream(torch.cuda.default_stream())
        del kv
        torch.cuda.empty_cache()
    return out


def _loads_from_slab(
    copier: Any,
    compute: Any,
    payloads: Sequence[bytes],
    blocks: int,
    chunks: int,
    reps: int,
    rng: random.Random,
) -> float:
    """Median seconds of `scatter_many` of ``chunks`` chunks read from the connector's CPU
    tier (a pinned slab: `kvtier.tiers.cpu.CpuSlabTier`), as `loads` times the pageable ones."""
    import torch

    from kvtier.tiers.cpu import CpuSlabTier
    from kvtier.vllm.blockcopy.pinned import pin_host_region

    nbytes = len(payloads[0])
    tier = CpuSlabTier(chunks * nbytes, nbytes, pin_host_region)
    for k in range(chunks):
        tier.put(f"c{k}", b"", payloads[k % len(payloads)])
    times = []
    for _ in range(reps + 1):
        got = [tier.get(f"c{k}") for k in range(chunks)]
        ids = rng.sample(range(1024), chunks * blocks)
        items = [
            (g[1], blocks, 0, ids[k * blocks : (k + 1) * blocks])
            for k, g in enumerate(got)
            if g is not None
        ]
        assert len(items) == chunks
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        copier.scatter_many(items)
        compute.synchronize()
        times.append(time.perf_counter() - t0)
        del got, items
    torch.cuda.synchronize()
    tier.close()
    return statistics.median(times[1:])


def _loads_from_disk(
    copier: Any,
    compute: Any,
    payloads: Sequence[bytes],
    blocks: int,
    chunks: int,
    reps: int,
    rng: random.Random,
    cpu_kind: str,
) -> float:
    """Median seconds of a whole load of ``chunks`` chunks that the disk tier holds (in the page
    cache) through the real store: `get_many` (read, verify, promote into the CPU tier) then
    `scatter_many`. ``cpu_kind`` "bytes": the CPU tier before the slab (the payload read from
    disk bounces through a pinned slot); "slab": the connector's pinned slab (the load goes
    from the promoted copy, no bounce)."""
    import shutil
    import tempfile

    import torch

    from kvtier.keys import chunk_hashes
    from kvtier.store import TieredStore
    from kvtier.tiers.cpu import CpuSlabTier, CpuTier
    from kvtier.tiers.disk import DiskTier
    from kvtier.vllm.blockcopy.pinned import pin_host_region

    nbytes = len(payloads[0])
    root = tempfile.mkdtemp(prefix="kvtier-bench-disk-")
    cpu = (
        CpuTier(chunks * 2 * nbytes)
        if cpu_kind == "bytes"
        else CpuSlabTier(chunks * 2 * nbytes, nbytes, pin_host_region)
    )
    store = TieredStore([cpu, DiskTier(root, chunks * 2 * nbytes)], "00" * 16)
    hashes = chunk_hashes(list(range(chunks * CHUNK)), CHUNK)
    for k, h in enumerate(hashes):
        store.put(h, payloads[k % len(payloads)], CHUNK)
    store.flush(120)
    times = []
    for _ in range(reps + 1):
        for h in hashes:
            cpu.delete(store.key(h))  # from disk each time
        ids = rng.sample(range(1024), chunks * blocks)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        got = store.get_many(hashes)
        items = [(g, blocks, 0, ids[k * blocks : (k + 1) * blocks]) for k, g in enumerate(got)]
        copier.scatter_many(items)
        compute.synchronize()
        times.append(time.perf_counter() - t0)
        del got, items
    torch.cuda.synchronize()
    store.close()
    shutil.rmtree(root, ignore_errors=True)
    return statistics.median(times[1:])


def lone(reps: int) -> dict[str, Any]:
    import torch

    from kvtier.vllm.blockcopy.copier import BlockCopier

    layout, kv = _caches("7B", 1024)
    blocks = CHUNK // BLOCK
    copier = BlockCopier(layout, kv, max_blocks=blocks)
    rng = random.Random(6)
    nbytes = layout.payload_nbytes(blocks)
    gathers, scatters = [], []
    for _ in range(reps + 3):
        ids = rng.sample(range(1024), blocks)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        buf = copier.gather_to_host(ids)
        buf.view()
        gathers.append(time.perf_counter() - t0)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        copier.scatter_many([(buf, blocks, 0, ids)])
        torch.cuda.current_stream().synchronize()
        scatters.append(time.perf_counter() - t0)
        buf.release()
    d2h = _plain(nbytes, 1, to_host=True)
    h2d = _plain(nbytes, 1, to_host=False)
    g, s = statistics.median(gathers[3:]), statistics.median(scatters[3:])
    out = {
        "chunk_bytes": nbytes,
        "gather_GBps": nbytes / g / 1e9,
        "gather_ratio": d2h / g,
        "scatter_GBps": nbytes / s / 1e9,
        "scatter_ratio": h2d / s,
        "plain_d2h_GBps": nbytes / d2h / 1e9,
        "plain_h2d_GBps": nbytes / h2d / 1e9,
    }
    print(f"lone 7B chunk: {out}", flush=True)
    copier.close()
    return out


def fp8() -> dict[str, Any]:
    import torch

    from kvtier.vllm.blockcopy.copier import BlockCopier

    layout, src = _caches("7B", 256, torch.uint8)
    _, dst = _caches("7B", 256, torch.uint8)
    rng = random.Random(8)
    exact = 0
    for _ in range(20):
        ids = rng.sample(range(256), 16)
        target = rng.sample(range(256), 16)
        payload = BlockCopier(layout, src).gather(ids)
        BlockCopier(layout, dst).scatter(payload, 16, 0, target)
        torch.cuda.synchronize()
        exact += all(torch.equal(d[target], s[ids]) for d, s in zip(dst, src, strict=True))
    out = {
        "round_trips": 20,
        "bit_exact": exact,
        "dtype": layout.dtype,
        "fingerprint_differs": True,
    }
    bf16 = _layout(*SHAPES["7B"])
    out["fingerprint_differs"] = (
        layout.fingerprint("m", 256, 0, 1, 1).digest()
        != bf16.fingerprint("m", 256, 0, 1, 1).digest()
    )
    print(f"fp8: {out}", flush=True)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path)
    ap.add_argument("--iters", type=int, default=1000)
    ap.add_argument("--sleep-cycles", type=int, default=20_000_000)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--forward-ms", type=float, default=0.0)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--only", nargs="*", default=["order", "saves", "loads", "lone", "fp8"])
    ap.add_argument("--sinks", nargs="*", default=list(SINKS), choices=SINKS)
    ap.add_argument("--cpu-tier-gib", type=float, default=16.0)
    ap.add_argument("--plot", type=Path)
    ap.add_argument("--plot-steps", type=Path, nargs=2, metavar=("BEFORE", "AFTER"))
    ap.add_argument("--plot-cpu-tiers", type=Path, nargs="+", metavar="SAVES... LOADS")
    ap.add_argument("--png", type=Path)
    args = ap.parse_args()
    if args.plot:
        return _plot(args.plot, args.png)
    if args.plot_cpu_tiers:
        return _plot_cpu_tiers(args.plot_cpu_tiers[:-1], args.plot_cpu_tiers[-1], args.png)
    if args.plot_steps:
        return _plot_steps(*args.plot_steps, args.png)
    import torch

    result: dict[str, Any] = {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "when": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    runs = {
        "order": lambda: stream_order(args.iters, args.sleep_cycles),
        "saves": lambda: saves(args.steps, args.forward_ms, args.sinks, args.cpu_tier_gib),
        "loads": lambda: loads(args.reps),
        "lone": lambda: lone(30),
        "fp8": fp8,
    }
    for name in args.only:
        try:
            result[name] = runs[name]()
        except Exception as exc:  # one part failing still reports the others
            import traceback

            traceback.print_exc()
            result[name] = {"error": repr(exc)}
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "bench_gpu_paths.json").write_text(json.dumps(result, indent=2))
    return 0


def _plot(src: Path, png: Path | None) -> int:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    r = json.loads(src.read_text())
    fig, ax = plt.subplots(figsize=(8, 4))
    labels, ours, plain = [], [], []
    for shape in SHAPES:
        for name in (shape, f"{shape} +checksum", f"{shape} +cpu"):
            if name in r.get("saves", {}):
                labels.append(f"save {name}")
                ours.append(r["saves"][name]["saved_GBps"])
                plain.append(r["saves"][name]["plain_d2h_GBps"])
        if shape in r.get("loads", {}):
            labels.append(f"load {shape}")
            ours.append(r["loads"][shape]["load_GBps"])
            plain.append(r["loads"][shape]["plain_h2d_GBps"])
    x = range(len(labels))
    ax.bar([i - 0.2 for i in x], plain, 0.4, label="plain pinned copy")
    ax.bar([i + 0.2 for i in x], ours, 0.4, label="kvtier (8K-token steps, streamed)")
    ax.set_xticks(list(x), labels)
    ax.set_ylabel("GB/s")
    ax.set_title(f"kvtier GPU paths on {r.get('gpu', '?')} ({r.get('when', '')})")
    ax.legend()
    fig.tight_layout()
    fig.savefig(png or src.with_suffix(".png"))
    return 0


def _plot_steps(before: Path, after: Path, png: Path | None) -> int:
    """Host time of each save step (``saves`` with ``--forward-ms``), two runs side by side."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = {path.parent.name: json.loads(path.read_text())["saves"] for path in (before, after)}
    names = [n for n in next(iter(runs.values())) if all(n in r for r in runs.values())]
    fig, axes = plt.subplots(1, len(names), figsize=(4 * len(names), 3.5), sharey=True)
    for ax, name in zip(axes, names, strict=True):
        for label, saves in runs.items():
            ax.plot(saves[name]["host_ms_steps"], marker=".", label=label)
        ax.set_title(name)
        ax.set_xlabel("step")
        ax.set_yscale("log")
    axes[0].set_ylabel("host ms in wait_for_save")
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(png or after.with_suffix(".steps.png"))
    return 0


def _plot_cpu_tiers(saves_runs: Sequence[Path], loads_run: Path, png: Path | None) -> int:
    """The CPU tier before and with the slab: each saves run's rate (bars, GB/s), and the
    loads' rates from pageable payloads, from the slab and through the store from disk."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(saves_runs) + 1, figsize=(4.5 * (len(saves_runs) + 1), 3.8))
    for ax, path in zip(axes, saves_runs, strict=False):
        saves = json.loads(path.read_text())["saves"]
        names = list(saves)
        ax.bar(names, [saves[n]["saved_GBps"] for n in names])
        for i, n in enumerate(names):
            ax.annotate(f"{saves[n]['dropped_chunks']} dropped", (i, saves[n]["saved_GBps"]))
        forward = saves[names[0]]["forward_ms"]
        ax.set_title(f"saves, {forward:.0f} ms forwards" if forward else "saves, back to back")
        ax.set_ylabel("GB/s saved")
        ax.tick_params(axis="x", rotation=30)
    loads = json.loads(loads_run.read_text())["loads"]
    kinds = {
        "plain pinned H2D": "plain_h2d_GBps",
        "pageable (bounce)": "load_GBps",
        "CPU slab": "slab_load_GBps",
        "disk via bytes tier": "disk_via_bytes_GBps",
        "disk via slab": "disk_via_slab_GBps",
    }
    ax = axes[-1]
    width = 0.8 / len(kinds)
    for k, (label, key) in enumerate(kinds.items()):
        ax.bar(
            [i + k * width for i in range(len(loads))],
            [loads[shape][key] for shape in loads],
            width,
            label=label,
        )
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(loads))], list(loads))
    ax.set_title("loads, 32 chunks")
    ax.set_ylabel("GB/s")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(png or loads_run.with_suffix(".tiers.png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
