"""The S3 secret key and the gateway API key of the converged site never show where they should
not: in any process's arguments (`ps`), supervisor's and the programs' logs (vLLM, Ceph, haproxy;
the journal under systemd), world-readable service definitions and facts, the kv_verify reports,
or Ansible's output at -vvv of the plays that handle them. Each test greps for the actual values,
read from the serving user's AWS credentials and the gateway key file; failures name the secret
and where it was found, never the value."""

from __future__ import annotations

import configparser
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[3]
LOCAL_VARS = REPO / "inventories" / "local" / "group_vars" / "all"


def _vars() -> dict[str, Any]:
    values: dict[str, Any] = {}
    for role in ("gateway_profile", "vllm_server"):
        values.update(yaml.safe_load((REPO / "roles" / role / "defaults" / "main.yml").read_text()))
    for name in ("kvtier.yml", "ceph.yml", "gateway.yml", "vllm_server.yml"):
        values.update(yaml.safe_load((LOCAL_VARS / name).read_text()))
    return values


VARS = _vars()
USER = VARS["kvtier_user_name"]
KEY_FILE = VARS["gateway_profile_api_key_file"].replace(
    "{{ gateway_profile_name }}", VARS["gateway_profile_name"]
)
SERVICE = VARS["vllm_server_service_name"]
# Where logs of the site's programs go: supervisord and the programs it runs without a log
# of their own (s3_balancer), vLLM (vllm_server_log_dir), Ceph and its radosgw/haproxy programs.
LOG_DIRS = ["/var/log/supervisor", VARS["vllm_server_log_dir"], "/var/log/ceph"]
# Readable by every user of the host: program and unit definitions, start scripts, local facts,
# the connector's configuration.
PUBLIC_FILES = [
    "/etc/supervisor",
    "/etc/systemd/system",
    "/usr/local/libexec/kvtier",
    "/etc/ansible/facts.d",
    VARS["vllm_server_kvtier_config_file"],
]
REPORTS = REPO / "reports" / "kv_verify"


@pytest.fixture(scope="module")
def secrets(host: Any) -> dict[str, str]:
    """The values themselves: the RGW secret key of the serving user's profile, the API key."""
    credentials = configparser.ConfigParser()
    home = host.user(USER).home
    credentials.read_string(host.file(f"{home}/.aws/credentials").content_string)
    found = {
        "RGW secret key": credentials[VARS["aws_profile_name"]]["aws_secret_access_key"].strip(),
        "gateway API key": host.file(KEY_FILE).content_string.strip(),
    }
    # Long enough that a match is the secret, not a coincidence.
    assert all(len(value) >= 20 for value in found.values()), [len(v) for v in found.values()]
    return found


@pytest.fixture(scope="module")
def patterns(secrets: dict[str, str]) -> Iterator[dict[str, str]]:
    """One private pattern file per secret, for `grep -F -f` (never the value on a command line,
    where `ps` would show it)."""
    with tempfile.TemporaryDirectory(prefix="kvtier-secrets.") as scratch:
        files = {}
        for name, value in secrets.items():
            path = Path(scratch) / name.replace(" ", "-")
            path.write_text(value + "\n")
            path.chmod(0o600)
            files[name] = str(path)
        yield files


def _files_holding(host: Any, pattern: str, paths: list[str]) -> list[str]:
    """Files under `paths` (those that exist) that contain the secret in `pattern`."""
    existing = [p for p in paths if host.file(p).exists]
    if not existing:
        return []
    found = host.run(f"grep -rlaF -f {pattern} -- {' '.join(existing)}")
    assert found.rc in (0, 1), found.stderr
    return found.stdout.split()


def test_secrets_are_in_no_process_arguments(host: Any, secrets: dict[str, str]) -> None:
    listing = host.check_output("ps -eo pid=,comm=,args=")
    for name, value in secrets.items():
        holders = [line.split()[:2] for line in listing.splitlines() if value in line]
        assert not holders, f"the {name} is in the arguments of (pid, command): {holders}"


def test_secrets_are_in_no_log(host: Any, patterns: dict[str, str]) -> None:
    for name, pattern in patterns.items():
        assert not _files_holding(host, pattern, LOG_DIRS), f"the {name} is in these logs"
        if host.file("/run/systemd/system").is_directory:
            journal = host.run(f"journalctl --no-pager -o cat | grep -caF -f {pattern}")
            assert journal.stdout.strip() == "0", f"the {name} is in the journal"


def test_vllm_log_exists_and_holds_no_secret(host: Any, patterns: dict[str, str]) -> None:
    """The server's own log (where a connector or vLLM error would print its settings)."""
    log = f"{VARS['vllm_server_log_dir']}/{SERVICE}.log"
    assert host.file(log).exists and host.file(log).size > 0
    for name, pattern in patterns.items():
        assert not _files_holding(host, pattern, [log]), f"the {name} is in {log}"


def test_secrets_are_in_no_world_readable_definition(host: Any, patterns: dict[str, str]) -> None:
    for name, pattern in patterns.items():
        held = _files_holding(host, pattern, PUBLIC_FILES)
        assert not held, f"the {name} is in {held}"


def test_secrets_are_in_no_kv_verify_report(patterns: dict[str, str], host: Any) -> None:
    reports = sorted(str(p) for p in REPORTS.glob("*.*"))
    assert reports, f"no kv_verify report in {REPORTS}"
    for name, pattern in patterns.items():
        held = _files_holding(host, pattern, reports)
        assert not held, f"the {name} is in {held}"


def test_secrets_are_not_in_ansible_output_at_vvv(host: Any, secrets: dict[str, str]) -> None:
    """The plays that read, write and pass the keys, at -vvv (module arguments and results,
    the commands Ansible runs), as a user runs them on the converged site."""
    unset = " ".join(f"-u {k}" for k in os.environ if k.startswith(("ANSIBLE_", "MOLECULE_")))
    env = f"env {unset} ANSIBLE_CONFIG={REPO}/ansible.cfg ANSIBLE_NOCOLOR=1"
    run = host.run(
        f"cd {REPO} && {env} .venv/bin/ansible-playbook site.yml "
        "--tags rgw_bucket,aws_profile,gateway_profile -vvv"
    )
    output = run.stdout + run.stderr
    assert run.rc == 0, output[-3000:]
    # The run did reach the tasks that handle the keys.
    for task in ("rgw_bucket : Keys in use are known", "aws_profile : Credentials",
                 "gateway_profile : API key is read back"):  # fmt: skip
        assert f"TASK [{task}" in output, task
    for name, value in secrets.items():
        tasks, task = set(), "?"
        for line in output.splitlines():
            if line.startswith("TASK ["):
                task = line[6 : line.find("]")]
            if value in line:
                tasks.add(task)
        assert not tasks, f"the {name} is in the -vvv output of: {sorted(tasks)}"
