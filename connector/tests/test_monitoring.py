"""monitoring/: the Grafana dashboard and the Prometheus rules read only series that exist.

Every expression is parsed by a real PromQL parser; every metric it names is one docs/metrics.md
lists (kvtier's own and the few of vLLM's next to them), and every metric the connector
registers is listed there too. With promtool installed (Debian's `prometheus` package), the
rules pass `promtool check rules` and their unit tests (`promtool test rules`). The e2e side,
the same series scraped from a real server: e2e/test_e2e_shared_bucket.py.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
from _monitoring import (
    REPO,
    RULE_TESTS,
    RULES,
    dashboard,
    dashboard_queries,
    documented_metrics,
    monitored_selectors,
    rule_queries,
    rules,
    selectors,
    series_family,
)

from kvtier import metrics


def test_every_expression_parses_and_reads_series() -> None:
    queries = {**dashboard_queries(), **rule_queries()}
    assert len(dashboard_queries()) >= 20 and len(rule_queries()) >= 8
    for where, expr in queries.items():
        try:
            found = selectors(expr)
        except ValueError as exc:
            pytest.fail(f"{where}: {exc}\n{expr}")
        assert found, f"{where}: selects no series: {expr}"


def test_every_series_read_is_a_documented_metric() -> None:
    documented = documented_metrics()
    missing = {
        f"{where}: {s.metric}"
        for where, s in monitored_selectors()
        if series_family(s.metric) not in documented
    }
    assert not missing, f"not in docs/metrics.md: {sorted(missing)}"


def test_every_metric_the_connector_registers_is_documented() -> None:
    registered = {m.name for m in metrics.COUNTERS + metrics.TIER_COUNTERS + metrics.HISTOGRAMS}
    registered |= {m.name for m in metrics.TIER_GAUGES}
    registered |= {
        m.name for m in (metrics.UNCACHED_REQUESTS, metrics.TIER_ERRORS, metrics.TIER_CIRCUIT_OPEN)
    }
    assert len(registered) >= 30
    documented = documented_metrics()
    # Counters are registered without the _total their series carry.
    missing = sorted(n for n in registered if not {n, f"{n}_total"} & documented)
    assert not missing, f"in kvtier/metrics.py, not in docs/metrics.md: {missing}"


def test_dashboard_panels_follow_the_server_and_model_variables() -> None:
    for where, expr in dashboard_queries().items():
        for s in selectors(expr):
            labels = dict(s.regex)
            assert labels.get("instance") == "$instance", f"{where}: {s.metric} without $instance"
            assert labels.get("model_name") == "$model", f"{where}: {s.metric} without $model"
    names = [v["name"] for v in dashboard()["templating"]["list"]]
    assert names == ["datasource", "instance", "model"]


def test_every_alert_says_how_bad_and_what_to_do() -> None:
    alerts = [r for r in rules() if "alert" in r]
    assert {a["alert"] for a in alerts} >= {
        "KvtierHitRateCollapsed",
        "KvtierRemoteTierCircuitOpen",
        "KvtierRemoteTierErrors",
        "KvtierDiskFull",
    }
    for alert in alerts:
        assert alert["labels"]["severity"] in ("info", "warning", "critical"), alert["alert"]
        assert alert["annotations"]["summary"] and alert["annotations"]["description"]


def _promtool() -> str:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool not installed (Debian package prometheus; make test installs it)")
    return promtool


def _run(*argv: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=120, check=False)


def test_promtool_accepts_the_rules() -> None:
    done = _run(_promtool(), "check", "rules", str(RULES), cwd=REPO)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"SUCCESS: {len(rules())} rules found" in done.stdout


def test_alerts_fire_on_their_synthetic_series_and_only_then() -> None:
    done = _run(_promtool(), "test", "rules", RULE_TESTS.name, cwd=RULE_TESTS.parent)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS" in done.stdout
