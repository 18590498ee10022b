"""`kvtier doctor`: config, disk directory, endpoint, credentials, bucket, a write/read probe and
the chunk size of stored chunks, in that order; each failure with its fix."""

from __future__ import annotations

import argparse
import difflib
import os
import shutil
import socket
from collections import defaultdict
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlparse

from kvtier.config import ConfigError, KvtierConfig, load_config
from kvtier.format import HEADER_SIZE, pack_header, read_header
from kvtier.tiers.base import TierError

_MIB = 1024 * 1024


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
        from kvtier.tiers.s3_boto3 import make_boto3_client

        try:
            client = make_boto3_client(cfg, pool=4)
        except ConfigError as exc:
            self.profile_not_found(cfg, exc)
            return
        if not self.check_endpoint(cfg, client.meta.endpoint_url):
            return
        profile = self.check_credentials(cfg)
        if profile is None or not self.check_bucket(cfg, client, profile):
            return
        self.probe(cfg)
        self.check_chunk_size(cfg, client)

    def profile_not_found(self, cfg: KvtierConfig, exc: ConfigError) -> None:
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

    def check_endpoint(self, cfg: KvtierConfig, endpoint: str) -> bool:
        url = urlparse(endpoint)
        port = url.port or (443 if url.scheme == "https" else 80)
        try:
            with socket.create_connection((url.hostname or "", port), cfg.blocking_timeout_secs):
                pass
        except OSError as exc:
            cause = "connection refused" if isinstance(exc, ConnectionRefusedError) else str(exc)
            return self.add(
                "endpoint",
                False,
                f"{endpoint}: {cause}",
                f"start the S3 service (radosgw/haproxy: `supervisorctl status` or the "
                f"site playbook) or fix key 'endpoint_url' in {cfg.source}",
            )
        return self.add("endpoint", True, f"{endpoint} reachable")

    def check_credentials(self, cfg: KvtierConfig) -> str | None:
        """The profile name when the profile resolves to an access key, else None."""
        from kvtier.tiers.s3_boto3 import frozen_credentials

        creds = frozen_credentials(cfg)
        if creds is None:
            self.add(
                "credentials",
                False,
                "no access key found",
                f"set key 'aws_profile' in {cfg.source} to a profile with aws_access_key_id "
                "and aws_secret_access_key",
            )
            return None
        profile = cfg.aws_profile or os.environ.get("AWS_PROFILE") or "default"
        self.add("credentials", True, f"profile {profile}, access key {creds.access_key[:4]}…")
        return profile

    def check_bucket(self, cfg: KvtierConfig, client: Any, profile: str) -> bool:
        from kvtier.tiers.s3 import fix_for
        from kvtier.tiers.s3_boto3 import error_cause

        bucket = cfg.s3_bucket or ""
        try:
            client.head_bucket(Bucket=bucket)
        except Exception as exc:
            cause = error_cause(exc)
            return self.add(
                "bucket",
                False,
                f"HEAD s3://{bucket}: {cause} ({exc})",
                fix_for(cause, cfg, profile)
                or f"see the error above; endpoint {client.meta.endpoint_url}",
            )
        return self.add("bucket", True, f"s3://{bucket} exists and is accessible")

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
