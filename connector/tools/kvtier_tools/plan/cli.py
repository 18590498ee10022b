"""`kvtier plan`: size kvtier's tiers for a model and a workload, before deploying them.

Reads the model's config.json (a directory, the file, or a hub id already in the local cache;
nothing is downloaded) and prints: KV bytes per token and per chunk, how many chunks and
conversations each tier holds, the hit rate per tier under LRU (an analytic estimate and a
simulation of the store's tiers; their difference is printed), the TTFT saved (from the prefill
throughput and the tiers' bandwidth, given or measured by `kvtier bench ttft|store`), and the
S3 requests and bandwidth the fleet puts on RGW (one object per run of chunks and TP rank, runs
cut as the connector cuts them for this model: HEADs for lookups, GETs for hits, PUTs for
computed chunks).

Workload: conversations that grow. A request starts a conversation (a first prompt of
--prefix-tokens) or, with the share --continue-share, continues an open one picked at random:
its previous prompt plus --turn-tokens (the answer and the next message). --conversations are
open at once (steady state); --requests N instead plans a run of N requests from an empty cache,
as the benchmarks measure.

Example (experiment C of docs/benchmarks.md, CPU tier at 25 % of its working set):

  kvtier plan --model /tmp/tiny --cpu-gib 0.0189 --requests 120 --prefix-tokens 2048 \\
      --turn-tokens 256 --continue-share 0.8 --rate 19.6 --block-size 128 \\
      --bench-ttft docs/img/bench-ttft.json
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from kvtier_tools.cli import add_command
from kvtier_tools.plan.report import Setup, build, format_plan
from kvtier_tools.plan.shape import PlanError, load_shape
from kvtier_tools.plan.timing import speeds_from
from kvtier_tools.plan.workload import Workload


def _run(args: argparse.Namespace) -> dict[str, Any]:
    shape = load_shape(args.model, args.dtype, args.tp)
    if args.chunk_size < 1 or args.chunk_size % args.block_size:
        raise PlanError(
            f"--chunk-size {args.chunk_size}: pass a positive multiple of --block-size "
            f"({args.block_size}), as the connector requires"
        )
    if args.hosts < 1:
        raise PlanError(f"--hosts {args.hosts}: pass at least 1")
    sizes = {"cpu": args.cpu_gib, "disk": args.disk_gib, "s3": args.bucket_gib}
    if any(v < 0 for v in sizes.values()):
        raise PlanError("tier sizes (--cpu-gib, --disk-gib, --bucket-gib) must be >= 0")
    if not any(v > 0 for v in sizes.values()):
        raise PlanError("every tier is off: pass --cpu-gib, --disk-gib or --bucket-gib")
    workload = Workload(
        args.conversations,
        args.prefix_tokens,
        args.turn_tokens,
        args.continue_share,
        args.rate,
        args.requests,
    )
    speeds = speeds_from(
        shape,
        args.chunk_size,
        args.prefill_tps,
        {"cpu": args.cpu_mib_s, "disk": args.disk_mib_s, "s3": args.s3_mib_s},
        args.bench_ttft,
        args.bench_store,
    )
    if args.remote_admit_after < 1:
        raise PlanError(f"--remote-admit-after {args.remote_admit_after}: pass at least 1")
    setup = Setup(
        shape, args.chunk_size, args.block_size, sizes, args.hosts, args.remote_admit_after
    )
    return build(setup, workload, speeds, args.sim_requests, args.seed)


def _cmd(args: argparse.Namespace) -> int:
    try:
        plan = _run(args)
    except PlanError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(plan, indent=2, default=str) if args.json else format_plan(plan))
    return 0


def register(subparsers: Any) -> None:
    """Add `plan` to the `kvtier` CLI."""
    p = add_command(
        subparsers, "plan", "size the tiers: KV bytes, hit rate, TTFT, RGW load", __doc__
    )
    m = p.add_argument_group("model")
    m.add_argument(
        "--model", required=True, help="model dir, config.json, or a locally cached hub id"
    )
    m.add_argument(
        "--dtype", default="auto", help="auto (the config's), bfloat16, float16, float32"
    )
    m.add_argument("--tp", type=int, default=1, help="tensor-parallel size (default 1)")
    m.add_argument("--chunk-size", type=int, default=256, help="kvtier chunk_size (default 256)")
    m.add_argument(
        "--block-size",
        type=int,
        default=16,
        help="vLLM's block size: 16 on GPU (default), 128 on the CPU build",
    )
    t = p.add_argument_group("tiers (GiB, as the config's max_local_*_size)")
    t.add_argument("--cpu-gib", type=float, default=5.0, help="CPU tier per rank (default 5)")
    t.add_argument("--disk-gib", type=float, default=0.0, help="disk tier per rank (default off)")
    t.add_argument(
        "--bucket-gib",
        type=float,
        default=0.0,
        help="S3 tier for the fleet, as max_remote_size (default off; inf: no limit)",
    )
    t.add_argument("--hosts", type=int, default=1, help="serving hosts sharing the bucket")
    t.add_argument(
        "--remote-admit-after",
        type=int,
        default=1,
        help="a chunk goes to S3 from its N-th sight on, as remote_admit_after (default 1; "
        "simulated only)",
    )
    w = p.add_argument_group("workload (per serving host)")
    w.add_argument("--conversations", type=int, help="conversations open at once")
    w.add_argument("--prefix-tokens", type=int, required=True, help="a conversation's first prompt")
    w.add_argument("--turn-tokens", type=int, default=256, help="tokens each turn adds (256)")
    w.add_argument("--continue-share", type=float, required=True, help="e.g. 0.8")
    w.add_argument("--rate", type=float, required=True, help="requests per second per host")
    w.add_argument("--requests", type=int, help="plan a run of N requests from an empty cache")
    s = p.add_argument_group("speeds (flags win over the JSON files)")
    s.add_argument("--prefill-tps", type=float, help="prefill tokens/s of this model and host")
    for tier in ("cpu", "disk", "s3"):
        s.add_argument(f"--{tier}-mib-s", type=float, help=f"{tier} tier reads, MiB/s per rank")
    s.add_argument("--bench-ttft", help="JSON of `kvtier bench ttft --json` (this host)")
    s.add_argument("--bench-store", help="JSON of `kvtier bench store` (this host)")
    o = p.add_argument_group("output")
    o.add_argument(
        "--sim-requests",
        type=int,
        default=10_000,
        help="requests simulated (default 10000; 0: analytic estimate only)",
    )
    o.add_argument("--seed", type=int, default=0, help="seed of the simulated stream")
    o.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.set_defaults(func=_cmd)
