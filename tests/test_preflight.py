"""Bad inventory values stop `site.yml` in preflight, before anything changes, with a message
that names the variable to fix. Runs the real playbook with `-e` overrides (needs no cluster)."""

from __future__ import annotations

import pytest
from _ansible import assert_fails_in_preflight, run_playbook

CASES = {
    "unknown cluster mode": (
        {"ceph_cluster_mode": "rook"},
        r"ceph_cluster_mode must be one of: package, cephadm, got: rook",
    ),
    "unknown rgw mode": (
        {"ceph_rgw_mode": "k8s"},
        r"ceph_rgw_mode must be one of: package, cephadm, got: k8s",
    ),
    "pg count not a power of two": (
        {"ceph_pools_pg_overrides": {"default.rgw.buckets.data": 48}},
        r"pg_num 48 of pool default\.rgw\.buckets\.data .*is not a power of two",
    ),
    "override of an unknown pool": (
        {"ceph_pools_pg_overrides": {"default.rgw.bucket.data": 32}},
        r"ceph_pools_pg_overrides names pools that are not in ceph_pools_pools: "
        r"default\.rgw\.bucket\.data",
    ),
    "pool without pg_num": (
        {"ceph_pools_pools": [{"name": "default.rgw.buckets.data"}]},
        r"missing required arguments: pg_num found in ceph_pools_pools",
    ),
    "pool with an unknown key": (
        {"ceph_pools_pools": [{"name": "x", "pg_num": 8, "pgnum": 8}]},
        r"ceph_pools_pools\.pgnum\. Supported parameters include: application, min_size, name",
    ),
    "min_size above size": (
        {"ceph_pools_size": 1, "ceph_pools_min_size": 2},
        r"need 1 <= min_size \(2\) <= size \(1\)",
    ),
    "only one of the two S3 keys": (
        {"rgw_bucket_access_key": "AKIAEXAMPLE"},
        r"Set both rgw_bucket_access_key and rgw_bucket_secret_key, or neither",
    ),
    "frontend port on an instance port": (
        {"ceph_rgw_frontend_port": 7482},
        r"ceph_rgw_frontend_port 7482 collides with the radosgw instance ports 7481\.\.7482",
    ),
    "address not on this host": (
        {"ceph_cluster_address": "192.0.2.7"},
        r"ceph_cluster_address '192\.0\.2\.7' must be an IPv4 address of this host",
    ),
    "port that is not a number": (
        {"ceph_rgw_frontend_port": "abc"},
        r"argument 'ceph_rgw_frontend_port' is of type str and we were unable to convert to int",
    ),
    "instance count that is not a number": (
        {"ceph_rgw_count_per_host": "two"},
        r"argument 'ceph_rgw_count_per_host' is of type str and we were unable to convert to int",
    ),
    "expiry that is not a number": (
        {"rgw_bucket_expiration_days": "a week"},
        r"argument 'rgw_bucket_expiration_days' is of type str and we were unable to convert to "
        r"int",
    ),
    "negative bucket quota": (
        {"rgw_bucket_quota_max_size_gb": -1},
        r"rgw_bucket_quota_max_size_gb must be >= 0 \(0: no quota\); is -1",
    ),
    "unknown addressing style": (
        {"aws_profile_addressing_style": "vhost"},
        r"value of aws_profile_addressing_style must be one of: path, virtual, auto, got: vhost",
    ),
    "device backing without a device": (
        {"ceph_cluster_osd_backing": "device"},
        r"ceph_cluster_osd_backing is 'device' but ceph_cluster_osd_device",
    ),
}


@pytest.mark.parametrize("extra_vars,message", list(CASES.values()), ids=list(CASES))
def test_bad_inventory_value_fails_in_preflight(
    extra_vars: dict[str, object], message: str
) -> None:
    assert_fails_in_preflight(run_playbook("site.yml", extra_vars, "--tags", "ceph"), message)
