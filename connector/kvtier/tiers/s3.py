"""S3 tier (Ceph RGW, MinIO, AWS): objects under ``<prefix>/<key>``, each one chunk or a run of
consecutive chunks (kvtier.format; its chunk list in the user metadata ``kvtier-chunks``).

Two clients, one module each: :mod:`kvtier.tiers.s3_boto3` and :mod:`kvtier.tiers.s3_crt`
(awscrt's native client, which borrows the boto3 tier's endpoint, credentials and listing).
This module only picks between them (:func:`make_s3_tier`), so neither imports the other's
factory. What both share:

* Endpoint and credentials come from ``endpoint_url`` / ``aws_profile`` in the kvtier config, else
  from the profile (``~/.aws/config`` may carry ``endpoint_url``) or the usual AWS environment.
* Path-style addressing (RGW without wildcard DNS), request/response checksums only when required
  (this Ceph rejects streaming trailer checksums), bounded connection pool, connect/read timeouts
  of ``blocking_timeout_secs``, standard retry mode.
* Every failure raises :class:`TierError` with a short cause (``timeout``, ``connection``,
  ``AccessDenied``, ``NoSuchBucket`` ...); the store turns it into a counted miss.
* No existence cache: ``contains`` is a HEAD request every time, so objects deleted behind kvtier's
  back (a purged bucket, the lifecycle rule) are misses at once.
* Eviction is the bucket's lifecycle rule (expiry by age, written by the playbook) plus
  ``kvtier purge``; kvtier does not track remote usage.

boto3 and awscrt are imported lazily (inside the clients): only processes with the S3 tier on
pay for them.
"""

from __future__ import annotations

from kvtier.config import KvtierConfig
from kvtier.tiers.base import Tier
from kvtier.tiers.s3_boto3 import Boto3S3Tier
from kvtier.tiers.s3_crt import CrtS3Tier


def fix_for(cause: str, cfg: KvtierConfig, profile: str | None = None) -> str:
    """What to change when the bucket of ``cfg`` fails with ``cause`` ("" for a cause without
    a known fix); kvtier doctor and the connector's start check say the same."""
    profile = profile or cfg.aws_profile or "default"
    bucket = cfg.s3_bucket
    fixes = {
        "http_403": f"the keys of profile {profile} are not accepted (401/403): check "
        "aws_access_key_id/aws_secret_access_key against `radosgw-admin user info`, and the "
        "bucket's owner/policy",
        "http_404": f"create bucket {bucket} (the rgw_bucket role does) or fix key 'remote_url' "
        f"in {cfg.source}",
        "http_400": "the endpoint rejected the request: check key 'endpoint_url' (path-style "
        "http://host:port) and extra_config.s3_region",
        "connection": "nothing answers at the endpoint: start the S3 service (radosgw/haproxy) "
        f"or fix key 'endpoint_url' in {cfg.source}",
        "timeout": "the endpoint accepts no request in time (a hung or unreachable S3 service)",
        "no_credentials": f"set key 'aws_profile' in {cfg.source} to a profile with "
        "aws_access_key_id and aws_secret_access_key",
    }
    return fixes.get(cause, "")


def make_s3_tier(cfg: KvtierConfig) -> Tier:
    """The S3 tier ``cfg`` asks for (``s3_client``: auto, boto3 or crt).

    ``auto`` writes through awscrt and reads through boto3. Measured on this RGW (1 and 16 MiB
    chunks, docs/benchmarks.md): awscrt PUTs cost about half the client CPU of boto3's (the
    writes run in the background next to the model, so CPU is what matters), while boto3 GETs
    were 1.7-2.8x faster than awscrt's, whose body reaches Python through a callback.
    """
    if cfg.s3_client == "crt":
        return CrtS3Tier.from_config(cfg)
    if cfg.s3_client == "auto":
        return CrtS3Tier.from_config(cfg, reads_via_boto3=True)
    return Boto3S3Tier.from_config(cfg)
