"""The monitoring role: off by default (nothing runs); bad inventory values stop it in preflight,
naming the variable, before anything changes; its configuration is rendered from the inventory
and passes promtool. Runs the real playbooks with `-e` overrides and the preflight/configure tags
only; the configure runs write into a temporary directory (the role's paths and program name
overridden), so the host's Prometheus is never touched. promtool comes from Debian's prometheus
package."""

from __future__ import annotations

import re
import shutil
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from _ansible import REPO, assert_fails_in_preflight, run_playbook

ON = {"monitoring_enabled": True}


def _preflight(extra_vars: dict[str, object], *args: str) -> subprocess.CompletedProcess[str]:
    return run_playbook(
        "playbooks/monitoring.yml", {**ON, **extra_vars}, "--tags", "monitoring_preflight", *args
    )


def test_off_by_default_nothing_runs() -> None:
    # The local inventory leaves monitoring_enabled false: `make deploy` gets no Prometheus.
    done = run_playbook("playbooks/monitoring.yml", {})
    assert done.returncode == 0, done.stdout[-3000:]
    assert re.search(r"localhost\s*:\s*ok=1\s+changed=0\s", done.stdout), done.stdout[-2000:]
    # Only the role play's fact gathering ran (ok=1): each of the role's tasks was skipped.
    assert re.search(
        r"TASK \[monitoring : Prometheus is installed\] \**\nskipping: \[localhost\]", done.stdout
    ), done.stdout[-3000:]


@pytest.fixture
def port() -> Iterator[int]:
    """A port on 127.0.0.1 that this test process listens on."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


def test_taken_port_stops_site_yml_in_its_preflight(port: int) -> None:
    done = run_playbook(
        "site.yml", {**ON, "monitoring_prometheus_port": port}, "--tags", "monitoring_preflight"
    )
    assert_fails_in_preflight(
        done,
        rf"monitoring_prometheus_port: 127\.0\.0\.1:{port} is taken by another process: pid "
        r"\d+ .*Stop that process, or set monitoring_prometheus_port to a free port",
    )
    # Failed in playbooks/preflight.yml, before the Ceph plays ran.
    assert "Ceph cluster" not in done.stdout.split("Preflight - monitoring")[-1]


CASES = {
    "no serving hosts": (
        {"monitoring_scrape_group": "no_such_group"},
        r"monitoring needs vLLM servers to scrape: hosts in the inventory group 'no_such_group' "
        r"\(monitoring_scrape_group\) or monitoring_scrape_targets",
    ),
    "target without a port": (
        {"monitoring_scrape_targets": ["gpu-1"]},
        r"monitoring_scrape_targets as \"address:port\" strings; got \['gpu-1'\]",
    ),
    "timeout longer than the interval": (
        {"monitoring_scrape_interval": "5s", "monitoring_scrape_timeout": "10s"},
        r"monitoring_scrape_timeout \(10s\) must not be longer than monitoring_scrape_interval "
        r"\(5s\)",
    ),
    "retention that is no duration": (
        {"monitoring_prometheus_retention": "two weeks"},
        r"monitoring_prometheus_retention \(two weeks\) a duration such as 15d",
    ),
    "rules file missing": (
        {"monitoring_rules_file": "/nonexistent/kvtier-alerts.yml"},
        r"monitoring_rules_file /nonexistent/kvtier-alerts\.yml is not a file on the control node",
    ),
    "listen address that is a host name": (
        {"monitoring_prometheus_listen_address": "prometheus.local"},
        r"monitoring_prometheus_listen_address \(prometheus\.local\) must be an IPv4 address",
    ),
    "port out of range": (
        {"monitoring_prometheus_port": 70000},
        r"monitoring_prometheus_port \(70000\) a TCP port",
    ),
    "port that is not a number": (
        {"monitoring_prometheus_port": "ninety"},
        r"argument 'monitoring_prometheus_port' is of type str and we were unable to convert to "
        r"int",
    ),
    "unknown scheme": (
        {"monitoring_scrape_scheme": "ftp"},
        r"value of monitoring_scrape_scheme must be one of: http, https, got: ftp",
    ),
}


@pytest.mark.parametrize("extra_vars, message", CASES.values(), ids=CASES.keys())
def test_bad_value_fails_in_preflight(extra_vars: dict[str, object], message: str) -> None:
    assert_fails_in_preflight(_preflight(extra_vars), message)


def test_missing_monitoring_group_stops_it_before_the_role(tmp_path: Path) -> None:
    inventory = tmp_path / "hosts.yml"
    local = {"ansible_connection": "local", "ansible_python_interpreter": "/usr/bin/python3"}
    inventory.write_text(yaml.safe_dump({"all": {"hosts": {"localhost": local}}}))
    assert_fails_in_preflight(
        _preflight({}, "-i", str(inventory)),
        r"monitoring_enabled is true but the inventory group 'monitoring' is missing or empty",
    )


def _tmp_paths(tmp_path: Path) -> dict[str, object]:
    """The role's files in a temporary directory, and a program name supervisord does not
    know (the reload handler signals it)."""
    return {
        "_monitoring_config": str(tmp_path / "prometheus.yml"),
        "_monitoring_rules_dir": str(tmp_path / "rules"),
        "_monitoring_storage": str(tmp_path / "data"),
        "_monitoring_program": "kvtier-prometheus-test",
    }


CONFIGURE = ("--tags", "monitoring_preflight,monitoring_configure")


def test_someone_elses_configuration_is_refused_unless_replacing_and_kept(tmp_path: Path) -> None:
    config = tmp_path / "prometheus.yml"
    theirs = "global:\n  scrape_interval: 1m\n"  # neither Debian's nor the role's
    config.write_text(theirs)
    paths = _tmp_paths(tmp_path)
    assert_fails_in_preflight(
        _preflight(paths),
        rf"{config} on localhost: neither Debian's shipped file nor written by this role, .* set "
        r"monitoring_prometheus_replace_config: true for one run to replace it",
    )
    replacing = run_playbook(
        "playbooks/monitoring.yml",
        {**ON, **paths, "monitoring_prometheus_replace_config": True},
        *CONFIGURE,
    )
    assert replacing.returncode == 0, replacing.stdout[-3000:]
    assert "Written by kvtier's monitoring role" in config.read_text()
    # Kept for the teardown to put back.
    assert (tmp_path / "prometheus.yml.kvtier-saved").read_text() == theirs


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool not installed")
def test_configuration_is_rendered_from_the_inventory_and_passes_promtool(tmp_path: Path) -> None:
    first = run_playbook("playbooks/monitoring.yml", {**ON, **_tmp_paths(tmp_path)}, *CONFIGURE)
    assert first.returncode == 0, first.stdout[-3000:]
    doc = yaml.safe_load((tmp_path / "prometheus.yml").read_text())
    # The local inventory's server listens on 127.0.0.1:8100 (vllm_server_host/_port).
    assert doc["scrape_configs"][0]["static_configs"] == [
        {"targets": ["127.0.0.1:8100"], "labels": {"host": "localhost"}}
    ]
    assert doc["rule_files"] == [str(tmp_path / "rules" / "kvtier-alerts.yml")]
    rules = REPO / "monitoring" / "prometheus" / "kvtier-alerts.yml"
    assert (tmp_path / "rules" / "kvtier-alerts.yml").read_text() == rules.read_text()
    # No file was there before: nothing kept.
    assert not (tmp_path / "prometheus.yml.kvtier-saved").exists()
    # Written by the role (its marker): accepted as its own on the next run, which changes nothing.
    again = run_playbook("playbooks/monitoring.yml", {**ON, **_tmp_paths(tmp_path)}, *CONFIGURE)
    assert again.returncode == 0, again.stdout[-3000:]
    assert re.search(r"localhost\s*:\s*ok=\d+\s+changed=0\s", again.stdout), again.stdout[-2000:]
