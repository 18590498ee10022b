"""`kvtier bench ttft`: time to first token, side by side, on one prompt set in one run.

Scenarios (each its own vLLM server, same model, same flags, prefix caching on unless noted):
- ``none``: no connector: cold TTFT, then the repeat answered by vLLM's in-memory prefix cache;
- ``kvtier-s3``: kvtier with the S3 tier only: cold TTFT while saving, then (after a restart) the
  hit from S3;
- ``kvtier-disk``: disk tier only: cold, restart, hit from disk;
- ``kvtier-cpu``: CPU tier only, vLLM prefix caching off (else vLLM answers first): cold, repeat;
- ``example``: vLLM's ExampleConnector (disk): cold, restart, hit.
``--max-num-batched-tokens`` is set to at least the prompt length for every server, because the
ExampleConnector breaks on prompts prefilled over several steps.

Output: a table of medians and ratios, the same as JSON (``--json``), and a PNG bar plot of the
medians with the ratios (``--plot``, default next to the JSON) when matplotlib is installed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvtier_tools.bench.plot import NO_MATPLOTLIB, pyplot, save
from kvtier_tools.bench.servers import (
    ServerFactory,
    batch_budget,
    cpu_tier,
    delete_namespace,
    disk_tier,
    model_or_tiny,
    random_prompts,
    s3_settings,
)
from kvtier_tools.cli import add_command
from kvtier_tools.server import (
    DEFAULT_VLLM_PYTHON,
    Sample,
    VllmServer,
    example_transfer_config,
    kvtier_transfer_config,
)

SCENARIOS = ("none", "kvtier-s3", "kvtier-disk", "kvtier-cpu", "example")


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def run_bench(args: argparse.Namespace) -> dict[str, Any]:
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="kvtier-bench-ttft-"))
    work.mkdir(parents=True, exist_ok=True)
    prompts = random_prompts(args.prompts, args.prompt_tokens, args.seed)
    run_id = f"{int(time.time())}"
    budget = batch_budget(args.prompt_tokens)
    warmup = random_prompts(1, 64, args.seed + 1)[0]
    server = ServerFactory(args.model, args.port, work, args.vllm_python, budget)

    def cold_then_warm(
        srv: VllmServer, restart: bool
    ) -> tuple[list[float], list[float], dict[str, float]]:
        return _cold_then_warm(srv, restart, warmup, prompts, args.output_tokens)

    results: dict[str, dict[str, list[float]]] = {}
    breakdowns: dict[str, dict[str, float]] = {}
    plans: dict[str, Callable[[], tuple[list[float], list[float], dict[str, float]]]] = {
        "none": lambda: cold_then_warm(server("none", None), restart=False),
        "kvtier-disk": lambda: cold_then_warm(
            server("kvtier-disk", disk_tier(work / "disk" / run_id)), restart=True
        ),
        "kvtier-cpu": lambda: cold_then_warm(
            server("kvtier-cpu", cpu_tier(), "--no-enable-prefix-caching"), restart=False
        ),
        "example": lambda: cold_then_warm(
            server("example", example_transfer_config(str(work / "example" / run_id))),
            restart=True,
        ),
    }
    s3 = s3_settings(args.s3_config, f"bench-ttft-{run_id}") if args.s3_config else {}
    if args.s3_config:
        plans["kvtier-s3"] = lambda: cold_then_warm(
            server("kvtier-s3", kvtier_transfer_config(s3)), restart=True
        )
    for name in SCENARIOS:
        if name in plans and name in args.scenarios:
            print(f"[bench ttft] {name} ...", file=sys.stderr, flush=True)
            cold, warm, breakdown = plans[name]()
            results[name] = {"cold": cold, "warm": warm}
            if breakdown:
                breakdowns[name] = breakdown

    if "kvtier-s3" in results:
        delete_namespace(s3)
    med = {n: {k: _median(v) for k, v in r.items()} for n, r in results.items()}
    return {
        "prompt_tokens": args.prompt_tokens,
        "prompts": args.prompts,
        "output_tokens": args.output_tokens,
        "max_num_batched_tokens": budget,
        "model": args.model,
        "ttft_seconds": results,
        "median_ttft_seconds": med,
        "ratios": _ratios(med),
        "warm_breakdown_ms": breakdowns,
        "logs": str(work),
    }


#: kvtier's time counters on /metrics (seconds) for the warm round's breakdown, per request.
_TIMES = {
    "remote lookup": ("kvtier:remote_lookup_seconds_sum", "kvtier:remote_lookups_total"),
    "load (all)": ("kvtier:load_seconds_sum", None),
    "fetch": ("kvtier:load_fetch_seconds_total", None),
    "verify (summed over fetch threads)": ("kvtier:load_verify_seconds_total", None),
    "copy": ("kvtier:load_copy_seconds_total", None),
    "forward pass": ("kvtier:forward_seconds_total", None),
}


def _breakdown(before: list[Sample], after: list[Sample], n: int) -> dict[str, float]:
    """Milliseconds per warm request of each part of a hit (from kvtier's /metrics)."""
    from kvtier_tools.server import metric_sum

    def delta(name: str) -> float:
        return metric_sum(after, name) - metric_sum(before, name)

    out: dict[str, float] = {}
    for label, (seconds, count) in _TIMES.items():
        per = delta(count) if count else n
        out[label] = round(1000 * delta(seconds) / per, 2) if per else 0.0
    return out


def _cold_then_warm(
    srv: VllmServer, restart: bool, warmup: list[int], prompts: list[list[int]], output_tokens: int
) -> tuple[list[float], list[float], dict[str, float]]:
    """TTFT of every prompt on a fresh server, then again (after a restart if asked); for a
    kvtier server, where the warm round's time went (ms per request)."""

    def measure() -> list[float]:
        return [srv.complete(p, max_tokens=output_tokens).ttft for p in prompts]

    with srv:
        srv.complete(warmup, max_tokens=4)
        cold = measure()
        if restart:
            srv.restart()
            srv.complete(warmup, max_tokens=4)
        before = srv.metrics()
        warm = measure()
        time.sleep(1.5)  # vLLM publishes counters with its stats interval
        after = srv.metrics()
        kvtier = any(s.name.startswith("kvtier:") for s in after)
        return cold, warm, _breakdown(before, after, len(prompts)) if kvtier else {}


def _ratios(med: dict[str, dict[str, float]]) -> dict[str, float | None]:
    """The medians compared with the goals of docs/benchmarks.md (None: a scenario is missing)."""

    def ratio(a: tuple[str, str], b: tuple[str, str]) -> float | None:
        if a[0] in med and b[0] in med:
            return med[a[0]][a[1]] / med[b[0]][b[1]]
        return None

    return {
        "s3_hit_after_restart / cold_no_connector (goal <= 0.08)": ratio(
            ("kvtier-s3", "warm"), ("none", "cold")
        ),
        "s3_hit_after_restart / cpu_tier_hit (goal <= 2.0)": ratio(
            ("kvtier-s3", "warm"), ("kvtier-cpu", "warm")
        ),
        "s3_hit_after_restart / vllm_prefix_cache_hit (goal <= 1.5)": ratio(
            ("kvtier-s3", "warm"), ("none", "warm")
        ),
        "disk_hit_after_restart / example_connector_hit (goal <= 1.0)": ratio(
            ("kvtier-disk", "warm"), ("example", "warm")
        ),
        "cpu_hit / vllm_prefix_cache_hit": ratio(("kvtier-cpu", "warm"), ("none", "warm")),
        "cold_kvtier_saving / cold_no_connector (goal <= 1.05)": ratio(
            ("kvtier-s3", "cold") if "kvtier-s3" in med else ("kvtier-disk", "cold"),
            ("none", "cold"),
        ),
    }


def format_table(report: dict[str, Any]) -> str:
    lines = [
        f"TTFT, {report['prompts']} prompts x {report['prompt_tokens']} tokens (median seconds)",
        "| scenario | cold | warm |",
        "|---|---|---|",
    ]
    for name, m in report["median_ttft_seconds"].items():
        lines.append(f"| {name} | {m['cold']:.3f} | {m['warm']:.3f} |")
    lines += ["", "| ratio | value |", "|---|---|"]
    for name, value in report["ratios"].items():
        lines.append(f"| {name} | {'n/a' if value is None else f'{value:.3f}'} |")
    breakdowns: dict[str, dict[str, float]] = report.get("warm_breakdown_ms", {})
    if breakdowns:
        parts = list(_TIMES)
        lines += ["", "Warm round, where a hit's time goes (ms per request, kvtier's /metrics)", ""]
        lines += ["| scenario | " + " | ".join(parts) + " |", "|---" * (len(parts) + 1) + "|"]
        for name, b in breakdowns.items():
            lines.append(f"| {name} | " + " | ".join(f"{b[p]:.1f}" for p in parts) + " |")
    return "\n".join(lines)


def plot_report(report: dict[str, Any], path: str) -> str | None:
    """Median cold and warm TTFT per scenario as bars, the ratios listed below; written to
    ``path`` (PNG). None when matplotlib is not installed."""
    plt = pyplot()
    if plt is None:
        return None
    med: dict[str, dict[str, float]] = report["median_ttft_seconds"]
    names = list(med)
    fig, (ax, notes) = plt.subplots(
        2, 1, figsize=(max(6.0, 1.6 * len(names) + 2), 6.5), height_ratios=[4, 1]
    )
    width = 0.4
    for i, (phase, label) in enumerate(
        (("cold", "cold (first request)"), ("warm", "warm (repeat, or hit after restart)"))
    ):
        values = [med[n][phase] for n in names]
        xs = [x + (i - 0.5) * width for x in range(len(names))]
        bars = ax.bar(xs, values, width, label=label)
        # v != v: NaN, the median of a scenario that measured nothing
        ax.bar_label(bars, labels=["n/a" if v != v else f"{v:.3f}" for v in values], fontsize=8)
    ax.set_xticks(range(len(names)), names)
    ax.set_ylabel("median TTFT (s)")
    ax.set_title(
        f"TTFT, {report['prompts']} prompts x {report['prompt_tokens']} tokens, {report['model']}",
        fontsize=9,
    )
    ax.legend(fontsize=8)
    ratios = [f"{k}: {v:.3f}" for k, v in report["ratios"].items() if v is not None]
    notes.axis("off")
    notes.text(0, 1, "\n".join(ratios) or "no ratios (a scenario is missing)", va="top", fontsize=8)
    return save(plt, fig, path)


def _cmd(args: argparse.Namespace) -> int:
    with model_or_tiny(args.model) as args.model:
        report = run_bench(args)
    print(format_table(report))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
        print(f"JSON: {args.json}")
    png_path = args.plot or (str(Path(args.json).with_suffix(".png")) if args.json else None)
    if png_path is None:
        print("plot: none written (pass --plot or --json)")
    else:
        png = plot_report(report, png_path)
        print(f"plot: {png}" if png else NO_MATPLOTLIB)
    return 0


def register(subparsers: Any) -> None:
    """Add `ttft` to `kvtier bench`."""
    summary = "TTFT: no connector vs kvtier (S3/disk/CPU) vs vLLM prefix cache vs ExampleConnector"
    p = add_command(subparsers, "ttft", summary, __doc__)
    p.add_argument("--model", help="model dir (default: make the tiny model; needs the vLLM venv)")
    p.add_argument("--prompt-tokens", type=int, default=16384)
    p.add_argument("--prompts", type=int, default=3, help="distinct prompts (median reported)")
    p.add_argument("--output-tokens", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--s3-config", help="kvtier YAML with the S3 tier (omit: no S3 scenario)")
    p.add_argument("--scenarios", nargs="+", default=list(SCENARIOS), choices=SCENARIOS)
    p.add_argument("--port", type=int, default=8931)
    p.add_argument("--vllm-python", default=DEFAULT_VLLM_PYTHON)
    p.add_argument("--work-dir", help="logs and disk-tier dirs (default: a new temp dir)")
    p.add_argument("--json", help="write the report as JSON here")
    p.add_argument("--plot", help="write the PNG bar plot here (default: the --json path, .png)")
    p.set_defaults(func=_cmd)
