"""Session fixture ``ceph_s3``: the local Ceph RGW S3 endpoint, from the project's own playbook.

If the endpoint of the local inventory is not up, the fixture runs
``ansible-playbook site.yml --tags ceph`` (the same roles users deploy with) and, at the end of
the session, ``playbooks/teardown.yml`` — it removes only what it started. A cluster that was
already up is used as it is and left running.

Pytest sessions on one machine coordinate through an advisory lock (/tmp/kvtier-ceph-s3.lock):
every session holds it shared while it uses the endpoint; a session that finds the endpoint
down takes it exclusively to deploy; the deploying session tears down only once it gets the
lock exclusively again, i.e. after every other session is done with the endpoint. Anything
else that must not lose the cluster (a long manual test) can hold it shared too:
`flock -s /tmp/kvtier-ceph-s3.lock <command>`.
"""

from __future__ import annotations

import configparser
import fcntl
import json
import os
import pwd
import subprocess
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import pytest
import yaml
from _s3 import S3Env, s3_prefix

REPO = Path(__file__).resolve().parents[2]
ANSIBLE_PLAYBOOK = REPO / ".venv" / "bin" / "ansible-playbook"
LOCAL_VARS = REPO / "inventories" / "local" / "group_vars" / "all"
LOCK_FILE = Path("/tmp/kvtier-ceph-s3.lock")
DEPLOY_TIMEOUT_S = 900


@dataclass(frozen=True)
class CephS3:
    """What a client needs to use the local RGW through haproxy, as the serving user would."""

    endpoint_url: str
    region: str
    bucket: str
    access_key: str
    secret_key: str
    profile: str
    credentials_file: Path
    config_file: Path


def _inventory_vars() -> dict[str, object]:
    values: dict[str, object] = {}
    for name in ("kvtier.yml", "ceph.yml"):
        values.update(yaml.safe_load((LOCAL_VARS / name).read_text()) or {})
    return values


def _endpoint_up(url: str) -> bool:
    request = urllib.request.Request(url, method="HEAD")
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            return int(response.status) == 200
    except (urllib.error.URLError, OSError):
        return False


def _read_profile(home: Path, profile: str, bucket: str) -> CephS3 | None:
    """The profile the playbook wrote for the serving user, or None if it is not (all) there."""
    credentials_file, config_file = home / ".aws" / "credentials", home / ".aws" / "config"
    credentials, config = configparser.ConfigParser(), configparser.ConfigParser()
    credentials.read(credentials_file)
    config.read(config_file)
    section = f"profile {profile}" if profile != "default" else "default"
    if not credentials.has_section(profile) or not config.has_section(section):
        return None
    return CephS3(
        endpoint_url=config.get(section, "endpoint_url"),
        region=config.get(section, "region"),
        bucket=bucket,
        access_key=credentials.get(profile, "aws_access_key_id"),
        secret_key=credentials.get(profile, "aws_secret_access_key"),
        profile=profile,
        credentials_file=credentials_file,
        config_file=config_file,
    )


def _health_problem() -> str | None:
    """Why the cluster cannot serve S3 (HEALTH_ERR, e.g. a full OSD blocks every write), or None."""
    try:
        done = subprocess.run(
            ["ceph", "health", "--format", "json"], capture_output=True, text=True, timeout=60
        )
    except (OSError, subprocess.TimeoutExpired) as err:
        return f"`ceph health` failed: {err}"
    if done.returncode != 0:
        return f"`ceph health` failed (rc={done.returncode}): {done.stderr.strip()}"
    health = json.loads(done.stdout)
    if health.get("status") != "HEALTH_ERR":
        return None
    checks = {name: c["summary"]["message"] for name, c in health.get("checks", {}).items()}
    return f"the local Ceph cluster is HEALTH_ERR: {checks} (see `ceph health detail`)"


def _playbook(*args: str) -> None:
    if not ANSIBLE_PLAYBOOK.exists():
        pytest.fail(f"{ANSIBLE_PLAYBOOK} is missing: run `make collections` first")
    env = {**os.environ, "ANSIBLE_CONFIG": str(REPO / "ansible.cfg"), "ANSIBLE_NOCOLOR": "1"}
    try:
        done = subprocess.run(
            [str(ANSIBLE_PLAYBOOK), *args],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=DEPLOY_TIMEOUT_S,
        )
    except subprocess.TimeoutExpired as err:
        pytest.fail(f"ansible-playbook {' '.join(args)} ran over {DEPLOY_TIMEOUT_S} s: {err}")
    if done.returncode != 0:
        pytest.fail(
            f"ansible-playbook {' '.join(args)} failed (rc={done.returncode}):\n"
            f"{done.stdout[-4000:]}\n{done.stderr[-2000:]}"
        )


def _lock(mode: int) -> IO[str]:
    handle = LOCK_FILE.open("a")
    fcntl.flock(handle, mode)
    return handle


@pytest.fixture(scope="session")
def ceph_s3() -> Iterator[CephS3]:
    """The local S3 endpoint; deployed by the project's playbook if it is not up."""
    values = _inventory_vars()
    port = values["ceph_rgw_frontend_port"]
    address = values.get("ceph_rgw_frontend_address", "127.0.0.1")
    profile, bucket = str(values["aws_profile_name"]), str(values["rgw_bucket_name"])
    user = str(values.get("kvtier_user_name", "kvtier"))

    endpoint = f"http://{address}:{port}/"

    def current() -> CephS3 | None:
        try:
            home = Path(pwd.getpwnam(user).pw_dir)
        except KeyError:
            return None
        found = _read_profile(home, profile, bucket)
        return found if found is not None and _endpoint_up(endpoint) else None

    lock = _lock(fcntl.LOCK_SH)  # a running endpoint is shared: no waiting on other sessions
    started = False
    try:
        found = current()
        if found is None:
            fcntl.flock(lock, fcntl.LOCK_EX)  # deploy alone; re-check, another may have done it
            found = current()
            if found is None:
                if os.geteuid() != 0:
                    pytest.fail("the local Ceph S3 endpoint is down and deploying it needs root")
                started = not _endpoint_up(endpoint)
                _playbook("site.yml", "--tags", "ceph")
                found = current()
            fcntl.flock(lock, fcntl.LOCK_SH)
        if found is None:
            pytest.fail(f"after the playbook, {endpoint} or AWS profile '{profile}' is missing")
        problem = _health_problem()
        if problem:
            pytest.fail(problem)
        yield found
    finally:
        if started:
            fcntl.flock(lock, fcntl.LOCK_EX)  # waits for every other session to be done
            _playbook("playbooks/teardown.yml")
        lock.close()


@pytest.fixture(scope="session")
def tiny_model_files(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model's config and tokenizer, without weights (`tokenizers` only, no torch)."""
    from kvtier_tools.model import write_tokenizer_and_config

    return write_tokenizer_and_config(tmp_path_factory.mktemp("tiny-model"))


@pytest.fixture
def s3(
    request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[tuple[S3Env, str]]:
    """(environment, a fresh prefix of the test S3 endpoint); the prefix is emptied afterwards
    (connector/tests/_s3.py)."""
    yield from s3_prefix(request, tmp_path, monkeypatch)
