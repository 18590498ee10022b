"""A fresh prefix of the test S3 endpoint (the real Ceph RGW of ``ceph_s3``, or
``$KVTIER_TEST_S3_CONFIG``): the ``s3`` fixture (connector/tests/conftest.py) and what tests
read back from it. Every test writes under its own random prefix, emptied afterwards."""

from __future__ import annotations

import json
import os
import subprocess
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from kvtier.config import KvtierConfig, load_config
from kvtier.tiers.s3_boto3 import make_boto3_client


@dataclass
class S3Env:
    endpoint_url: str
    region: str
    bucket: str
    profile: str
    root: Path  # per-test scratch dir

    def write_config(self, prefix: str, **extra: Any) -> Path:
        values: dict[str, Any] = {
            "chunk_size": 256,
            "local_cpu": False,
            "remote_url": f"s3://{self.bucket}/{prefix}",
            "endpoint_url": self.endpoint_url,
            "aws_profile": self.profile,
            "blocking_timeout_secs": 5,
            "extra_config": {"s3_region": self.region},
        }
        values.update(extra)
        import yaml

        path = self.root / f"kvtier-{uuid.uuid4().hex[:6]}.yaml"
        path.write_text(yaml.safe_dump(values))
        return path


def s3_prefix(
    request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[tuple[S3Env, str]]:
    """(environment, a fresh prefix); the prefix is emptied afterwards."""
    override = os.environ.get("KVTIER_TEST_S3_CONFIG")
    if override:
        cfg = load_config(override)
        endpoint = cfg.endpoint_url or make_boto3_client(cfg).meta.endpoint_url
        env = S3Env(
            endpoint,
            cfg.extra_config.s3_region,
            cfg.s3_bucket or "",
            cfg.aws_profile or "default",
            tmp_path,
        )
    else:
        fx = request.getfixturevalue("ceph_s3")  # conftest.CephS3
        monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(fx.credentials_file))
        monkeypatch.setenv("AWS_CONFIG_FILE", str(fx.config_file))
        env = S3Env(
            fx.endpoint_url,
            fx.region,
            fx.bucket,
            fx.profile,
            tmp_path,
        )
    prefix = f"kvtier-test/{uuid.uuid4().hex[:10]}"
    yield env, prefix
    cfg = load_config(env.write_config(prefix))
    client = make_boto3_client(cfg)
    for page in client.get_paginator("list_objects_v2").paginate(
        Bucket=env.bucket, Prefix=prefix + "/"
    ):
        objs = [{"Key": o["Key"]} for o in page.get("Contents", [])]
        if objs:
            client.delete_objects(Bucket=env.bucket, Delete={"Objects": objs, "Quiet": True})


def objects(cfg: KvtierConfig) -> dict[str, int]:
    client = make_boto3_client(cfg)
    out: dict[str, int] = {}
    for page in client.get_paginator("list_objects_v2").paginate(
        Bucket=cfg.s3_bucket, Prefix=cfg.s3_prefix + "/"
    ):
        out.update({o["Key"]: o["Size"] for o in page.get("Contents", [])})
    return out


def radosgw_admin(*args: str) -> Any:
    """`radosgw-admin` of the test cluster (its JSON answer, if any)."""
    done = subprocess.run(
        ["radosgw-admin", *args], capture_output=True, text=True, timeout=120, check=True
    )
    return json.loads(done.stdout) if done.stdout.strip() else None


@contextmanager
def bucket_quota_with_room(bucket: str, room: int, client: Any) -> Iterator[None]:
    """The bucket's RGW quota (the rgw_bucket role's backstop) set ``room`` bytes above what it
    holds now, once every radosgw lets a write through (``client``: boto3, through the site's
    endpoint); the quota it had is put back after."""
    stats = radosgw_admin("bucket", "stats", "--bucket", bucket)
    kept = stats["bucket_quota"]
    used = sum(int(u.get("size", 0)) for u in stats.get("usage", {}).values())
    radosgw_admin(
        "quota", "set", "--quota-scope=bucket", "--bucket", bucket,
        "--max-size", str(used + room), "--max-objects", "-1",
    )  # fmt: skip
    radosgw_admin("quota", "enable", "--quota-scope=bucket", "--bucket", bucket)
    try:
        _until_writes_pass(client, bucket)
        yield
    finally:
        radosgw_admin(
            "quota", "set", "--quota-scope=bucket", "--bucket", bucket,
            "--max-size", str(kept["max_size"]), "--max-objects", str(kept["max_objects"]),
        )  # fmt: skip
        radosgw_admin(
            "quota", "enable" if kept["enabled"] else "disable", "--quota-scope=bucket",
            "--bucket", bucket,
        )  # fmt: skip


def _until_writes_pass(client: Any, bucket: str, timeout: float = 60.0) -> None:
    """Each radosgw checks a quota against the bucket's stats as it cached them (up to
    rgw_bucket_quota_ttl, 10 min): one that did not see the deletes made through the other
    refuses every write against a quota set near the bucket's fill. Seen here: after a module
    emptied its prefix, one of the two refused every write for minutes, and on one run both
    did (nothing could be stored). Tiny writes until one passes (haproxy takes turns over the
    radosgw), deleted after; then at least one radosgw lets writes through up to the room."""
    import time

    from botocore.exceptions import ClientError

    key = f"kvtier-test-quota-probe/{uuid.uuid4().hex[:10]}"
    deadline = time.monotonic() + timeout
    while True:
        try:
            client.put_object(Bucket=bucket, Key=key, Body=b"x")
            break
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") != "QuotaExceeded":
                raise
            if time.monotonic() >= deadline:
                raise AssertionError(
                    f"every radosgw refused a 1-byte write for {timeout:g} s under a quota with "
                    "room: their cached bucket stats are stale (rgw_bucket_quota_ttl)"
                ) from exc
            time.sleep(0.5)
    client.delete_object(Bucket=bucket, Key=key)
