"""What a user of the converged site sees of the Ceph side: a healthy cluster, the pools as the
inventory asked, two radosgw behind haproxy, a working S3 profile, the lifecycle rule, and data
that survives losing one gateway or restarting every daemon."""

from __future__ import annotations

import hashlib
import json
import os
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import boto3
import pytest
import yaml
from botocore.config import Config
from botocore.exceptions import ClientError

REPO = Path(__file__).resolve().parents[3]
LOCAL_VARS = REPO / "inventories" / "local" / "group_vars" / "all"
ROLE_DEFAULTS = [
    REPO / "roles" / role / "defaults" / "main.yml" for role in ("ceph_pools", "rgw_bucket")
]


def _vars() -> dict[str, Any]:
    values: dict[str, Any] = {}
    for defaults in ROLE_DEFAULTS:
        values.update(yaml.safe_load(defaults.read_text()))
    for name in ("kvtier.yml", "ceph.yml"):
        values.update(yaml.safe_load((LOCAL_VARS / name).read_text()))
    return values


VARS = _vars()
FRONTEND = f"http://{VARS['ceph_rgw_frontend_address']}:{VARS['ceph_rgw_frontend_port']}"
RGW_PORTS = [VARS["ceph_rgw_backend_base_port"] + i for i in range(VARS["ceph_rgw_count_per_host"])]
# Instance names carry the inventory host (localhost here), as ceph_rgw names them.
RGW_PROGRAMS = [f"rgw-kvtier-localhost-{i + 1}" for i in range(VARS["ceph_rgw_count_per_host"])]


def wait_until(check: Callable[[], bool], timeout: float, what: str) -> None:
    """Re-check a condition once a second (cluster state has no change notification)."""
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(1)


def ceph_json(host: Any, *args: str) -> Any:
    return json.loads(host.check_output("ceph " + " ".join(args) + " --format json"))


def programs(host: Any, prefix: str) -> list[str]:
    out = host.run("supervisorctl status").stdout
    return [line.split()[0] for line in out.splitlines() if line.startswith(prefix)]


def control(host: Any, action: str, names: list[str]) -> None:
    host.check_output(f"supervisorctl {action} {' '.join(names)}")


def all_pgs_active_clean(host: Any) -> bool:
    summary = ceph_json(host, "pg", "stat")["pg_summary"]
    clean = sum(s["num"] for s in summary["num_pg_by_state"] if s["name"] == "active+clean")
    return bool(summary["num_pgs"]) and clean == summary["num_pgs"]


def endpoint_ok() -> bool:
    request = urllib.request.Request(f"{FRONTEND}/", method="HEAD")
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            return int(response.status) == 200
    except OSError:  # URLError is an OSError
        return False


def _drop_expect(request: Any, **_: Any) -> None:
    request.headers.pop("Expect", None)


def _without_expect_continue(client: Any) -> Any:
    """What kvtier's own S3 client does (kvtier.tiers.s3_boto3): after a PUT refused before its
    body (these tests provoke several), botocore keeps a connection that haproxy still expects
    the body on, and the next request on it fails with MethodNotAllowed or stalls."""
    client.meta.events.register("before-send.s3", _drop_expect)
    return client


@pytest.fixture(scope="module")
def s3(host: Any) -> Iterator[Any]:
    """An S3 client built only from the profile written for the serving user."""
    home = host.user(VARS["kvtier_user_name"]).home
    os.environ["AWS_SHARED_CREDENTIALS_FILE"] = f"{home}/.aws/credentials"
    os.environ["AWS_CONFIG_FILE"] = f"{home}/.aws/config"
    try:
        yield _without_expect_continue(
            boto3.Session(profile_name=VARS["aws_profile_name"]).client("s3")
        )
    finally:
        del os.environ["AWS_SHARED_CREDENTIALS_FILE"], os.environ["AWS_CONFIG_FILE"]


@pytest.fixture
def key(s3: Any) -> Iterator[str]:
    name = f"molecule/{uuid.uuid4().hex}"
    yield name
    s3.delete_object(Bucket=VARS["rgw_bucket_name"], Key=name)


def test_cluster_is_healthy(host: Any) -> None:
    health = ceph_json(host, "health", "detail")
    assert health["status"] == "HEALTH_OK", health.get("checks")


def test_pools_carry_the_requested_settings(host: Any) -> None:
    pools = {p["pool_name"]: p for p in ceph_json(host, "osd", "pool", "ls", "detail")}
    for pool in VARS["ceph_pools_pools"]:
        have = pools[pool["name"]]
        want_pg = VARS["ceph_pools_pg_overrides"].get(pool["name"], pool["pg_num"])
        assert (have["size"], have["min_size"]) == (
            VARS["ceph_pools_size"],
            VARS["ceph_pools_min_size"],
        ), pool["name"]
        assert have["pg_num"] == want_pg, pool["name"]
        assert have["pg_autoscale_mode"] == "off", pool["name"]
        assert "rgw" in have["application_metadata"], pool["name"]


def test_two_radosgw_behind_haproxy(host: Any) -> None:
    assert host.socket(
        f"tcp://{VARS['ceph_rgw_frontend_address']}:{VARS['ceph_rgw_frontend_port']}"
    ).is_listening
    for port in RGW_PORTS:
        assert host.socket(f"tcp://127.0.0.1:{port}").is_listening
    assert len(host.process.filter(comm="radosgw")) == VARS["ceph_rgw_count_per_host"]
    assert len(host.process.filter(comm="haproxy")) >= 1


def test_profile_files_are_private_to_the_serving_user(host: Any) -> None:
    user = host.user(VARS["kvtier_user_name"])
    directory = host.file(f"{user.home}/.aws")
    assert (directory.user, directory.group, directory.mode) == (user.name, user.group, 0o700)
    for name in ("credentials", "config"):
        f = host.file(f"{user.home}/.aws/{name}")
        assert (f.user, f.group, f.mode) == (user.name, user.group, 0o600), name
    config = host.file(f"{user.home}/.aws/config").content_string
    assert "addressing_style = path" in config
    assert "request_checksum_calculation = when_required" in config


def test_s3_put_get_list_delete_through_haproxy(s3: Any) -> None:
    bucket, name = VARS["rgw_bucket_name"], f"molecule/{uuid.uuid4().hex}"
    body = os.urandom(3 << 20)
    assert s3.meta.endpoint_url == FRONTEND
    s3.put_object(Bucket=bucket, Key=name, Body=body)
    assert s3.get_object(Bucket=bucket, Key=name)["Body"].read() == body
    listed = s3.list_objects_v2(Bucket=bucket, Prefix=name)
    assert [o["Key"] for o in listed.get("Contents", [])] == [name]
    s3.delete_object(Bucket=bucket, Key=name)
    assert s3.list_objects_v2(Bucket=bucket, Prefix=name)["KeyCount"] == 0


def test_lifecycle_rule_expires_cache_objects(s3: Any) -> None:
    rules = s3.get_bucket_lifecycle_configuration(Bucket=VARS["rgw_bucket_name"])["Rules"]
    mine = [r for r in rules if r["ID"] == "kvtier-cache-expiry"]
    assert len(mine) == 1
    assert mine[0]["Status"] == "Enabled"
    assert mine[0]["Expiration"]["Days"] == VARS["rgw_bucket_expiration_days"]


def test_s3_keeps_working_with_one_radosgw_down(host: Any, s3: Any, key: str) -> None:
    bucket = VARS["rgw_bucket_name"]
    control(host, "stop", RGW_PROGRAMS[:1])
    try:
        assert not host.socket(f"tcp://127.0.0.1:{RGW_PORTS[0]}").is_listening
        for i in range(20):  # leastconn would send some of these to the stopped instance
            body = f"{i}".encode() * 1000
            s3.put_object(Bucket=bucket, Key=key, Body=body)
            assert s3.get_object(Bucket=bucket, Key=key)["Body"].read() == body
    finally:
        control(host, "start", RGW_PROGRAMS[:1])
    back = host.socket(f"tcp://127.0.0.1:{RGW_PORTS[0]}")
    wait_until(lambda: back.is_listening, 60, "the radosgw instance to listen again")


def test_object_survives_restart_of_every_ceph_daemon(host: Any, s3: Any, key: str) -> None:
    bucket, body = VARS["rgw_bucket_name"], os.urandom(5 << 20)
    s3.put_object(Bucket=bucket, Key=key, Body=body)
    daemons = programs(host, "ceph-mon") + programs(host, "ceph-mgr") + programs(host, "ceph-osd")
    assert len(daemons) == 3, daemons
    control(host, "stop", [*RGW_PROGRAMS, *reversed(daemons)])
    assert not host.process.filter(comm="ceph-osd") and not host.process.filter(comm="ceph-mon")
    control(host, "start", [*daemons, *RGW_PROGRAMS])
    wait_until(lambda: host.run("ceph tell osd.0 version").rc == 0, 120, "osd.0 to answer")
    wait_until(lambda: all_pgs_active_clean(host), 120, "all PGs active+clean")
    wait_until(endpoint_ok, 120, "the S3 endpoint")
    got = s3.get_object(Bucket=bucket, Key=key)["Body"].read()
    assert hashlib.sha256(got).hexdigest() == hashlib.sha256(body).hexdigest()


def test_killed_radosgw_is_restarted(host: Any) -> None:
    """Daemons outlive the play: the service manager restarts a gateway that died."""
    port = host.socket(f"tcp://127.0.0.1:{RGW_PORTS[-1]}")
    before = host.check_output(f"supervisorctl pid {RGW_PROGRAMS[-1]}")
    host.check_output(f"kill -9 {before}")
    wait_until(
        lambda: host.check_output(f"supervisorctl pid {RGW_PROGRAMS[-1]}") not in ("0", before),
        60,
        "supervisor to restart the killed radosgw",
    )
    wait_until(lambda: port.is_listening, 60, "the restarted radosgw to listen")


def test_pool_drift_is_corrected_and_only_the_drift(host: Any) -> None:
    """ceph_pools reads the pools and changes only what differs from the inventory."""
    pool = "default.rgw.log"
    host.check_output(f"ceph osd pool set {pool} pg_autoscale_mode warn")
    # As a user runs it: without molecule's ANSIBLE_*/MOLECULE_* settings (relative role paths).
    unset = " ".join(f"-u {k}" for k in os.environ if k.startswith(("ANSIBLE_", "MOLECULE_")))
    env = f"env {unset} ANSIBLE_CONFIG={REPO}/ansible.cfg ANSIBLE_NOCOLOR=1"
    run = host.run(f"cd {REPO} && {env} .venv/bin/ansible-playbook -v site.yml --tags ceph_pools")
    assert run.rc == 0, run.stdout[-2000:]
    assert "osd pool set default.rgw.log pg_autoscale_mode off" in run.stdout
    recap = [line for line in run.stdout.splitlines() if line.startswith("localhost")]
    assert recap and "changed=1 " in recap[-1], recap
    pools = {p["pool_name"]: p for p in ceph_json(host, "osd", "pool", "ls", "detail")}
    assert pools[pool]["pg_autoscale_mode"] == "off"


def _error_code(call: Callable[[], Any]) -> str:
    """The S3 error code a call fails with ("" when it succeeds)."""
    try:
        call()
    except ClientError as err:
        return str(err.response.get("Error", {}).get("Code", ""))
    return ""


@pytest.fixture
def other_tenant(host: Any) -> Iterator[dict[str, Any]]:
    """Another RGW user with a bucket and an object in it, removed afterwards."""
    uid = f"molecule-other-{uuid.uuid4().hex[:12]}"
    created = json.loads(
        host.check_output(f"radosgw-admin user create --uid {uid} --display-name {uid}")
    )
    keys = created["keys"][0]
    client = _without_expect_continue(
        boto3.client(
            "s3",
            endpoint_url=FRONTEND,
            region_name=VARS["aws_profile_region"],
            aws_access_key_id=keys["access_key"],
            aws_secret_access_key=keys["secret_key"],
            config=Config(
                s3={"addressing_style": "path"},
                request_checksum_calculation="when_required",
                response_checksum_validation="when_required",
            ),
        )
    )
    tenant = {"uid": uid, "bucket": uid, "key": "private/object"}
    try:
        client.create_bucket(Bucket=tenant["bucket"])
        client.put_object(Bucket=tenant["bucket"], Key=tenant["key"], Body=b"not for kvtier")
        yield {**tenant, "owner_client": client}
    finally:
        host.run(f"radosgw-admin user rm --uid {uid} --purge-data")


def test_cache_bucket_carries_the_quota_of_the_inventory(host: Any) -> None:
    stats = json.loads(
        host.check_output(f"radosgw-admin bucket stats --bucket {VARS['rgw_bucket_name']}")
    )
    quota = stats["bucket_quota"]
    assert quota["enabled"] is True
    assert quota["max_size"] == int(VARS["rgw_bucket_quota_max_size_gb"] * (1 << 30))
    assert quota["max_objects"] == -1


def test_rgw_user_may_own_one_bucket_and_holds_no_admin_caps(host: Any) -> None:
    info = json.loads(host.check_output(f"radosgw-admin user info --uid {VARS['rgw_bucket_user']}"))
    assert info["max_buckets"] == 1
    assert info["caps"] == []


def test_serving_user_cannot_create_another_bucket_but_uses_the_cache_bucket(
    host: Any, s3: Any
) -> None:
    other = f"kvtier-other-{uuid.uuid4().hex[:12]}"
    code = _error_code(lambda: s3.create_bucket(Bucket=other))
    if not code:  # the restriction is gone: leave no bucket behind
        host.run(f"radosgw-admin bucket rm --bucket {other} --purge-objects")
    assert code == "TooManyBuckets"
    assert [b["Name"] for b in s3.list_buckets()["Buckets"]] == [VARS["rgw_bucket_name"]]
    # The cache bucket itself still takes, serves and drops objects.
    bucket, name, body = VARS["rgw_bucket_name"], f"molecule/{uuid.uuid4().hex}", os.urandom(4096)
    s3.put_object(Bucket=bucket, Key=name, Body=body)
    assert s3.get_object(Bucket=bucket, Key=name)["Body"].read() == body
    s3.delete_object(Bucket=bucket, Key=name)
    assert _error_code(lambda: s3.head_object(Bucket=bucket, Key=name)) == "404"


def test_serving_user_cannot_list_read_or_write_another_users_bucket(
    s3: Any, other_tenant: dict[str, Any]
) -> None:
    bucket, key = other_tenant["bucket"], other_tenant["key"]
    assert bucket not in [b["Name"] for b in s3.list_buckets()["Buckets"]]
    assert _error_code(lambda: s3.list_objects_v2(Bucket=bucket)) == "AccessDenied"
    assert _error_code(lambda: s3.get_object(Bucket=bucket, Key=key)) == "AccessDenied"
    assert _error_code(lambda: s3.head_object(Bucket=bucket, Key=key)) in ("403", "AccessDenied")
    assert _error_code(lambda: s3.put_object(Bucket=bucket, Key="x", Body=b"x")) == "AccessDenied"
    assert _error_code(lambda: s3.delete_object(Bucket=bucket, Key=key)) == "AccessDenied"
    owner = other_tenant["owner_client"]
    assert owner.get_object(Bucket=bucket, Key=key)["Body"].read() == b"not for kvtier"
