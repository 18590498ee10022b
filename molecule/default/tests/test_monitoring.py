"""The monitoring role is off by default (monitoring_enabled: false in the local inventory): the
converged site has no Prometheus of the role: no supervisor program, no role-written
configuration or rules, nothing listening on its port."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[3]
VARS = {
    **yaml.safe_load((REPO / "roles" / "monitoring" / "defaults" / "main.yml").read_text()),
    **yaml.safe_load(
        (REPO / "inventories" / "local" / "group_vars" / "all" / "monitoring.yml").read_text()
    ),
}
ROLE_VARS = yaml.safe_load((REPO / "roles" / "monitoring" / "vars" / "main.yml").read_text())


def test_monitoring_is_off_by_default(host: Any) -> None:
    assert VARS["monitoring_enabled"] is False
    program = ROLE_VARS["_monitoring_program"]
    assert not host.file(f"/etc/supervisor/conf.d/{program}.conf").exists
    assert not host.file("/etc/prometheus/rules/kvtier-alerts.yml").exists
    config = host.file(ROLE_VARS["_monitoring_config"])
    assert not (config.exists and ROLE_VARS["_monitoring_marker"] in config.content_string)
    port = VARS["monitoring_prometheus_port"]
    assert not host.socket(
        f"tcp://{VARS['monitoring_prometheus_listen_address']}:{port}"
    ).is_listening
