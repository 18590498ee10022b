"""`kvtier bench store` runs end to end against the real RGW and reports every client.

This checks that the benchmark works and writes complete results (it asserts no speed).
``KVTIER_BENCH_ARGS`` replaces ``--quick`` with other arguments and ``KVTIER_BENCH_OUT`` keeps
the JSON: that is how docs/benchmarks.md's full run is made on the same fixture.
"""

from __future__ import annotations

import json
import os
import shlex
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvtier.config import load_config
from kvtier.tiers.s3_boto3 import make_boto3_client
from kvtier_tools.cli import main as cli_main

pytestmark = pytest.mark.integration


def test_bench_store_reports_every_client(
    ceph_s3: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(ceph_s3.credentials_file))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(ceph_s3.config_file))
    cfg = tmp_path / "kvtier.yaml"
    cfg.write_text(
        yaml.safe_dump(
            {
                "remote_url": f"s3://{ceph_s3.bucket}/bench",
                "endpoint_url": ceph_s3.endpoint_url,
                "aws_profile": ceph_s3.profile,
                "extra_config": {"s3_region": ceph_s3.region},
            }
        )
    )
    out = Path(os.environ.get("KVTIER_BENCH_OUT", str(tmp_path / "reports")))
    extra = shlex.split(os.environ.get("KVTIER_BENCH_ARGS", "--quick"))
    args = ["bench", "store", "--config", str(cfg), "--disk-dir", str(tmp_path), "--out", str(out)]
    assert cli_main([*args, *extra]) == 0
    [report] = sorted(out.glob("bench-store-*.json"))[-1:]
    doc = json.loads(report.read_text())
    clients = {c["client"] for c in doc["cells"]}
    kvtier = {"kvtier s3 (boto3)", "kvtier s3 (crt)", "kvtier s3 (auto)", "kvtier disk"}
    assert {"raw awscrt", *kvtier} <= clients
    assert any(c.startswith("raw boto3") for c in clients)
    assert "raw sequential read" in clients
    assert all(c["errors"] == 0 and c["mib_s"] > 0 for c in doc["cells"])
    assert {(r["op"]) for r in doc["ratios"]} == {"put", "get"}
    # the benchmark deletes everything it wrote
    client = make_boto3_client(load_config(cfg))
    left = client.list_objects_v2(Bucket=ceph_s3.bucket, Prefix="bench/")
    assert left.get("KeyCount", 0) == 0
