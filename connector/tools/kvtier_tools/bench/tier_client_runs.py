"""The measurements of `kvtier bench store` (:mod:`kvtier_tools.bench.tier_clients`): each client on
the same bytes, one :class:`Cell` per (client, object size, operation): MiB/s and client CPU-s
per GiB.
"""

from __future__ import annotations

import os
import resource
import statistics
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from kvtier.config import KvtierConfig
from kvtier.keys import chunk_hashes
from kvtier.store import TieredStore
from kvtier.tiers.base import Tier

_MIB = 1024 * 1024
_FP = "b" * 32
#: (PUT, GET) of one client, each returning its error count.
_Runs = dict[str, tuple[Callable[[], int], Callable[[], int]]]


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
            runs = _s3_runs(bench, size, n, threads, kvtier_threads, stores)
            cells += _interleaved(runs, size, n * size, reps)
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


def _s3_runs(
    bench: S3Bench,
    size: int,
    n: int,
    threads: list[int],
    kvtier_threads: int,
    stores: list[tuple[str, TieredStore]],
) -> _Runs:
    """Every client's runs over ``n`` objects of ``size`` bytes, each client warmed up first;
    kvtier's stores are appended to ``stores`` (the caller closes them)."""
    body = os.urandom(size)
    payload = body[: size - 64] if size > 64 else b"x"
    hashes = chunk_hashes(list(range(n * 4)), 4)
    warm_hashes = chunk_hashes(list(range(10**6, 10**6 + 4 * 8)), 4)
    # warm up (pool creation, connections) outside the timings, for every client
    warm = bench.keys(f"warm-{size}", 8)
    bench.boto3_run("put", warm, body, 8)
    bench.boto3_run("get", warm, body, 8)
    bench.crt_run("get", warm, body)
    runs: _Runs = {}
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
            bench.cfg, client, f"{bench.prefix}/kv-{client}-{size}", kvtier_threads
        )
        stores.append((client, store))
        _put_all(store, warm_hashes, payload)  # connections up, as for the raw clients
        _get_all(store, warm_hashes)
        runs[f"kvtier s3 ({client})"] = (
            partial(_put_all, store, hashes, payload),
            partial(_get_all, store, hashes),
        )
    return runs


def _interleaved(runs: _Runs, size: int, nbytes: int, reps: int) -> list[Cell]:
    """PUTs of every client, ``reps`` rounds of one run each, then the GETs the same way."""
    cells: list[Cell] = []
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
