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
import sys
import tempfile
import time
from dataclasses import asdict
from typing import Any

from kvtier.config import ConfigError, KvtierConfig, load_config
from kvtier_tools.bench.plot import NO_MATPLOTLIB, pyplot, save
from kvtier_tools.bench.tier_client_runs import Cell, run_disk, run_s3

_MIB = 1024 * 1024


def _parse_size(text: str) -> int:
    units = {"K": 1024, "M": _MIB, "G": 1024**3}
    text = text.strip().upper().removesuffix("IB").removesuffix("B")
    if text and text[-1] in units:
        return int(float(text[:-1]) * units[text[-1]])
    return int(text)


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
    _print_ratios(ratios, args.kvtier_threads)
    params = {"sizes": sizes, "total": total, "threads": threads, "reps": reps}
    _write_report(args.out, cells, ratios, {**params, "kvtier_threads": args.kvtier_threads})
    failed = sum(c.errors for c in cells)
    return 1 if failed else 0


def _print_ratios(ratios: list[dict[str, Any]], kvtier_threads: int) -> None:
    for r in ratios:
        print(
            f"{r['op']} {r['size'] // 1024} KiB: {r['kvtier']} {r['kvtier_mib_s']:.0f} MiB/s = "
            f"{100 * r['ratio']:.0f} % of best raw ({r['best_raw']}, {r['best_raw_mib_s']:.0f})"
            + (
                f"; kvtier boto3 vs raw boto3 at {kvtier_threads} threads: "
                f"{100 * r['boto3_same_threads_ratio']:.0f} %"
                if r["boto3_same_threads_ratio"]
                else ""
            )
        )


def _write_report(
    out: str, cells: list[Cell], ratios: list[dict[str, Any]], params: dict[str, Any]
) -> None:
    """``bench-store-<time>.json`` and its PNG in ``out``."""
    os.makedirs(out, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    doc = {
        "command": " ".join(["kvtier", *sys.argv[1:]]),
        "machine": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
        },
        "params": params,
        "cells": [asdict(c) for c in cells],
        "ratios": ratios,
    }
    path = os.path.join(out, f"bench-store-{stamp}.json")
    with open(path, "w", encoding="utf-8") as f:
        json.dump(doc, f, indent=1)
    print(f"JSON: {path}")
    png = _plot(cells, os.path.join(out, f"bench-store-{stamp}.png"))
    print(f"plot: {png}" if png else NO_MATPLOTLIB)
