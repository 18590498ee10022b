"""The converged fleet as its operator sees it: four separate hosts (network namespaces), each
with its own processes, addresses, paths and supervisord; serving hosts that reach RGW only
through their local, health-checked endpoint over both RGW hosts; and the cross-node step of
kv_verify, which proved that serve2 loads from Ceph what serve1 computed. First of all, a
second run of the site's hosts' plays (all but the serving play) changes nothing."""

from __future__ import annotations

import itertools
import re

import pytest
from _fleet import (
    SERVING,
    STORAGE,
    address,
    host,
    playbook,
    report,
    server,
    supervisorctl,
)
from scenario_playbook import recap


def test_a_second_run_changes_nothing_on_any_host() -> None:
    """Idempotence where four hosts differ from one: Ceph on storage1 with storage2's radosgw
    as its client, the serving hosts' local S3 endpoints, AWS profiles, disk tiers and gateway
    profiles, each under per-host names. (The serving play's second run is the embedded
    default's idempotence test; here its rollouts are test_3's.)"""
    run = playbook("site.yml", "--tags", "ceph,nvme_cache,gateway_profile")
    assert run.returncode == 0, recap(run) + run.stdout[-3000:]
    counts = dict(re.findall(r"^(\w+)\s*:\s*ok=\d+\s+changed=(\d+)", run.stdout, re.M))
    assert set(counts) == {*STORAGE, *SERVING}, recap(run)
    changed = {name: int(n) for name, n in counts.items() if int(n)}
    assert not changed, f"second run changed something on {changed}: {_changed_tasks(run.stdout)}"


def _changed_tasks(out: str) -> list[str]:
    """'TASK [...] -> changed: [host]' for each change in an ansible-playbook output."""
    found, task = [], ""
    for line in out.splitlines():
        if line.startswith("TASK ["):
            task = line.split("]")[0] + "]"
        elif line.startswith("changed: ["):
            found.append(f"{task} -> {line.split(' =>')[0]}")
    return found


@pytest.mark.parametrize("name", [*STORAGE, *SERVING])
def test_each_host_has_its_own_address_and_supervisord(name: str) -> None:
    h = host(name)
    assert f"inet {address(name)}/24" in h.check_output("ip -4 -o addr show dev eth0")
    # The host's own supervisord, in the host's own namespace.
    pid = supervisorctl(name, "pid")
    assert h.check_output(f"ip netns identify {pid}") == f"kvtier-fleet-{name}"


def _programs(name: str) -> dict[str, str]:
    out = supervisorctl(name, "status")
    return {line.split()[0]: line.split()[1] for line in out.splitlines()}


def test_daemons_run_where_the_inventory_put_them() -> None:
    assert {p: s for p, s in _programs("storage1").items()} == {
        "ceph-mon-storage1": "RUNNING",
        "ceph-mgr-storage1": "RUNNING",
        "ceph-osd-0": "RUNNING",
        "rgw-kvtier-storage1-1": "RUNNING",
        "haproxy-rgw-kvtier-storage1": "RUNNING",
    }
    assert _programs("storage2") == {
        "rgw-kvtier-storage2-1": "RUNNING",
        "haproxy-rgw-kvtier-storage2": "RUNNING",
    }
    for name in SERVING:
        assert _programs(name) == {
            f"haproxy-s3-{name}": "RUNNING",
            f"kvtier-vllm-{name}": "RUNNING",
        }


def test_per_host_paths_never_collide() -> None:
    """The hosts share one filesystem: everything that belongs to one host is its own."""
    facts = {name: server(name).fact for name in SERVING}
    for key in ("kvtier_config_file", "api_key_file", "user", "user_home", "service_name"):
        values = [facts[n][key] for n in SERVING]
        assert len(set(values)) == len(values), f"{key} shared by the serving hosts: {values}"
    # One venv, shared read-only.
    assert facts["serve1"]["venv"] == facts["serve2"]["venv"]
    loops = [
        host(n).check_output(f"findmnt -n -o SOURCE /var/cache/kvtier-fleet/{n}") for n in SERVING
    ]
    assert len(set(loops)) == 2 and all(loop.startswith("/dev/loop") for loop in loops)
    configs = {n: host(n).file(facts[n]["kvtier_config_file"]).content_string for n in SERVING}
    for n in SERVING:
        assert f"local_disk: /var/cache/kvtier-fleet/{n}" in configs[n]
    models = [
        host(n).check_output(
            f"tr '\\0' ' ' < /proc/{supervisorctl(n, 'pid', f'kvtier-vllm-{n}')}/cmdline"
        )
        for n in SERVING
    ]
    assert "/opt/kvtier/models/serve1/kvtier-tiny" in models[0]
    assert "/opt/kvtier/models/serve2/kvtier-tiny" in models[1]


def test_processes_stay_in_their_hosts() -> None:
    """Every process of a host's supervisord runs in that host's network namespace."""
    for name in (*STORAGE, *SERVING):
        h = host(name)
        for program, state in _programs(name).items():
            assert state == "RUNNING"
            pid = supervisorctl(name, "pid", program)
            assert h.check_output(f"ip netns identify {pid}") == f"kvtier-fleet-{name}", program


def test_serving_hosts_reach_rgw_only_through_their_local_endpoint() -> None:
    for name in SERVING:
        h = host(name)
        fact = server(name).fact
        aws = h.file(f"{fact['user_home']}/.aws/config").content_string
        assert "endpoint_url = http://127.0.0.1:7470" in aws
        cfg = h.file(f"/etc/haproxy/kvtier-s3-{name}.cfg").content_string
        for storage in STORAGE:
            assert f"server {storage} {address(storage)}:7480 check" in cfg
        # 127.0.0.1 here is the serving host's own loopback: nothing else listens on it.
        listening = h.check_output("ss -Hltn")
        assert "127.0.0.1:7470" in listening and f"{address(name)}:8100" in listening
        assert "7480" not in listening and "7481" not in listening


def test_rgw_hosts_answer_on_their_own_addresses() -> None:
    for name in STORAGE:
        out = host(name).check_output("ss -Hltn")
        assert f"{address(name)}:7480" in out  # haproxy, for the serving hosts
        assert "127.0.0.1:7481" in out  # radosgw, behind it only
    for a, b in itertools.permutations(STORAGE, 2):
        code = host(a).run(f"curl -s -o /dev/null -w '%{{http_code}}' http://{address(b)}:7480/")
        assert code.stdout == "200"


def test_cross_node_step_loaded_from_ceph_what_the_first_host_computed() -> None:
    data = report("cross-node")
    assert data["ok"], data["failure"]
    peer = data["peers"]["serve2"]
    assert peer["s3_share"] >= 0.9
    assert peer["identical"]
    for name in SERVING:
        assert report(name)["ok"], report(name)["failure"]
