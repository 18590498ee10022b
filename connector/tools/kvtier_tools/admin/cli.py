"""`kvtier doctor | ls | stats | purge`: check and administer a kvtier store from its config.

All four take ``--config`` (default ``$KVTIER_CONFIG``), the same file the vLLM connector reads.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from collections.abc import Callable, Iterator
from typing import Any

from kvtier.config import ConfigError, KvtierConfig, load_config
from kvtier.keys import ChunkKey
from kvtier.stats import StoreStats, read_stats_dir
from kvtier.tiers import persistent_tiers
from kvtier.tiers.base import Tier, TierError
from kvtier_tools.admin.doctor import Doctor

_MIB = 1024 * 1024


def register(subparsers: Any) -> None:
    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument("--config", help="kvtier YAML file (default: $KVTIER_CONFIG)")

    doctor = subparsers.add_parser(
        "doctor", help="check config, endpoint, credentials, bucket, and a write/read probe"
    )
    common(doctor)
    doctor.set_defaults(func=cmd_doctor)

    ls = subparsers.add_parser("ls", help="list stored chunks per tier, namespace and layout")
    common(ls)
    ls.add_argument("--namespace", help="only this namespace (default: all)")
    ls.add_argument("--tier", choices=("disk", "s3"), help="only this tier (default: both)")
    ls.add_argument("-l", "--long", action="store_true", help="one line per chunk (S3: per object)")
    ls.set_defaults(func=cmd_ls)

    stats = subparsers.add_parser("stats", help="hit/miss/error counters written by the store")
    common(stats)
    stats.add_argument("--dir", help="stats directory (default: the config's stats_dir)")
    stats.add_argument("--json", action="store_true", help="print the summed snapshot as JSON")
    stats.set_defaults(func=cmd_stats)

    purge = subparsers.add_parser("purge", help="delete stored chunks (disk and S3)")
    common(purge)
    scope = purge.add_mutually_exclusive_group()
    scope.add_argument("--namespace", help="namespace to purge (default: the config's)")
    scope.add_argument("--all", action="store_true", help="every namespace under the prefix")
    purge.add_argument("--fingerprint", default="", help="only layouts starting with this")
    purge.add_argument("--tier", choices=("disk", "s3"), help="only this tier (default: both)")
    purge.add_argument("--yes", action="store_true", help="do not ask for confirmation")
    purge.set_defaults(func=cmd_purge)


def _load(args: argparse.Namespace) -> KvtierConfig | None:
    try:
        return load_config(args.config)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return None


def cmd_doctor(args: argparse.Namespace) -> int:
    return Doctor(args).run()


# ---------------------------------------------------------------------------------------- ls
def _group(keys: Iterator[tuple[str, int]], namespace: str | None) -> dict[str, list[int]]:
    groups: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for key, size in keys:
        try:
            k = ChunkKey.parse(key)
        except ValueError:  # not a chunk (kvtier doctor's probe objects, foreign files)
            continue
        if namespace and k.namespace != namespace:
            continue
        g = groups[f"{k.namespace}/{k.fingerprint}"]
        g[0] += 1
        g[1] += size
    return groups


def cmd_ls(args: argparse.Namespace) -> int:
    cfg = _load(args)
    if cfg is None:
        return 2
    status = 0
    for tier in persistent_tiers(cfg, args.tier):
        prefix = f"{args.namespace}/" if args.namespace else ""
        try:
            if args.long:
                for key, size in tier.list_keys(prefix):
                    print(f"{tier.name}\t{size}\t{key}")
                continue
            groups = _group(tier.list_keys(prefix), args.namespace)
        except TierError as exc:
            print(f"error: cannot list the {tier.name} tier: {exc.cause}: {exc}", file=sys.stderr)
            status = 1
            continue
        finally:
            tier.close()
        where = cfg.local_disk if tier.name == "disk" else f"{cfg.remote_url}"
        total = sum(g[0] for g in groups.values())
        size = sum(g[1] for g in groups.values())
        unit = _unit(tier)
        cap = cfg.remote_bytes if tier.remote and not args.namespace else None
        fill = f" ({100 * size / cap:.0f} % of max_remote_size {cap / _MIB:.1f} MiB)" if cap else ""
        print(f"{tier.name} ({where}): {total} {unit}, {size / _MIB:.1f} MiB{fill}")
        for name, (count, nbytes) in sorted(groups.items()):
            print(f"  {name}\t{count} {unit}\t{nbytes / _MIB:.1f} MiB")
    return status


def _unit(tier: Tier) -> str:
    """What a key of the tier is: a chunk, or on S3 an object of one chunk or of a run."""
    return "objects" if tier.remote else "chunks"


# ---------------------------------------------------------------------------------------- stats
def _fmt_stats(st: StoreStats) -> str:
    lines = [
        f"lookups {st.lookups}: {st.lookup_hit_chunks}/{st.lookup_chunks} chunks found "
        f"({100 * st.lookup_hit_rate:.1f} %)",
        f"gets {st.gets}: {st.get_hits} served; puts {st.puts} ({st.put_bytes / _MIB:.1f} MiB), "
        f"background writes dropped {st.dropped_writes}",
        f"{'tier':6} {'hits':>8} {'misses':>8} {'read MiB':>9} {'puts':>8} {'written MiB':>11} "
        f"{'evicted':>8} {'get ms':>7}  errors",
    ]
    for name, t in st.tiers.items():
        errors = ", ".join(f"{k}={v}" for k, v in sorted(t.errors.items())) or "-"
        lines.append(
            f"{name:6} {t.hits:8} {t.misses:8} {t.bytes_read / _MIB:9.1f} {t.puts:8} "
            f"{t.bytes_written / _MIB:11.1f} {t.evictions:8} {t.mean_get_ms:7.2f}  {errors}"
        )
    return "\n".join(lines)


def cmd_stats(args: argparse.Namespace) -> int:
    directory = args.dir
    if directory is None:
        cfg = _load(args)
        if cfg is None:
            return 2
        directory = cfg.stats_path
        if directory is None:
            print(
                "error: no stats directory: set key 'stats_dir' (or local_disk) in "
                f"{cfg.source}, or pass --dir",
                file=sys.stderr,
            )
            return 2
    files = read_stats_dir(directory)
    total = StoreStats()
    for st in files.values():
        total = total + st
    if args.json:
        print(json.dumps({"files": sorted(files), "total": total.to_dict()}, indent=1))
        return 0
    if not files:
        print(f"no stats files in {directory} (written every stats_interval_secs and at close)")
        return 0
    print(f"{len(files)} process snapshot(s) in {directory}: {', '.join(sorted(files))}")
    print(_fmt_stats(total))
    return 0


# ---------------------------------------------------------------------------------------- purge
def cmd_purge(args: argparse.Namespace, confirm: Callable[[str], str] = input) -> int:
    cfg = _load(args)
    if cfg is None:
        return 2
    ns = "" if args.all else (args.namespace or cfg.namespace)
    prefix = f"{ns}/{args.fingerprint}" if ns else ""
    plan: list[tuple[Tier, list[str], int]] = []
    for tier in persistent_tiers(cfg, args.tier):
        try:
            listed = list(tier.list_keys(prefix))
        except TierError as exc:
            print(f"error: cannot list the {tier.name} tier: {exc.cause}: {exc}", file=sys.stderr)
            return 1
        plan.append((tier, [k for k, _ in listed], sum(s for _, s in listed)))
    what = f"namespace {ns!r}" if ns else "all namespaces"
    if args.fingerprint:
        what += f", layouts {args.fingerprint}*"
    summary = "; ".join(f"{t.name}: {len(k)} {_unit(t)}, {n / _MIB:.1f} MiB" for t, k, n in plan)
    if not any(k for _, k, _ in plan):
        print(f"nothing to purge ({what})")
        return 0
    if not args.yes:
        if not sys.stdin.isatty() and confirm is input:
            print(
                f"refusing to purge {what} ({summary}) without --yes (no terminal to ask)",
                file=sys.stderr,
            )
            return 2
        answer = confirm(f"delete {what} ({summary})? [y/N] ")
        if answer.strip().lower() not in ("y", "yes"):
            print("aborted")
            return 1
    for tier, keys, _ in plan:
        try:
            deleted = tier.delete_many(keys)
        except TierError as exc:
            print(f"error: purge on {tier.name} stopped: {exc.cause}: {exc}", file=sys.stderr)
            return 1
        finally:
            tier.close()
        print(f"{tier.name}: deleted {deleted} {_unit(tier)}")
    return 0
