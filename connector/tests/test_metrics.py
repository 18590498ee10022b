"""One catalogue of metrics (kvtier.metrics): every key the scheduler, the workers and the
stores report is in it (so it reaches /metrics, or the catalogue says why it does not), and
every series in it is fed by some process (no entry that nothing counts)."""

from __future__ import annotations

import ast
from pathlib import Path

from kvtier import metrics
from kvtier.stats import StoreStats, TierStats, store_deltas
from kvtier.vllm.scheduler import SchedulerCounters

VLLM_DIR = Path(metrics.__file__).parent / "vllm"


def _scheduler_keys() -> set[str]:
    counters = SchedulerCounters(hit_tokens_by_tier={"disk": 1}, uncached={"lora_unreadable": 1})
    return set(counters.take())


def _store_keys() -> set[str]:
    every = {f: 1 for f in TierStats.__dataclass_fields__ if f != "errors"}
    tier = TierStats(**every, errors={"timeout": 1})
    now = StoreStats(dropped_writes=1, remote_lookup_requests=1, tiers={"s3": tier})
    return set(store_deltas(StoreStats(), now))


def _literal_keys(module: str, calls: set[str]) -> set[str]:
    """String keys a module counts: ``self._count("key")`` style calls, ``data["key"] = ...``
    and ``data.update(key=...)``."""
    keys: set[str] = set()
    for node in ast.walk(ast.parse((VLLM_DIR / module).read_text())):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            if node.func.attr in calls and node.args and isinstance(node.args[0], ast.Constant):
                keys.add(node.args[0].value)
                if node.func.attr == "_sample":
                    keys.add(node.args[0].value + metrics.SAMPLES)
            if node.func.attr == "update" and getattr(node.func.value, "id", None) == "data":
                keys |= {kw.arg for kw in node.keywords if kw.arg}
        subscript = isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant)
        if subscript and getattr(node.value, "id", None) == "data":
            keys.add(node.slice.value)
    return keys


def reported_keys() -> set[str]:
    worker = _literal_keys("worker.py", {"_count", "_sample"})
    connector = _literal_keys("connector.py", set())
    return _scheduler_keys() | _store_keys() | worker | connector


def test_the_key_finders_find_what_each_process_reports() -> None:
    keys = reported_keys()
    # One key of each producer, so that an empty scan cannot pass the tests below.
    for key in (
        "lookup_tokens",
        "loaded_tokens",
        "save_copy_seconds@samples",
        "tier.s3.errors.timeout",
        "kv_events_published",
        "uncached_requests.lora_unreadable",
    ):
        assert key in keys
    assert len(keys) >= 40


def test_every_reported_key_is_catalogued() -> None:
    missing = sorted(k for k in reported_keys() if not metrics.catalogued(k))
    assert not missing, f"reported but not in kvtier/metrics.py: {missing}"


def test_a_key_outside_the_catalogue_is_caught() -> None:
    assert not metrics.catalogued("loaded_chunk")  # a typo of loaded_chunks
    assert not metrics.catalogued("tier.nvme.hits")  # not a tier
    assert metrics.catalogued("tier.nvme.hits".replace("nvme", "disk"))


def test_every_catalogued_series_is_fed() -> None:
    keys = reported_keys()
    entries = metrics.COUNTERS + metrics.TIER_COUNTERS + metrics.TIER_GAUGES
    entries += (metrics.UNCACHED_REQUESTS, metrics.TIER_ERRORS, metrics.TIER_CIRCUIT_OPEN)
    unfed = [m.name for m in entries if not any(metrics._regex(m.key).fullmatch(k) for k in keys)]
    unfed += [m.name for m in metrics.HISTOGRAMS if m.key + metrics.SAMPLES not in keys]
    assert not unfed, f"catalogued, but no process reports them: {unfed}"
