"""The S3 clients' timeouts (kvtier.tiers.s3_boto3.s3_client_config): no endpoint needed."""

from __future__ import annotations

from kvtier.config import KvtierConfig, load_config
from kvtier.tiers.s3_boto3 import HEAD_TIMEOUT_SECS, s3_client_config


def _cfg(**extra: object) -> KvtierConfig:
    return load_config({"remote_url": "s3://kvtier-cache/kv", "local_cpu": False, **extra})


def test_a_lookup_budget_above_the_head_timeout_lets_its_heads_wait_as_long() -> None:
    """A HEAD given up at 2 s under a 5 s lookup budget was a miss the operator allowed for
    (seen in CI: RGW on two busy cores answered a HEAD after 2 s)."""
    assert s3_client_config(_cfg(lookup_timeout_secs=5.0), 4, head=True).read_timeout == 5.0
    default = s3_client_config(_cfg(), 4, head=True)  # lookup_timeout_secs 0.1
    assert default.read_timeout == HEAD_TIMEOUT_SECS == 2.0
    assert default.retries["max_attempts"] == 1


def test_data_reads_wait_blocking_timeout_secs_and_heads_never_longer() -> None:
    cfg = _cfg(lookup_timeout_secs=30.0, blocking_timeout_secs=8.0)
    assert s3_client_config(cfg, 4).read_timeout == 8.0
    assert s3_client_config(cfg, 4, head=True).read_timeout == 8.0
