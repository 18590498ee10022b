"""`kvtier doctor | ls | stats | purge`: check and administer a kvtier store from its config.

All four take ``--config`` (default ``$KVTIER_CONFIG``), the same file the vLLM connector reads.
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import shutil
import socket
import sys
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlparse

from kvtier.config import ConfigError, KvtierConfig, load_config
from kvtier.format import HEADER_SIZE, pack_header, read_header
from kvtier.stats import StoreStats, read_stats_dir
from kvtier.tiers.base import Tier, TierError

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
    ls.add_argument("-l", "--long", action="store_true", help="one line per chunk")
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


def _tiers(cfg: KvtierConfig, only: str | None) -> Iterator[Tier]:
    """The persistent tiers of ``cfg`` (the CPU tier lives only inside a running process)."""
    if cfg.local_disk and only in (None, "disk"):
        from kvtier.tiers.disk import DiskTier

        yield DiskTier(cfg.local_disk, cfg.disk_bytes)
    if cfg.remote_url and only in (None, "s3"):
        from kvtier.tiers.s3_boto3 import Boto3S3Tier

        yield Boto3S3Tier.from_config(cfg)


# ---------------------------------------------------------------------------------------- doctor
@dataclass
class Check:
    name: str
    ok: bool
    detail: str
    fix: str = ""


class Doctor:
    """Runs the checks in order; a check that fails stops the ones that depend on it."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.checks: list[Check] = []

    def add(self, name: str, ok: bool, detail: str, fix: str = "") -> bool:
        self.checks.append(Check(name, ok, detail, fix))
        mark = "ok  " if ok else "FAIL"
        print(f"[{mark}] {name}: {detail}")
        if not ok and fix:
            print(f"       fix: {fix}")
        return ok

    def run(self) -> int:
        try:
            cfg = load_config(self.args.config)
        except ConfigError as exc:
            self.add("config", False, str(exc), "edit the key named above")
            return 1
        tiers = [
            n
            for n, on in (("cpu", cfg.local_cpu), ("disk", cfg.local_disk), ("s3", cfg.remote_url))
            if on
        ]
        self.add(
            "config",
            True,
            f"{cfg.source}: tiers {', '.join(tiers) or 'none'}, "
            f"chunk_size {cfg.chunk_size}, namespace {cfg.namespace}",
        )
        if cfg.local_disk:
            self.check_disk(cfg)
        if cfg.remote_url:
            self.check_s3(cfg)
        failed = [c for c in self.checks if not c.ok]
        print(f"{len(self.checks) - len(failed)} ok, {len(failed)} failed")
        return 1 if failed else 0

    def check_disk(self, cfg: KvtierConfig) -> None:
        path = cfg.local_disk or ""
        try:
            os.makedirs(path, exist_ok=True)
            probe = os.path.join(path, f".kvtier-doctor-{os.getpid()}")
            with open(probe, "wb") as f:
                f.write(b"probe")
            os.unlink(probe)
        except OSError as exc:
            self.add(
                "disk",
                False,
                f"cannot write in {path}: {exc.strerror}",
                f"create {path} writable for this user, or change key 'local_disk' in {cfg.source}",
            )
            return
        free = shutil.disk_usage(path).free
        want = cfg.disk_bytes
        detail = f"{path} writable, cap {want / _MIB:.0f} MiB, free {free / _MIB:.0f} MiB"
        if free < want:
            detail += " (cap larger than free space: the tier will evict on ENOSPC)"
        self.add("disk", True, detail)

    def check_s3(self, cfg: KvtierConfig) -> None:
        from kvtier.tiers.s3_boto3 import error_cause, make_boto3_client

        where = cfg.source
        try:
            client = make_boto3_client(cfg, pool=4)
        except ConfigError as exc:
            import boto3

            profiles = boto3.session.Session().available_profiles
            close = difflib.get_close_matches(cfg.aws_profile or "", profiles, n=1)
            hint = f"did you mean '{close[0]}'? " if close else ""
            self.add(
                "credentials",
                False,
                str(exc),
                f"{hint}profiles here: {', '.join(profiles) or 'none'} "
                f"(home {os.path.expanduser('~')})",
            )
            return
        endpoint = client.meta.endpoint_url
        url = urlparse(endpoint)
        port = url.port or (443 if url.scheme == "https" else 80)
        try:
            with socket.create_connection((url.hostname or "", port), cfg.blocking_timeout_secs):
                pass
        except OSError as exc:
            cause = "connection refused" if isinstance(exc, ConnectionRefusedError) else str(exc)
            self.add(
                "endpoint",
                False,
                f"{endpoint}: {cause}",
                f"start the S3 service (radosgw/haproxy: `supervisorctl status` or the "
                f"site playbook) or fix key 'endpoint_url' in {where}",
            )
            return
        self.add("endpoint", True, f"{endpoint} reachable")
        creds = client._request_signer._credentials
        if creds is None:
            self.add(
                "credentials",
                False,
                "no access key found",
                f"set key 'aws_profile' in {where} to a profile with aws_access_key_id "
                "and aws_secret_access_key",
            )
            return
        profile = cfg.aws_profile or os.environ.get("AWS_PROFILE") or "default"
        self.add("credentials", True, f"profile {profile}, access key {creds.access_key[:4]}…")
        bucket = cfg.s3_bucket or ""
        try:
            client.head_bucket(Bucket=bucket)
        except Exception as exc:
            cause = error_cause(exc)
            fixes = {
                "http_403": f"the keys of profile {profile} are not accepted (401/403): check "
                "aws_access_key_id/aws_secret_access_key against "
                "`radosgw-admin user info`, and the bucket's owner/policy",
                "http_404": f"create bucket {bucket} (the rgw_bucket role does) or fix key "
                f"'remote_url' in {where}",
                "http_400": "the endpoint rejected the request: check key 'endpoint_url' "
                "(path-style http://host:port) and extra_config.s3_region",
            }
            self.add(
                "bucket",
                False,
                f"HEAD s3://{bucket}: {cause} ({exc})",
                fixes.get(cause, f"see the error above; endpoint {endpoint}"),
            )
            return
        self.add("bucket", True, f"s3://{bucket} exists and is accessible")
        self.probe(cfg)
        self.check_chunk_size(cfg, client)

    def probe(self, cfg: KvtierConfig) -> None:
        from kvtier.tiers.s3 import make_s3_tier

        tier = make_s3_tier(cfg)
        key = f"{cfg.namespace}/.doctor/{os.getpid()}"
        layout, chunk = b"\0" * 16, b"\1" * 16
        payload = os.urandom(4096)
        header = pack_header(layout, chunk, 1, payload)
        try:
            tier.put(key, header, payload)
            got = tier.get(key)
            present = tier.contains(key)
            tier.delete(key)
            gone = not tier.contains(key)
        except TierError as exc:
            self.add(
                "probe",
                False,
                f"write/read/delete under s3://{cfg.s3_bucket}/{cfg.s3_prefix}: {exc.cause}: {exc}",
                "the user needs s3:PutObject, GetObject, DeleteObject on the bucket",
            )
            return
        finally:
            tier.close()
        equal = got == (header, payload)
        if not equal or not present or not gone:
            self.add(
                "probe",
                False,
                f"read-back mismatch (equal={equal}, present={present}, deleted={gone})",
                "a proxy or the endpoint alters objects: check key 'endpoint_url'",
            )
            return
        self.add("probe", True, f"put/get/delete of a 4 KiB chunk via {cfg.s3_client} client")

    def check_chunk_size(self, cfg: KvtierConfig, client: Any) -> None:
        """Compare the token count in stored chunk headers with this config's chunk_size."""
        prefix = "/".join(p for p in (cfg.s3_prefix, cfg.namespace) if p) + "/"
        resp = client.list_objects_v2(Bucket=cfg.s3_bucket, Prefix=prefix, MaxKeys=50)
        tokens: dict[int, int] = defaultdict(int)
        for obj in resp.get("Contents", []):
            if "/.doctor/" in obj["Key"] or obj["Size"] < HEADER_SIZE:
                continue
            head = client.get_object(
                Bucket=cfg.s3_bucket, Key=obj["Key"], Range=f"bytes=0-{HEADER_SIZE - 1}"
            )["Body"].read()
            header = read_header(head)
            if header is not None:
                tokens[header.num_tokens] += 1
        if not tokens:
            self.add("chunk size", True, f"no chunks stored yet under {prefix}")
            return
        full = max(tokens)
        if full != cfg.chunk_size:
            self.add(
                "chunk size",
                False,
                f"chunks under {prefix} hold up to {full} tokens, config says "
                f"chunk_size {cfg.chunk_size}: they can never be hit",
                f"set key 'chunk_size' in {cfg.source} to {full} (as the writers use), or "
                "purge the old chunks",
            )
            return
        self.add("chunk size", True, f"stored chunks hold {full} tokens, as configured")


def cmd_doctor(args: argparse.Namespace) -> int:
    return Doctor(args).run()


# ---------------------------------------------------------------------------------------- ls
def _group(keys: Iterator[tuple[str, int]], namespace: str | None) -> dict[str, list[int]]:
    groups: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for key, size in keys:
        ns, _, rest = key.partition("/")
        if (namespace and ns != namespace) or ns == "" or rest.startswith(".doctor"):
            continue
        fp = rest.partition("/")[0]
        g = groups[f"{ns}/{fp}"]
        g[0] += 1
        g[1] += size
    return groups


def cmd_ls(args: argparse.Namespace) -> int:
    cfg = _load(args)
    if cfg is None:
        return 2
    status = 0
    for tier in _tiers(cfg, args.tier):
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
        print(f"{tier.name} ({where}): {total} chunks, {size / _MIB:.1f} MiB")
        for name, (count, nbytes) in sorted(groups.items()):
            print(f"  {name}\t{count} chunks\t{nbytes / _MIB:.1f} MiB")
    return status


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
    for tier in _tiers(cfg, args.tier):
        try:
            listed = list(tier.list_keys(prefix))
        except TierError as exc:
            print(f"error: cannot list the {tier.name} tier: {exc.cause}: {exc}", file=sys.stderr)
            return 1
        plan.append((tier, [k for k, _ in listed], sum(s for _, s in listed)))
    what = f"namespace {ns!r}" if ns else "all namespaces"
    if args.fingerprint:
        what += f", layouts {args.fingerprint}*"
    summary = "; ".join(f"{t.name}: {len(k)} chunks, {n / _MIB:.1f} MiB" for t, k, n in plan)
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
            deleted = _delete(tier, keys)
        except TierError as exc:
            print(f"error: purge on {tier.name} stopped: {exc.cause}: {exc}", file=sys.stderr)
            return 1
        finally:
            tier.close()
        print(f"{tier.name}: deleted {deleted} chunks")
    return 0


def _delete(tier: Tier, keys: list[str]) -> int:
    delete_many = getattr(tier, "delete_many", None)
    if delete_many is not None:
        return int(delete_many(keys))
    for key in keys:
        tier.delete(key)
    return len(keys)


def count_chunks(cfg: KvtierConfig, namespace: str, only: str | None = None) -> dict[str, int]:
    """Chunks stored under ``namespace`` per persistent tier (``{"disk": n, "s3": m}``).

    Raises `TierError` when a tier cannot be listed.
    """
    counts: dict[str, int] = {}
    for tier in _tiers(cfg, only):
        try:
            counts[tier.name] = sum(1 for _ in tier.list_keys(f"{namespace}/"))
        finally:
            tier.close()
    return counts


def purge_namespace(cfg: KvtierConfig, namespace: str, only: str | None = None) -> dict[str, int]:
    """Delete every chunk of ``namespace`` from the persistent tiers; chunks deleted per tier.

    Raises `TierError` when a tier cannot be listed or a delete fails.
    """
    deleted: dict[str, int] = {}
    for tier in _tiers(cfg, only):
        try:
            keys = [k for k, _ in tier.list_keys(f"{namespace}/")]
            deleted[tier.name] = _delete(tier, keys)
        finally:
            tier.close()
    return deleted
