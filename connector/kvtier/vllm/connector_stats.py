"""kvtier's counters inside vLLM's metrics: KVConnectorStats and Prometheus.

Scheduler and workers each produce a flat ``{name: number}`` delta per step; vLLM sums them
(``aggregate``) across workers and with the scheduler's own, ships them to the API process,
logs them ("KV Transfer metrics: ...") and hands them to `KvtierPromMetrics.observe`. Nothing
crosses processes any other way (no module globals, no default Prometheus registry). A key
ending in ``@samples`` holds a list of durations (seconds) for a histogram; aggregating joins
the lists.

The keys, the series they feed and what they mean are catalogued in `kvtier.metrics`
(documented in docs/metrics.md). Counters are ``kvtier:<name>_total`` in base units (tokens,
chunks, bytes, seconds), histograms ``kvtier:<name>_seconds``; the gauges
``kvtier:tier_circuit_open``, ``kvtier:tier_used_bytes`` and ``kvtier:tier_capacity_bytes`` are
moved by the changes the processes report, so each is their sum (workers of several ranks with
their caps) and needs no report from a process that has nothing new.
The ``kvtier:`` prefix follows vLLM's own ``vllm:`` metrics on the same endpoint.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)
from vllm.v1.metrics.utils import create_metric_per_engine

from kvtier.metrics import (
    BUCKETS,
    COUNTERS,
    HISTOGRAMS,
    SAMPLES,
    TIER_CIRCUIT_OPEN,
    TIER_COUNTERS,
    TIER_ERRORS,
    TIER_GAUGES,
    TIERS,
    UNCACHED_REQUESTS,
)


@dataclass
class KvtierConnectorStats(KVConnectorStats):  # type: ignore[misc]
    """Flat, summable counters (``data: dict[str, float]``; ``@samples`` keys hold lists)."""

    def reset(self) -> None:
        self.data: dict[str, Any] = {}

    def aggregate(self, other: KVConnectorStats) -> KvtierConnectorStats:
        merged: dict[str, Any] = dict(self.data)
        for key, value in other.data.items():
            if key.endswith(SAMPLES):
                merged[key] = [*merged.get(key, []), *value]
            else:
                merged[key] = merged.get(key, 0) + value
        return KvtierConnectorStats(data=merged)

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = {}
        for key, value in sorted(self.data.items()):
            if key.endswith(SAMPLES):
                name = key.removesuffix(SAMPLES)
                out[f"{name}.count"] = len(value)
                if value:
                    out[f"{name}.mean_ms"] = round(1000 * sum(value) / len(value), 2)
            else:
                out[key] = round(value, 4) if isinstance(value, float) else value
        return out

    def is_empty(self) -> bool:
        return not any(self.data.values())


class KvtierPromMetrics(KVConnectorPromMetrics):  # type: ignore[misc]
    """Prometheus metrics, registered by vLLM's metric classes (multiprocess-safe)."""

    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._values = per_engine_labelvalues

        def per_engine(cls: Any, name: str, doc: str, **kw: Any) -> dict[int, Any]:
            metric = cls(name=name, documentation=doc, labelnames=labelnames, **kw)
            engines: dict[int, Any] = create_metric_per_engine(metric, per_engine_labelvalues)
            return engines

        def per_tier(cls: Any, name: str, doc: str, extra: tuple[str, ...] = ()) -> Any:
            return cls(name=name, documentation=doc, labelnames=[*labelnames, "tier", *extra])

        self._plain = [(m.key, per_engine(self._counter_cls, m.name, m.help)) for m in COUNTERS]
        self._tiered = [(m.key, per_tier(self._counter_cls, m.name, m.help)) for m in TIER_COUNTERS]
        self._hist = [
            (m.key, per_engine(self._histogram_cls, m.name, m.help, buckets=list(BUCKETS)))
            for m in HISTOGRAMS
        ]
        self._uncached = self._counter_cls(
            name=UNCACHED_REQUESTS.name,
            documentation=UNCACHED_REQUESTS.help,
            labelnames=[*labelnames, "reason"],
        )
        self._errors = per_tier(self._counter_cls, TIER_ERRORS.name, TIER_ERRORS.help, ("cause",))
        self._circuit_open = per_tier(
            self._gauge_cls, TIER_CIRCUIT_OPEN.name, TIER_CIRCUIT_OPEN.help
        )
        self._fill = [(m.key, per_tier(self._gauge_cls, m.name, m.help)) for m in TIER_GAUGES]
        # 0, not absent, while all is well (rates and alerts then see 0, not "no data"). The fill
        # gauges appear with the first report of a tier with a cap: 0 bytes of a 0-byte cap is
        # not a tier's fill.
        for values in per_engine_labelvalues.values():
            for tier in TIERS:
                self._circuit_open.labels(*values, tier).set(0)
                for _, counter in self._tiered:
                    counter.labels(*values, tier)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        data = transfer_stats_data
        values = self._values[engine_idx]
        for key, metric in self._plain:
            if data.get(key):
                metric[engine_idx].inc(data[key])
        for key, hist in self._hist:
            for seconds in data.get(key + SAMPLES, ()):
                hist[engine_idx].observe(seconds)
        for pattern, counter in self._tiered:
            for tier in TIERS:
                value = data.get(pattern.format(tier=tier), 0)
                if value:
                    counter.labels(*values, tier).inc(value)
        for key, value in data.items():
            if key.startswith("uncached_requests.") and value:
                self._uncached.labels(*values, key.partition(".")[2]).inc(value)
            if key.startswith("tier.") and ".errors." in key and value:
                tier, _, cause = key.removeprefix("tier.").partition(".errors.")
                self._errors.labels(*values, tier, cause).inc(value)
        for pattern, gauge in self._fill:
            for tier in TIERS:
                change = data.get(pattern.format(tier=tier), 0)
                if change:
                    gauge.labels(*values, tier).inc(change)
        for tier in TIERS:
            change = data.get(f"tier.{tier}.circuit_opened", 0)
            change -= data.get(f"tier.{tier}.circuit_closed", 0)
            if change:
                self._circuit_open.labels(*values, tier).inc(change)
