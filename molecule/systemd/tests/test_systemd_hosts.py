"""The site on hosts with systemd as PID 1, as their operator sees them: every unit the roles
wrote enabled and active; `--check --diff` changes nothing; a rebooted host comes back serving,
its first request served from the cache it had (the disk tier mounted again by the roles' unit,
Ceph's daemons started by theirs), with no Ansible run; a unit killed with SIGKILL is started
again by systemd; no unit's journal holds a secret. Two negative controls show that the reboot
and kill checks fail when a unit is not enabled or has no restart policy."""

from __future__ import annotations

import configparser
import json
import os
import random
import re
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import testinfra
from scenario_playbook import recap, run_playbook

from kvtier_tools.completions import Completion, stream_completion
from kvtier_tools.server import metric_sum, parse_metrics

REPO = Path(__file__).resolve().parents[3]
INVENTORY = (
    Path(os.environ["MOLECULE_INVENTORY_FILE"]).parent
    if os.environ.get("MOLECULE_INVENTORY_FILE")
    else REPO / "molecule" / "systemd" / "inventory"
)
STORAGE = "trixie-storage"
SERVING = "bookworm-serving"
MACHINES = REPO / "molecule" / "systemd" / "machines.sh"

# The units the roles write or enable, by their default names (roles' defaults and vars).
STORAGE_UNITS = (
    f"ceph-mon@{STORAGE}",
    f"ceph-mgr@{STORAGE}",
    "ceph-osd@0",
    f"ceph-radosgw@rgw.kvtier-{STORAGE}-1",
    f"ceph-radosgw@rgw.kvtier-{STORAGE}-2",
    f"haproxy-rgw-kvtier-{STORAGE}",
)
SERVING_UNITS = ("kvtier-disk-tier", "kvtier-vllm")


@cache
def host(name: str) -> Any:
    return testinfra.get_host(f"ansible://{name}?ansible_inventory={INVENTORY}")


def address(name: str) -> str:
    return str(host(name).ansible.get_variables()["ansible_host"])


def unit_state(name: str, unit: str) -> dict[str, str]:
    out = host(name).check_output(
        f"systemctl show {unit} -p ActiveState -p UnitFileState -p MainPID -p NRestarts"
    )
    return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)


def wait_for(what: str, check: Callable[[], bool], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if check():
                return
        except (OSError, RuntimeError, AssertionError):
            pass
        time.sleep(1)
    raise AssertionError(f"{what}: not within {timeout:.0f} s")


class Server:
    """bookworm-serving's vLLM as a client reaches it over the bridge, from the local fact its
    vllm_server role wrote."""

    def __init__(self) -> None:
        facts = host(SERVING).ansible("setup", "filter=ansible_local", check=False)
        self.fact = facts["ansible_facts"]["ansible_local"]["kvtier_vllm"]
        key_file = self.fact["api_key_file"]
        self.api_key = host(SERVING).file(key_file).content_string.strip() if key_file else ""
        self.url = str(self.fact["server_url"])
        self.model = str(self.fact["model"])

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=5) as resp:
                return bool(resp.status == 200)
        except (OSError, urllib.error.URLError):
            return False

    def complete(self, tokens: list[int]) -> Completion:
        return stream_completion(
            self.url, self.model, tokens, 16, api_key=self.api_key, timeout=300
        )

    def metric(self, name: str, **labels: str) -> float:
        with urllib.request.urlopen(self.url + "/metrics", timeout=10) as resp:
            return metric_sum(parse_metrics(resp.read().decode()), name, **labels)


@cache
def server() -> Server:
    return Server()


def prompt(num_tokens: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(300, 8000) for _ in range(num_tokens)]


def reboot(name: str) -> None:
    """`systemctl reboot` inside the container; returns once it booted again and systemd
    finished starting its units (a marker in /run, a tmpfs of each boot, tells the boots apart)."""
    h = host(name)
    h.check_output("touch /run/kvtier-test-before-reboot")
    h.run("systemctl reboot")

    def booted_again() -> bool:
        leader = subprocess.run(
            [str(MACHINES), "leader", name], capture_output=True, text=True, check=False
        ).stdout.strip()
        if not leader:
            return False
        probe = subprocess.run(
            [
                "nsenter",
                "-t",
                leader,
                "-a",
                "sh",
                "-c",
                "test ! -e /run/kvtier-test-before-reboot && systemctl is-system-running --wait",
            ],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        return probe.stdout.strip() in {"running", "degraded"}

    wait_for(f"{name} boots again after systemctl reboot", booted_again, 180)


def serving_after_reboot(timeout: float = 240) -> list[str]:
    """What a rebooted serving host lacks: the disk tier mounted by its unit, vLLM serving
    (within `timeout` seconds: it answers in about 20 after a boot)."""
    problems = []
    mounted = host(SERVING).run("findmnt -n -o SOURCE /var/cache/kvtier/disk")
    if mounted.rc != 0:
        problems.append("the disk tier is not mounted")
    try:
        wait_for("vLLM answers /health", server().healthy, timeout)
    except AssertionError as exc:
        problems.append(str(exc))
    return problems


def test_every_unit_the_roles_wrote_is_enabled_and_active() -> None:
    for name, units in ((STORAGE, STORAGE_UNITS), (SERVING, SERVING_UNITS)):
        for unit in units:
            state = unit_state(name, unit)
            assert state.get("UnitFileState") == "enabled", f"{name}: {unit} {state}"
            assert state.get("ActiveState") == "active", f"{name}: {unit} {state}"
    # kvtier-disk-tier is a oneshot that stays active once the tier is mounted.
    assert host(SERVING).mount_point("/var/cache/kvtier/disk").exists
    # What the site says of these hosts: systemd, Debian 13 with Ceph Reef, Debian 12.
    facts = host(STORAGE).ansible("setup", "filter=ansible_*", check=False)["ansible_facts"]
    assert facts["ansible_service_mgr"] == "systemd"
    assert facts["ansible_distribution_major_version"] == "13"
    assert host(STORAGE).check_output("ceph --version").split()[2].startswith("18.")
    facts = host(SERVING).ansible("setup", "filter=ansible_*", check=False)["ansible_facts"]
    assert facts["ansible_service_mgr"] == "systemd"
    assert facts["ansible_distribution_major_version"] == "12"


def test_check_mode_changes_nothing_on_either_host() -> None:
    run = run_playbook(INVENTORY, "site.yml", "--check", "--diff")
    out = run.stdout
    assert run.returncode == 0, recap(run) + out[-4000:]
    counts = dict(re.findall(r"^(\S+)\s*:\s*ok=\d+\s+changed=(\d+)", out, re.M))
    assert {STORAGE, SERVING} <= set(counts), out[-2000:]
    changed = {name: n for name, n in counts.items() if int(n)}
    assert not changed, f"--check --diff would change {changed}:\n{out[-4000:]}"


def test_a_rebooted_host_comes_back_and_serves_its_first_request_from_the_cache() -> None:
    """Both hosts rebooted (storage first, then serving): every unit comes back by itself, the
    disk tier is attached and mounted by the roles' unit, and the first request after it is
    served from the cache with the tokens computed before."""
    # A prompt of its own each run: the test can run again on the same hosts.
    doc = prompt(2048, seed=time.time_ns())
    puts = server().metric("kvtier:tier_puts_total", tier="disk")
    before = server().complete(doc)
    wait_for(
        "the prompt's chunks are stored in the disk tier",
        lambda: server().metric("kvtier:tier_puts_total", tier="disk") >= puts + 7,
        60,
    )
    reboot(STORAGE)
    for unit in STORAGE_UNITS:
        wait_for(
            f"{STORAGE}: {unit} active after the reboot",
            lambda unit=unit: unit_state(STORAGE, unit).get("ActiveState") == "active",
            60,
        )
    reboot(SERVING)
    assert serving_after_reboot() == []
    journal = host(SERVING).check_output("journalctl -b -u kvtier-disk-tier -o cat")
    assert "mounted on /var/cache/kvtier/disk" in journal, journal
    after = server().complete(doc)
    assert after.token_ids == before.token_ids
    hit = sum(server().metric("kvtier:tier_hits_total", tier=t) for t in ("disk", "s3"))
    assert hit >= 7, f"{hit} chunks loaded after the reboot"
    # Ceph came back too: the chunks of the prompt are in the bucket through haproxy.
    assert chunk_objects() > 0


@cache
def rgw_credentials() -> tuple[str, str]:
    """The RGW user's access and secret key, from the profile the site wrote for the serving
    user."""
    home = server().fact["user_home"]
    creds = configparser.ConfigParser()
    creds.read_string(host(SERVING).file(f"{home}/.aws/credentials").content_string)
    return creds.get("kvtier", "aws_access_key_id"), creds.get("kvtier", "aws_secret_access_key")


def chunk_objects() -> int:
    import boto3
    from botocore.config import Config

    access_key, secret_key = rgw_credentials()
    client = boto3.client(
        "s3",
        endpoint_url=f"http://{address(STORAGE)}:7480",
        aws_access_key_id=access_key,
        aws_secret_access_key=secret_key,
        region_name="default",
        config=Config(s3={"addressing_style": "path"}),
    )
    return int(client.list_objects_v2(Bucket="kvtier-cache", Prefix="kv/").get("KeyCount", 0))


def test_a_unit_left_disabled_does_not_come_back_after_a_reboot() -> None:
    """The negative control of the reboot test: with the serving host's units disabled, the
    same check finds the disk tier unmounted and vLLM down after a reboot."""
    h = host(SERVING)
    h.check_output("systemctl disable " + " ".join(SERVING_UNITS))
    try:
        reboot(SERVING)
        # A minute is three times what vLLM needs after a boot when its unit is enabled.
        problems = serving_after_reboot(timeout=60)
        assert "the disk tier is not mounted" in problems
        assert any("vLLM answers /health" in p for p in problems)
    finally:
        h.check_output("systemctl enable --now " + " ".join(SERVING_UNITS))
    wait_for("vLLM answers /health again", server().healthy, 240)


KILLED = [(SERVING, "kvtier-vllm"), *((STORAGE, u) for u in STORAGE_UNITS[2:])]


def killed_and_restarted(name: str, unit: str, timeout: float) -> bool:
    before = unit_state(name, unit)
    host(name).check_output(f"systemctl kill -s SIGKILL {unit}")
    try:
        wait_for(
            f"{unit} running again",
            lambda: (
                (s := unit_state(name, unit))["ActiveState"] == "active"
                and s["MainPID"] not in {"0", before["MainPID"]}
            ),
            timeout,
        )
    except AssertionError:
        return False
    return True


@pytest.mark.parametrize(("name", "unit"), KILLED, ids=[u for _, u in KILLED])
def test_a_unit_killed_with_sigkill_is_started_again_by_systemd(name: str, unit: str) -> None:
    assert killed_and_restarted(name, unit, 60), f"{name}: {unit} {unit_state(name, unit)}"
    if unit == "kvtier-vllm":
        wait_for("vLLM answers /health after the kill", server().healthy, 240)


def test_a_unit_without_a_restart_policy_stays_down_after_sigkill() -> None:
    """The negative control of the kill test: the same radosgw unit with Restart=no."""
    unit = STORAGE_UNITS[3]
    h = host(STORAGE)
    dropin = f"/run/systemd/system/{unit}.service.d"
    h.check_output(f"mkdir -p {dropin} && printf '[Service]\\nRestart=no\\n' > {dropin}/test.conf")
    h.check_output("systemctl daemon-reload")
    try:
        assert not killed_and_restarted(STORAGE, unit, 15)
    finally:
        h.check_output(f"rm -rf {dropin} && systemctl daemon-reload")
        h.check_output(f"systemctl reset-failed {unit}; systemctl start {unit}")
    assert unit_state(STORAGE, unit)["ActiveState"] == "active"


def test_no_unit_journal_holds_a_secret() -> None:
    """The RGW user's secret key and the serving API key, as the hosts hold them, appear in no
    journal of either host (Ansible modules log their arguments there on systemd hosts)."""
    secrets = {"RGW secret key": rgw_credentials()[1]}
    if server().api_key:
        secrets["vLLM API key"] = server().api_key
    for name in (STORAGE, SERVING):
        journal = host(name).check_output("journalctl --no-pager -o json --output-fields=MESSAGE")
        # The journal is read at all: the site's own module calls are in it.
        assert "ansible" in journal.lower(), f"{name}: no Ansible entry in the journal"
        for what, value in secrets.items():
            assert len(value) >= 16, what
            assert value not in journal, f"{name}'s journal holds the {what}"
        # Per unit too, since entries can also carry binary MESSAGE fields.
        for line in journal.splitlines():
            if '"MESSAGE":[' in line:
                raw = bytes(json.loads(line)["MESSAGE"]).decode(errors="replace")
                assert all(v not in raw for v in secrets.values()), f"{name}: {raw[:200]}"
