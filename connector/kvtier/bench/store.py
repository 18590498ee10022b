"""`kvtier bench store`: the S3 and disk tiers against raw clients, side by side in one run.

For each object size, on the same RGW and the same bytes:

* raw boto3 ``put_object``/``get_object`` from 8/16/32/64 threads,
* raw awscrt ``S3Client`` with every request in flight at once,
* kvtier's S3 tier through ``TieredStore`` (``put`` + ``flush``, then ``get_many``), with the
  boto3 and the crt client: this includes kvtier's header, checksum and copies;
* the disk tier (``get_many`` on a disk-only store) against a plain sequential read of the same
  files, both from cold page cache (``posix_fadvise(DONTNEED)`` per file) and warm.

Each cell reports MiB/s and client CPU-seconds per GiB (``getrusage``, all threads of this
process; the 2 cores are shared with RGW, so CPU/GiB is the portable figure). Output: a table,
a JSON file, and a PNG plot when matplotlib is installed.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from functools import partial
from typing import Any

from kvtier.bench.plot import NO_MATPLOTLIB, pyplot, save
from kvtier.config import ConfigError, KvtierConfig, load_config
from kvtier.keys import chunk_hashes
from kvtier.store import TieredStore
from kvtier.tiers.base import Tier

_MIB = 1024 * 1024
_FP = "b" * 32


@dataclass
class Cell:
    """One measured (client, size, op)."""

    client: str
    size: int
    op: str
    mib_s: float
    cpu_s_per_gib: float
    runs: list[float] = field(default_factory=list)
    errors: int = 0


def _cpu() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def _measure(
    fn: Callable[[], int], nbytes: int, reps: int
) -> tuple[float, float, list[float], int]:
    """Median MiB/s and CPU-s/GiB over ``reps`` runs of ``fn`` (which returns its error count)."""
    speeds, cpus, errors = [], [], 0
    for _ in range(reps):
        c0, t0 = _cpu(), time.perf_counter()
        errors += fn()
        dt, dc = time.perf_counter() - t0, _cpu() - c0
        speeds.append(nbytes / _MIB / dt)
        cpus.append(dc / (nbytes / 1024**3))
    return statistics.median(speeds), statistics.median(cpus), speeds, errors


def _parse_size(text: str) -> int:
    units = {"K": 1024, "M": _MIB, "G": 1024**3}
    text = text.strip().upper().removesuffix("IB").removesuffix("B")
    if text and text[-1] in units:
        return int(float(text[:-1]) * units[text[-1]])
    return int(text)


class S3Bench:
    def __init__(self, cfg: KvtierConfig, run_prefix: str) -> None:
        from kvtier.tiers.s3_boto3 import make_boto3_client

        self.cfg = cfg
        self.bucket = cfg.s3_bucket or ""
        self.prefix = run_prefix
        self.client = make_boto3_client(cfg, pool=128)
        self._crt: Any = None

    def keys(self, label: str, n: int) -> list[str]:
        return [f"{self.prefix}/{label}/{i:06d}" for i in range(n)]

    def boto3_run(self, op: str, keys: list[str], body: bytes, threads: int) -> int:
        errors = 0
        lock = threading.Lock()

        def one(key: str) -> None:
            nonlocal errors
            try:
                if op == "put":
                    self.client.put_object(Bucket=self.bucket, Key=key, Body=body)
                else:
                    resp = self.client.get_object(Bucket=self.bucket, Key=key)
                    if len(resp["Body"].read()) != len(body):
                        raise ValueError("short read")
            except Exception:  # counted: a benchmark reports failures instead of stopping
                with lock:
                    errors += 1

        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(one, keys))
        return errors

    def crt_run(self, op: str, keys: list[str], body: bytes) -> int:
        if self._crt is None:  # created once, outside the timed runs
            from kvtier.tiers.s3_crt import CrtS3Tier

            self._crt = CrtS3Tier.from_config(self.cfg)
        errors: int = self._crt.raw_batch(op, keys, body)
        return errors

    def close(self) -> None:
        if self._crt is not None:
            self._crt.close()

    def delete(self, keys: list[str]) -> None:
        for i in range(0, len(keys), 1000):
            batch = [{"Key": k} for k in keys[i : i + 1000]]
            self.client.delete_objects(Bucket=self.bucket, Delete={"Objects": batch, "Quiet": True})


def _kvtier_s3_store(cfg: KvtierConfig, client: str, prefix: str, threads: int) -> TieredStore:
    """A store with only the S3 tier, writing under ``prefix`` (a full key prefix)."""
    from kvtier.tiers.s3 import make_s3_tier

    extra = cfg.extra_config.model_copy(
        update={"s3_file_prefix": "", "s3_max_io_concurrency": threads}
    )
    sub = cfg.model_copy(
        update={
            "s3_client": client,
            "remote_url": f"s3://{cfg.s3_bucket}/{prefix}",
            "extra_config": extra,
        }
    )
    tier: Tier = make_s3_tier(sub)
    return TieredStore([tier], _FP, io_threads=threads, max_inflight_writes=1 << 20)


def run_s3(
    cfg: KvtierConfig,
    sizes: list[int],
    total: int,
    threads: list[int],
    reps: int,
    kvtier_threads: int,
) -> list[Cell]:
    """All clients, interleaved: each repetition runs every client once, PUTs first, then GETs,
    so that drift in the cluster (compaction after writes, cache) hits all clients alike."""
    # Everything this run writes lives under one prefix (inside the config's own prefix) and is
    # deleted at the end. RGW frees deleted data only when its garbage collector runs
    # (rgw_gc_obj_min_wait, 2 h by default): keep --total modest on a small cluster.
    run_prefix = "/".join(p for p in (cfg.s3_prefix, f"kvtier-bench/{uuid.uuid4().hex[:8]}") if p)
    bench = S3Bench(cfg, run_prefix)
    cells: list[Cell] = []
    stores: list[tuple[str, TieredStore]] = []
    try:
        for size in sizes:
            n = max(4, total // size)
            nbytes = n * size
            body = os.urandom(size)
            payload = body[: size - 64] if size > 64 else b"x"
            hashes = chunk_hashes(list(range(n * 4)), 4)
            warm_hashes = chunk_hashes(list(range(10**6, 10**6 + 4 * 8)), 4)
            # warm up (pool creation, connections) outside the timings, for every client
            warm = bench.keys(f"warm-{size}", 8)
            bench.boto3_run("put", warm, body, 8)
            bench.boto3_run("get", warm, body, 8)
            bench.crt_run("get", warm, body)
            runs: dict[str, tuple[Callable[[], int], Callable[[], int]]] = {}
            for t in threads:
                keys = bench.keys(f"boto3-{t}-{size}", n)
                runs[f"raw boto3 {t} thr"] = (
                    partial(bench.boto3_run, "put", keys, body, t),
                    partial(bench.boto3_run, "get", keys, body, t),
                )
            keys = bench.keys(f"crt-{size}", n)
            runs["raw awscrt"] = (
                partial(bench.crt_run, "put", keys, body),
                partial(bench.crt_run, "get", keys, body),
            )
            for client in ("boto3", "crt", "auto"):
                store = _kvtier_s3_store(
                    cfg, client, f"{run_prefix}/kv-{client}-{size}", kvtier_threads
                )
                stores.append((client, store))
                _put_all(store, warm_hashes, payload)  # connections up, as for the raw clients
                _get_all(store, warm_hashes)
                runs[f"kvtier s3 ({client})"] = (
                    partial(_put_all, store, hashes, payload),
                    partial(_get_all, store, hashes),
                )
            for op_index, op in enumerate(("put", "get")):
                speeds: dict[str, list[float]] = {name: [] for name in runs}
                cpus: dict[str, list[float]] = {name: [] for name in runs}
                errors = dict.fromkeys(runs, 0)
                for _ in range(reps):
                    for name, fns in runs.items():
                        mib, cpu, _, err = _measure(fns[op_index], nbytes, 1)
                        speeds[name].append(mib)
                        cpus[name].append(cpu)
                        errors[name] += err
                for name in runs:
                    cells.append(
                        Cell(
                            name,
                            size,
                            op,
                            statistics.median(speeds[name]),
                            statistics.median(cpus[name]),
                            speeds[name],
                            errors[name],
                        )
                    )
            for client, store in stores:  # tier errors (any cause) count as benchmark errors
                failed = sum(sum(t.errors.values()) for t in store.stats().tiers.values())
                if failed:
                    cells.append(Cell(f"kvtier s3 ({client})", size, "errors", 0, 0, [], failed))
                store.close()
            stores.clear()
    finally:
        for _, store in stores:
            store.close()
        bench.close()
        try:
            _purge_prefix(bench, run_prefix)
        except Exception as exc:  # report what is left rather than hide the results
            print(
                f"warning: could not delete the benchmark objects under "
                f"s3://{bench.bucket}/{run_prefix}/: {exc}",
                file=sys.stderr,
            )
    return cells


def _purge_prefix(bench: S3Bench, prefix: str) -> None:
    paginator = bench.client.get_paginator("list_objects_v2")
    for page in paginator.paginate(Bucket=bench.bucket, Prefix=prefix + "/"):
        keys = [o["Key"] for o in page.get("Contents", [])]
        if keys:
            bench.delete(keys)


def _put_all(store: TieredStore, hashes: list[str], payload: bytes) -> int:
    for h in hashes:
        store.put(h, payload, 256)
    return 0 if store.flush(600) else 1


def _get_all(store: TieredStore, hashes: list[str]) -> int:
    return sum(p is None for p in store.get_many(hashes))


def _read_files(paths: list[str]) -> int:
    """The raw baseline: read each file whole, one after the other."""
    for p in paths:
        with open(p, "rb") as f:
            f.read()
    return 0


def _drop_cache(paths: list[str]) -> None:
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def run_disk(directory: str, sizes: list[int], total: int, reps: int) -> list[Cell]:
    from kvtier.tiers.disk import DiskTier

    cells: list[Cell] = []
    for size in sizes:
        n = max(4, total // size)
        nbytes = n * size
        with tempfile.TemporaryDirectory(dir=directory, prefix="kvtier-bench-") as root:
            tier = DiskTier(root, 2 * nbytes + (64 << 20))
            store = TieredStore([tier], _FP, io_threads=4)
            payload = os.urandom(size - 64)
            hashes = chunk_hashes(list(range(n * 4)), 4)
            mib, cpu, runs, err = _measure(partial(_put_all, store, hashes, payload), nbytes, 1)
            cells.append(Cell("kvtier disk", size, "put", mib, cpu, runs, err))
            paths = [tier._path(store.key(h)) for h in hashes]
            raw_read = partial(_read_files, paths)
            kv_read = partial(_get_all, store, hashes)
            for cache in ("cold", "warm"):
                for label, fn in (("raw sequential read", raw_read), ("kvtier disk", kv_read)):
                    speeds, cpus = [], []
                    for _ in range(reps):
                        if cache == "cold":
                            _drop_cache(paths)
                        mib, cpu, _, err = _measure(fn, nbytes, 1)
                        speeds.append(mib)
                        cpus.append(cpu)
                    cells.append(
                        Cell(
                            label,
                            size,
                            f"get {cache}",
                            statistics.median(speeds),
                            statistics.median(cpus),
                            speeds,
                            err,
                        )
                    )
            store.close()
    return cells


def _table(cells: list[Cell]) -> str:
    lines = [f"{'client':24} {'size':>7} {'op':9} {'MiB/s':>8} {'CPU s/GiB':>10} {'errors':>6}"]
    for c in cells:
        size = f"{c.size // _MIB}M" if c.size >= _MIB else f"{c.size // 1024}K"
        lines.append(
            f"{c.client:24} {size:>7} {c.op:9} {c.mib_s:8.0f} {c.cpu_s_per_gib:10.2f} {c.errors:6}"
        )
    return "\n".join(lines)


def _ratios(cells: list[Cell], kvtier_threads: int) -> list[dict[str, Any]]:
    """kvtier vs the best raw client per (size, op), and kvtier's boto3 tier vs raw boto3 at the
    same thread count (the like-for-like overhead of kvtier itself)."""
    out = []
    for size in sorted({c.size for c in cells}):
        for op in ("put", "get"):
            raw = [c for c in cells if c.size == size and c.op == op and c.client.startswith("raw")]
            mine = [
                c
                for c in cells
                if c.size == size and c.op == op and c.client.startswith("kvtier s3")
            ]
            if raw and mine:
                best = max(raw, key=lambda c: c.mib_s)
                kv = max(mine, key=lambda c: c.mib_s)
                same = next((c for c in raw if c.client == f"raw boto3 {kvtier_threads} thr"), None)
                kv_boto3 = next((c for c in mine if c.client == "kvtier s3 (boto3)"), None)
                out.append(
                    {
                        "size": size,
                        "op": op,
                        "best_raw": best.client,
                        "best_raw_mib_s": best.mib_s,
                        "kvtier": kv.client,
                        "kvtier_mib_s": kv.mib_s,
                        "ratio": kv.mib_s / best.mib_s,
                        "boto3_same_threads_ratio": (
                            kv_boto3.mib_s / same.mib_s if same and kv_boto3 else None
                        ),
                    }
                )
    return out


def _plot(cells: list[Cell], path: str) -> str | None:
    plt = pyplot()
    if plt is None:
        return None
    groups = sorted({(c.size, c.op) for c in cells})
    fig, axes = plt.subplots(1, len(groups), figsize=(4 * len(groups), 4), squeeze=False)
    for ax, (size, op) in zip(axes[0], groups, strict=True):
        sel = [c for c in cells if c.size == size and c.op == op]
        ax.barh([c.client for c in sel], [c.mib_s for c in sel])
        ax.set_title(f"{op} {size // 1024} KiB objects")
        ax.set_xlabel("MiB/s")
    return save(plt, fig, path)


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("store", help="S3 and disk tiers vs raw clients (table + JSON)")
    p.add_argument(
        "--config", help="kvtier YAML file with remote_url/endpoint (default: $KVTIER_CONFIG)"
    )
    p.add_argument("--sizes", default="1M,16M", help="object sizes, e.g. 1M,16M")
    p.add_argument("--total", default="256M", help="bytes per cell")
    p.add_argument("--threads", default="8,16,32,64", help="raw boto3 thread counts")
    p.add_argument("--kvtier-threads", type=int, default=32, help="kvtier io threads")
    p.add_argument("--reps", type=int, default=3, help="runs per cell (median reported)")
    p.add_argument(
        "--disk-dir",
        default=None,
        help="directory for the disk tier runs "
        "(default: the config's local_disk, else the temp dir)",
    )
    p.add_argument("--no-s3", action="store_true", help="skip the S3 runs")
    p.add_argument("--out", default="reports", help="directory for JSON and PNG")
    p.add_argument(
        "--quick",
        action="store_true",
        help="CI mode: 1M objects, 16 MiB per cell, 16/32 threads, 1 run",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    sizes = [_parse_size(s) for s in args.sizes.split(",")]
    total, threads, reps = (
        _parse_size(args.total),
        [int(t) for t in args.threads.split(",")],
        args.reps,
    )
    if args.quick:
        sizes, total, threads, reps = [_MIB], 16 * _MIB, [16, 32], 1
    cfg: KvtierConfig | None = None
    try:
        cfg = load_config(args.config)
    except ConfigError as exc:
        if not args.no_s3 or args.config:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    cells: list[Cell] = []
    if not args.no_s3:
        if cfg is None or not cfg.remote_url:
            print(
                "error: the S3 runs need remote_url in the config (or pass --no-s3)",
                file=sys.stderr,
            )
            return 2
        cells += run_s3(cfg, sizes, total, threads, reps, args.kvtier_threads)
    disk_dir = args.disk_dir or (
        cfg.local_disk if cfg and cfg.local_disk else tempfile.gettempdir()
    )
    os.makedirs(disk_dir, exist_ok=True)
    cells += run_disk(disk_dir, sizes, total, reps)
    print(_table(cells))
    ratios = _ratios(cells, args.kvtier_threads)
    for r in ratios:
        print(
            f"{r['op']} {r['size'] // 1024} KiB: {r['kvtier']} {r['kvtier_mib_s']:.0f} MiB/s = "
            f"{100 * r['ratio']:.0f} % of best raw ({r['best_raw']}, {r['best_raw_mib_s']:.0f})"
            + (
                f"; kvtier boto3 vs raw boto3 at {args.kvtier_threads} threads: "
                f"{100 * r['boto3_same_threads_ratio']:.0f} %"
                if r["boto3_same_threads_ratio"]
                else ""
            )
        )
    os.makedirs(args.out, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    doc = {
        "command": " ".join(["kvtier", *sys.argv[1:]]),
        "machine": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
        },
        "params": {
            "sizes": sizes,
            "total": total,
            "threads": threads,
            "reps": reps,
            "kvtier_threads": args.kvtier_threads,
        },
        "cells": [asdict(c) for c in cells],
        "ratios": ratios,
    }
    path = os.path.join(args.out, f"bench-store-{stamp}.json")
    with open(path, "w", encoding="utf-8") as f:
        json.dump(doc, f, indent=1)
    print(f"JSON: {path}")
    png = _plot(cells, os.path.join(args.out, f"bench-store-{stamp}.png"))
    print(f"plot: {png}" if png else NO_MATPLOTLIB)
    failed = sum(c.errors for c in cells)
    return 1 if failed else 0
