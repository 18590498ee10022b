"""`kvtier` command line: argparse subcommands contributed by modules.

Each module in :data:`COMMAND_MODULES` exposes ``register(subparsers)``, which adds its parser and
sets ``func`` (``args -> exit status``) as a default. Adding a command is one line here. Benchmarks
go under ``kvtier bench``: modules in :data:`BENCH_MODULES` register into that group the same way.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Sequence

COMMAND_MODULES: tuple[str, ...] = (
    "kvtier.admin",  # doctor, ls, stats, purge
    "kvtier.gateway",  # gateway profiles
    "kvtier.model",  # model make-tiny
    "kvtier.verify",  # verify (cold -> warm from S3 -> cold, what the kv_verify role runs)
)
BENCH_MODULES: tuple[str, ...] = (
    "kvtier.bench_store",  # bench store
    "kvtier.bench_ttft",  # bench ttft (vLLM servers side by side)
    "kvtier.bench_longdoc",  # bench longdoc (LMCache's long_doc_qa against a running server)
    "kvtier.bench_experiments",  # bench compare (experiments A-D, scenarios side by side)
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvtier", description="kvtier: tiered KV-cache store for vLLM (CPU, disk, Ceph S3)"
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log debug details")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(commands)
    bench = commands.add_parser("bench", help="benchmarks (side-by-side, table + JSON)")
    bench_commands = bench.add_subparsers(dest="bench_command", required=True, metavar="BENCH")
    for name in BENCH_MODULES:
        importlib.import_module(name).register(bench_commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
    )
    status: int = args.func(args)
    return status


if __name__ == "__main__":
    sys.exit(main())
