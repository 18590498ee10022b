"""`kvtier bench`: the group of benchmark commands; each module adds its own subcommand."""

from __future__ import annotations

import importlib
from typing import Any

BENCH_MODULES: tuple[str, ...] = (
    "kvtier_tools.bench.tier_clients",  # bench store
    "kvtier_tools.bench.ttft",  # bench ttft (vLLM servers side by side)
    "kvtier_tools.bench.longdoc",  # bench longdoc (LMCache's long_doc_qa against a running server)
    "kvtier_tools.bench.compare",  # bench compare (experiments A-D, scenarios side by side)
    "kvtier_tools.bench.soak",  # bench soak (a mixed workload for a fixed time, resources watched)
)


def register(subparsers: Any) -> None:
    """Add `bench` and its subcommands to the kvtier CLI."""
    bench = subparsers.add_parser("bench", help="benchmarks (side-by-side, table + JSON)")
    commands = bench.add_subparsers(dest="bench_command", required=True, metavar="BENCH")
    for name in BENCH_MODULES:
        importlib.import_module(name).register(commands)
