"""`kvtier` command line: argparse subcommands contributed by modules.

Each module in :data:`COMMAND_MODULES` exposes ``register(subparsers)``, which adds its parser and
sets ``func`` (``args -> exit status``) as a default. Adding a command is one line here; a group
(``kvtier bench``, ``kvtier gateway``) registers its own subcommands.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Sequence
from typing import Any

COMMAND_MODULES: tuple[str, ...] = (
    "kvtier_tools.admin.cli",  # doctor, ls, stats, purge
    "kvtier_tools.gateway.cli",  # gateway add|use|status|test
    "kvtier_tools.model",  # model make-tiny
    # verify (cold -> warm from S3 -> cold, what the kv_verify role runs)
    "kvtier_tools.verify.cli",
    "kvtier_tools.verify.fleet_cli",  # verify-fleet (one host computes, the others load from Ceph)
    "kvtier_tools.bench.cli",  # bench store|ttft|longdoc|compare
    "kvtier_tools.plan.cli",  # plan (tier sizes -> hit rate, TTFT, RGW load)
    # explain (where prompts stop sharing a prefix; what the cache holds)
    "kvtier_tools.explain.cli",
    "kvtier_tools.kvevents.cli",  # events (vLLM's KV-event stream, as a router sees it)
)


def add_command(subparsers: Any, name: str, help: str, doc: str | None) -> argparse.ArgumentParser:
    """A subcommand whose ``--help`` shows ``doc`` (its module's docstring) as written."""
    parser: argparse.ArgumentParser = subparsers.add_parser(
        name, help=help, description=doc, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    return parser


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvtier", description="kvtier: tiered KV-cache store for vLLM (CPU, disk, Ceph S3)"
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log debug details")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(commands)
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
