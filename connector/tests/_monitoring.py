"""The PromQL of monitoring/ (Grafana dashboard, Prometheus rules), parsed by a real PromQL
parser (promql-parser), for the unit tests (test_monitoring.py) and the e2e scrape of a real
server (e2e/test_e2e_shared_bucket.py)."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import promql_parser
import yaml

REPO = Path(__file__).resolve().parents[2]
DASHBOARD = REPO / "monitoring" / "grafana" / "kvtier-dashboard.json"
RULES = REPO / "monitoring" / "prometheus" / "kvtier-alerts.yml"
RULE_TESTS = REPO / "monitoring" / "prometheus" / "kvtier-alerts.test.yml"
METRICS_DOC = REPO / "docs" / "metrics.md"

#: Grafana's built-in variables the dashboard uses where PromQL needs a value (a range); the
#: template variables ($instance, $model) sit inside label matcher strings and stay as they are.
GRAFANA_RANGES = {"$__rate_interval": "5m"}
#: Series that exist only once something happened: a counter with a label per cause gets one
#: series per cause at its first failure (docs/metrics.md, "Tiers").
SERIES_ON_FIRST_EVENT = {"kvtier:tier_errors_total"}
_HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")


@dataclass(frozen=True)
class Selector:
    """One vector selector of an expression: its metric and its ``label="value"`` matchers."""

    metric: str
    equal: tuple[tuple[str, str], ...]
    regex: tuple[tuple[str, str], ...]


def _panels(panels: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for panel in panels:
        out.append(panel)
        out.extend(_panels(panel.get("panels", [])))  # collapsed rows hold theirs
    return out


def dashboard() -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return doc


def dashboard_queries() -> dict[str, str]:
    """``"panel title / refId"`` -> expression, Grafana's ranges filled in."""
    out: dict[str, str] = {}
    for panel in _panels(dashboard()["panels"]):
        for target in panel.get("targets", []):
            expr = target["expr"]
            for variable, value in GRAFANA_RANGES.items():
                expr = expr.replace(variable, value)
            out[f"{panel['title']} / {target['refId']}"] = expr
    return out


def dashboard_variable_metrics() -> dict[str, str]:
    """Template variable -> the metric its ``label_values(metric{...}, label)`` reads."""
    out: dict[str, str] = {}
    for variable in dashboard()["templating"]["list"]:
        if variable["type"] != "query":
            continue
        found = re.match(r"label_values\(([a-zA-Z_:][a-zA-Z0-9_:]*)", variable["definition"])
        if found is None:
            raise ValueError(f"variable {variable['name']}: not label_values(metric..., label)")
        out[variable["name"]] = found.group(1)
    return out


def rules() -> list[dict[str, Any]]:
    """Every rule (recording and alerting) of the rules file."""
    doc = yaml.safe_load(RULES.read_text())
    return [rule for group in doc["groups"] for rule in group["rules"]]


def rule_queries() -> dict[str, str]:
    """``record`` or ``alert`` name -> expression."""
    return {rule.get("record") or rule["alert"]: rule["expr"] for rule in rules()}


def recorded_names() -> set[str]:
    return {rule["record"] for rule in rules() if "record" in rule}


def selectors(expr: str) -> list[Selector]:
    """The vector selectors of ``expr`` (raises ValueError when it does not parse)."""
    found: list[Selector] = []

    def visit(node: Any) -> None:
        if isinstance(node, promql_parser.VectorSelector):
            name = node.name or next(
                (m.value for m in node.matchers.matchers if m.name == "__name__"), ""
            )
            equal = tuple(
                (m.name, m.value)
                for m in node.matchers.matchers
                if m.op == promql_parser.MatchOp.Equal and m.name != "__name__"
            )
            regex = tuple(
                (m.name, m.value)
                for m in node.matchers.matchers
                if m.op == promql_parser.MatchOp.Re
            )
            found.append(Selector(name, equal, regex))

    promql_parser.walk(promql_parser.parse(expr), visit)
    return found


def series_family(metric: str) -> str:
    """The documented name of a selected series: a histogram's ``_bucket``/``_sum``/``_count``
    series belong to the histogram."""
    for suffix in _HISTOGRAM_SUFFIXES:
        if metric.endswith(suffix):
            return metric.removesuffix(suffix)
    return metric


def documented_metrics() -> set[str]:
    """Every ``kvtier:`` and ``vllm:`` name docs/metrics.md mentions in backticks."""
    return set(re.findall(r"`((?:kvtier|vllm):[a-z_]+)", METRICS_DOC.read_text()))


def monitored_selectors() -> list[tuple[str, Selector]]:
    """(where, selector) of every series the dashboard and the rules read, recorded ones left
    out (Prometheus makes them from the others)."""
    recorded = recorded_names()
    out: list[tuple[str, Selector]] = []
    for where, expr in {**dashboard_queries(), **rule_queries()}.items():
        out += [(where, s) for s in selectors(expr) if s.metric not in recorded]
    for variable, metric in dashboard_variable_metrics().items():
        out.append((f"variable {variable}", Selector(metric, (), ())))
    return out
