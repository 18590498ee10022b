"""Bad S3 settings, end to end on real vLLM and RGW (tenants on one bucket:
test_e2e_shared_bucket.py).

- wrong credentials: the connector says so once at start (cause and fix) and serves without
  the S3 tier; with ``remote_required: true`` the server refuses to start, saying why.
"""

from __future__ import annotations

import configparser
import os
from pathlib import Path

import pytest
from _e2e import OUTPUT_TOKENS, S3Target, Servers, prompt

from kvtier_tools.server import ServerError

DOC = prompt(3_000, seed=31)


def _wrong_keys(s3_target: S3Target, scratch: Path) -> dict[str, str]:
    """The test profile with a wrong secret: an AWS credentials file of its own."""
    creds = configparser.ConfigParser()
    creds.read(s3_target.env["AWS_SHARED_CREDENTIALS_FILE"])
    creds.set(s3_target.profile, "aws_secret_access_key", "not-the-secret")
    path = scratch / "wrong-credentials"
    with path.open("w") as f:
        creds.write(f)
    return {**s3_target.env, "AWS_SHARED_CREDENTIALS_FILE": str(path)}


# Decided at collection, before ceph_s3 deploys: the local RGW checks credentials; another S3
# given by $KVTIER_TEST_S3_CONFIG (a test double) may accept any secret.
@pytest.mark.skipif(
    bool(os.environ.get("KVTIER_TEST_S3_CONFIG")),
    reason="needs an S3 that checks credentials (the local RGW)",
)
def test_wrong_credentials_are_named_once_and_served_without(
    servers: Servers, s3_target: S3Target, scratch: Path
) -> None:
    env = _wrong_keys(s3_target, scratch)
    srv = servers.make("wrong-keys", s3_target.kvtier(local_cpu=True), env=env)
    out = srv.complete(DOC, max_tokens=OUTPUT_TOKENS)
    log = srv.log_text()
    srv.stop()
    assert out.token_ids
    named = [ln for ln in log.splitlines() if "cannot be used (http_403)" in ln]
    assert 1 <= len(named) <= 2, named  # scheduler and worker each say it once
    assert "are not accepted" in named[0] and "Serving without it" in named[0]
    with pytest.raises(ServerError, match="remote_required is true: refusing to start"):
        servers.make("wrong-keys-required", s3_target.kvtier(remote_required=True), env=env)
