"""`kvtier bench soak`, shortened to ~25 s (the full run is by hand: docs/reliability.md): a
real vLLM server with kvtier's CPU, disk and S3 tiers under experiment C's mixed load serves
every request, its descriptors and S3 connections do not grow, the bucket holds every chunk of
every prompt sent and nothing else, and the JSON, CSV and PNG are written."""

from __future__ import annotations

import json
from pathlib import Path

from _e2e import S3Target, Servers

from kvtier_tools.cli import main

NAMESPACE = "kvtier-soak"


def test_a_short_soak_serves_everything_and_grows_nothing(
    servers: Servers, s3_target: S3Target, scratch: Path, monkeypatch: object
) -> None:
    tiers = s3_target.kvtier(
        local_cpu=True,
        max_local_cpu_size=0.25,
        local_disk=str(scratch / "disk"),
        max_local_disk_size=0.5,
        request_namespaces=[NAMESPACE],
    )
    srv = servers.make("soak", tiers, env=s3_target.env)
    config = scratch / "kvtier.yaml"
    import yaml

    config.write_text(yaml.safe_dump(tiers))
    for key, value in s3_target.env.items():
        monkeypatch.setenv(key, value)  # type: ignore[attr-defined]
    out = scratch / "soak.json"
    status = main(
        ["bench", "soak", "--base-url", srv.base_url, "--model", srv.served_model_name,
         "--duration", "25", "--window", "5", "--pid", str(srv.pid), "--config", str(config),
         "--namespace", NAMESPACE, "--json", str(out)]
    )  # fmt: skip
    srv.stop()
    report = json.loads(out.read_text())
    s = report["summary"]
    assert status == 0 and s["failed"] == 0 and s["requests"] >= 20, s
    assert len(report["windows"]) >= 4
    assert s["fds_end"] <= s["fds_start"] + 32, s
    assert s["s3_connections_end"] <= 64, s
    # Every chunk of every prompt sent is in the bucket, but for writes the server counted as
    # dropped or failed; nothing else is. (Counted chunk by chunk, not against the chunks
    # saved: a session's prompt and its continuation in flight together both save the prefix.)
    assert s["writes_settled"] and s["s3_chunks_written"] > 0, s
    assert s["chunks_of_prompts"] > 0 and s["chunks_unexpected"] == 0, s
    lost = s["writes_dropped"] + s["s3_write_failures"] + s["saves_not_handed"]
    assert s["chunks_missing"] <= lost, s
    assert s["chunks_of_prompts"] - s["chunks_missing"] <= s["bucket_chunks"], s
    assert out.with_suffix(".csv").exists() and out.with_suffix(".png").stat().st_size > 0
