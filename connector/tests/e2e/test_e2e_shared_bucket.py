"""Two servers (different ports, separate disk dirs, CPU+disk+S3 tiers) on one bucket: B hits what
A wrote. B has never seen the prompt, so its hits can only come from S3."""

from __future__ import annotations

from pathlib import Path

from _e2e import CHUNK, OUTPUT_TOKENS, Counters, S3Target, Servers, prompt

SHARED = prompt(6_000, seed=21)


def test_server_b_hits_what_server_a_wrote(
    servers: Servers, s3_target: S3Target, scratch: Path
) -> None:
    tiers = {"local_cpu": True, "max_local_cpu_size": 0.5, "max_local_disk_size": 1.0}
    a = servers.make(
        "shared-a", s3_target.kvtier(local_disk=str(scratch / "a"), **tiers), env=s3_target.env
    )
    cold = a.complete(SHARED, max_tokens=OUTPUT_TOKENS)
    n = len(SHARED) // CHUNK
    assert len(s3_target.wait_for_objects(n)) == n
    b = servers.make(
        "shared-b", s3_target.kvtier(local_disk=str(scratch / "b"), **tiers), env=s3_target.env
    )
    c = Counters(b)
    out = b.complete(SHARED, max_tokens=OUTPUT_TOKENS)
    assert c.delta("kvtier:tier_hits_total", tier="s3") >= n - 1, b.log_tail()
    assert c.delta("kvtier:tier_hits_total", tier="disk") == 0
    assert c.delta("vllm:external_prefix_cache_hits_total") >= 0.9 * len(SHARED)
    assert out.token_ids == cold.token_ids
    a.stop()
    b.stop()
