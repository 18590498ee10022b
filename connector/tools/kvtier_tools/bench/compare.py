"""`kvtier bench compare`: the four experiments operators run to choose a CPU, SSD or S3 back end,
side by side on one machine, one vLLM server per scenario (same model, flags, batch budget).

Presets (sizes scaled to a 2-core machine and the tiny model; ``--smoke``: seconds):

- A: one long prompt, sent once (cold round), then repeated (warm round);
- B: a multi-turn conversation: each turn is the previous prompt + the previous answer + new user
  tokens; the warm round replays the conversation;
- C: mixed load at a fixed concurrency for a fixed time: 20 % new prompts, 80 % continuations of
  earlier prompts (that prompt plus new tokens); the warm round goes on with the same stream;
- D: a short prompt with a long answer: decoding dominates, so the cache's gain shrinks.

Scenarios, in order: ``no-cache`` (no connector, prefix caching off), ``vllm-prefix`` (vLLM's
in-memory prefix cache), ``example`` (vLLM's ExampleConnector), ``kvtier-cpu`` (CPU tier,
prefix caching off, else vLLM answers before the connector is asked), ``kvtier-disk`` (disk tier)
and, with ``--s3-config``, ``kvtier-s3`` (S3 tier, in a namespace of its own, deleted after).
Each server runs the cold round of every preset, then the warm round of every preset; the
example, disk and S3 servers are restarted in between, so their warm round can only be served by
the connector. Hit rate = prompt tokens served from a cache (``vllm:prefix_cache_hits`` +
``vllm:external_prefix_cache_hits``) / prompt tokens (``vllm:prompt_tokens``), deltas of the
server's /metrics around each round.

With C, a capacity sweep follows: kvtier's CPU tier at 100/50/25/10 % of C's working set, without
and with a disk tier twice the working set, prefix caching off, the same first requests of C's
stream for every size: does a bigger, slower tier win through its hit rate?

Output: a table per preset; with ``--json``, the JSON report, every request as CSV and one PNG per
preset next to it (``bench-compare.json`` -> ``bench-compare.csv``, ``bench-compare-A.png``...).
"""

from __future__ import annotations

import argparse
import functools
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from kvtier_tools.bench.compare_report import format_tables, plot_preset
from kvtier_tools.bench.compare_sweep import run_sweep
from kvtier_tools.bench.load import (
    ROUNDS,
    csv_rows,
    warm_up,
    write_csv,
    write_json,
)
from kvtier_tools.bench.presets import FULL, PRESETS, SMOKE, Preset, make_presets
from kvtier_tools.bench.rounds import SCENARIO_ERRORS, measure
from kvtier_tools.bench.servers import (
    ServerFactory,
    batch_budget,
    cpu_tier,
    delete_namespace,
    disk_tier,
    model_or_tiny,
    s3_settings,
)
from kvtier_tools.cli import add_command
from kvtier_tools.server import (
    DEFAULT_VLLM_PYTHON,
    VllmServer,
    example_transfer_config,
    kvtier_transfer_config,
)


@dataclass(frozen=True)
class Scenario:
    name: str
    label: str
    #: Restart the server between the rounds: only the connector can serve the warm round.
    restart: bool
    prefix_caching: bool


SCENARIOS = (
    Scenario("no-cache", "no cache (prefix caching off)", False, False),
    Scenario("vllm-prefix", "vLLM prefix cache", False, True),
    # The restarted ones keep vLLM's prefix cache, as deployed: their first warm request comes
    # from the connector, the repeats after it from vLLM's cache that the load filled.
    Scenario("example", "vLLM ExampleConnector (restart; + prefix cache)", True, True),
    Scenario("kvtier-cpu", "kvtier CPU tier (prefix caching off)", False, False),
    Scenario("kvtier-disk", "kvtier disk tier (restart; + prefix cache)", True, True),
    Scenario("kvtier-s3", "kvtier S3 tier (restart; + prefix cache)", True, True),
)
SMOKE_SCENARIOS = ("vllm-prefix", "kvtier-cpu")


# ----------------------------------------------------------------------------- scenarios
def run_scenario(
    scenario: Scenario, server: VllmServer, presets: Mapping[str, Preset]
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Cold round of every preset, restart if the scenario says so, warm round of every
    preset. A server that fails ends the scenario; what was measured until then is kept."""
    result: dict[str, Any] = {
        "label": scenario.label,
        "restart": scenario.restart,
        "prefix_caching": scenario.prefix_caching,
        "presets": {key: {} for key in presets},
    }
    rows: list[dict[str, Any]] = []
    began = time.monotonic()
    try:
        with server:
            for round_name in ROUNDS:
                if round_name == "warm" and scenario.restart:
                    server.restart()
                warm_up(server.complete)
                for key, preset in presets.items():
                    run = functools.partial(preset.run, round_name, server.complete)
                    summary, records = measure(server, run, keep_ttfts=key != "C")
                    result["presets"][key][round_name] = summary
                    rows += csv_rows(records, scenario=scenario.name, preset=key)
    except SCENARIO_ERRORS as exc:
        result["error"] = str(exc)[-3000:]
    result["time_s"] = time.monotonic() - began
    result["loadavg_after"] = os.getloadavg()
    return result, rows


# ------------------------------------------------------------------------------- the run
def run_compare(args: argparse.Namespace) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    sizes = SMOKE if args.smoke else FULL
    if args.c_duration:
        sizes = replace(sizes, c_cold_s=args.c_duration / 2, c_warm_s=args.c_duration)
    keys = list(PRESETS) if args.preset == "all" else [args.preset]
    wanted = args.scenarios or (SMOKE_SCENARIOS if args.smoke else [s.name for s in SCENARIOS])
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="kvtier-bench-compare-"))
    work.mkdir(parents=True, exist_ok=True)
    run_id = time.strftime("%Y%m%d-%H%M%S")
    budget = batch_budget(sizes.longest_prompt(keys))
    factory = ServerFactory(args.model, args.port, work, args.vllm_python, budget)
    s3 = s3_settings(args.s3_config, f"bench-compare-{run_id}") if args.s3_config else None
    kv_configs = _kv_transfer_configs(work, run_id, s3)
    settings = {k: v for k, v in vars(args).items() if k != "func" and not k.endswith("command")}
    report: dict[str, Any] = {
        "settings": settings,
        "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "machine": {"cpus": os.cpu_count(), "loadavg_start": os.getloadavg()},
        "model": args.model,
        "smoke": args.smoke,
        "sizes": asdict(sizes),
        "max_num_batched_tokens": budget,
        "presets": keys,
        "scenarios": {},
        "logs": str(work),
    }
    rows: list[dict[str, Any]] = []
    began = time.monotonic()
    try:
        for scenario in SCENARIOS:
            if scenario.name not in wanted or scenario.name not in kv_configs:
                continue
            print(f"[bench compare] {scenario.name} ...", file=sys.stderr, flush=True)
            extra = () if scenario.prefix_caching else ("--no-enable-prefix-caching",)
            server = factory(scenario.name, kv_configs[scenario.name], *extra)
            presets = make_presets(keys, sizes, args.seed)
            report["scenarios"][scenario.name], scenario_rows = run_scenario(
                scenario, server, presets
            )
            rows += scenario_rows
    finally:
        _remove_tier_data(work)
        if s3 is not None and "kvtier-s3" in wanted:
            report["s3_cleanup"] = _delete_s3_namespace(s3)
    # The sweep is about kvtier's tiers: only when the run includes kvtier at all.
    if (
        "C" in keys
        and sizes.sweep_requests
        and not args.no_sweep
        and any(name.startswith("kvtier-") for name in wanted)
    ):
        try:
            report["sweep"], sweep_rows = run_sweep(factory, sizes, args.seed, args.model, run_id)
        finally:
            _remove_tier_data(work)
        rows += sweep_rows
    report["time_s"] = time.monotonic() - began
    report["machine"]["loadavg_end"] = os.getloadavg()
    return report, rows


def _kv_transfer_configs(
    work: Path, run_id: str, s3: Mapping[str, Any] | None
) -> dict[str, str | None]:
    """``--kv-transfer-config`` per scenario (None: no connector); no S3 scenario without ``s3``."""
    kv_configs: dict[str, str | None] = {
        "no-cache": None,
        "vllm-prefix": None,
        "example": example_transfer_config(str(work / "example" / run_id)),
        "kvtier-cpu": cpu_tier(),
        "kvtier-disk": disk_tier(work / "disk" / run_id),
    }
    if s3 is not None:
        kv_configs["kvtier-s3"] = kvtier_transfer_config(s3)
    return kv_configs


def _remove_tier_data(work: Path) -> None:
    """The connectors' stored chunks (ExampleConnector, disk tiers); the logs stay."""
    for name in ("example", "disk", "sweep"):
        shutil.rmtree(work / name, ignore_errors=True)


def _delete_s3_namespace(settings: Mapping[str, Any]) -> str:
    """Delete the run's S3 namespace; what happened, for the report (a failed cleanup must not
    lose the measurements)."""
    from kvtier.tiers.base import TierError

    try:
        delete_namespace(settings)
    except (TierError, OSError) as exc:
        return f"namespace {settings['namespace']} NOT deleted: {exc}"
    return f"namespace {settings['namespace']} deleted"


def _cmd(args: argparse.Namespace) -> int:
    if "kvtier-s3" in (args.scenarios or ()) and not args.s3_config:
        print(
            "error: --scenarios kvtier-s3 needs --s3-config (a kvtier YAML with the S3 tier)",
            file=sys.stderr,
        )
        return 2
    with model_or_tiny(args.model) as args.model:
        report, rows = run_compare(args)
    print(format_tables(report))
    if not args.json:
        print("files: none written (pass --json)")
        return 0
    json_path = Path(args.json)
    json_path.parent.mkdir(parents=True, exist_ok=True)
    write_json(str(json_path), report)
    csv_path = json_path.with_suffix(".csv")
    write_csv(str(csv_path), rows)
    print(f"JSON: {json_path}\nCSV: {csv_path}")
    for key in report["presets"]:
        png = plot_preset(report, key, str(json_path.with_name(f"{json_path.stem}-{key}.png")))
        print(f"plot {key}: {png or 'none written (matplotlib is not installed)'}")
    failed = [n for n, s in report["scenarios"].items() if "error" in s]
    return 1 if failed else 0


def register(subparsers: Any) -> None:
    """Add `compare` to `kvtier bench`."""
    summary = "experiments A-D side by side: no cache, vLLM prefix cache, ExampleConnector, kvtier"
    p = add_command(subparsers, "compare", summary, __doc__)
    p.add_argument("--preset", choices=[*PRESETS, "all"], default="all")
    p.add_argument(
        "--smoke", action="store_true", help=f"tiny sizes, scenarios {', '.join(SMOKE_SCENARIOS)}"
    )
    p.add_argument("--scenarios", nargs="+", choices=[s.name for s in SCENARIOS])
    p.add_argument("--s3-config", help="kvtier YAML with the S3 tier (omit: no S3 scenario)")
    p.add_argument("--no-sweep", action="store_true", help="skip C's CPU-tier capacity sweep")
    p.add_argument(
        "--c-duration", type=float, help=f"seconds of C's warm round (cold: half; {FULL.c_warm_s})"
    )
    p.add_argument("--model", help="model dir (default: make the tiny model; needs the vLLM venv)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--port", type=int, default=8940)
    p.add_argument("--vllm-python", default=DEFAULT_VLLM_PYTHON)
    p.add_argument("--work-dir", help="logs and tier dirs (default: a new temp dir)")
    p.add_argument("--json", help="the report; the CSV and PNGs are written next to it")
    p.set_defaults(func=_cmd)
