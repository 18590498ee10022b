"""kvtier's counters inside vLLM's metrics: KVConnectorStats and Prometheus.

Scheduler and workers each produce a flat ``{name: number}`` delta per step; vLLM sums them
(``aggregate``) across workers and with the scheduler's own, ships them to the API process,
logs them ("KV Transfer metrics: ...") and hands them to `KvtierPromMetrics.observe`. Nothing
crosses processes any other way (no module globals, no default Prometheus registry).

Names (values are token or chunk counts unless the name says otherwise):
- scheduler: ``lookup_requests``, ``lookup_tokens`` (prompt tokens looked up), ``hit_tokens``
  (tokens planned to load), ``hit_tokens.<tier>`` (by the tier expected to serve them),
  ``planned_save_chunks``;
- worker: ``loaded_chunks``, ``loaded_tokens``, ``load_failed_chunks``, ``load_failed_tokens``,
  ``load_timeouts``, ``load_seconds``, ``saved_chunks``, ``saved_bytes``,
  ``save_failed_chunks``, ``save_copy_seconds``, ``dropped_writes`` and per tier
  ``tier.<tier>.{hits,misses,bytes_read,puts,bytes_written,errors}`` (chunks answered,
  verified, by that tier).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)
from vllm.v1.metrics.utils import create_metric_per_engine

TIERS = ("cpu", "disk", "s3")


@dataclass
class KvtierConnectorStats(KVConnectorStats):  # type: ignore[misc]
    """Flat, summable counters (``data: dict[str, float]``)."""

    def reset(self) -> None:
        self.data: dict[str, Any] = {}

    def aggregate(self, other: KVConnectorStats) -> KvtierConnectorStats:
        merged: dict[str, Any] = dict(self.data)
        for key, value in other.data.items():
            merged[key] = merged.get(key, 0) + value
        return KvtierConnectorStats(data=merged)

    def reduce(self) -> dict[str, int | float]:
        return {k: round(v, 4) if isinstance(v, float) else v for k, v in sorted(self.data.items())}

    def is_empty(self) -> bool:
        return not any(self.data.values())


# (metric name, stats key or key pattern with {tier}, help text)
_COUNTERS: tuple[tuple[str, str, str], ...] = (
    ("kvtier:lookup_tokens", "lookup_tokens", "Prompt tokens kvtier looked up."),
    ("kvtier:hit_tokens", "hit_tokens", "Prompt tokens kvtier planned to load."),
    ("kvtier:loaded_tokens", "loaded_tokens", "Prompt tokens loaded into the KV cache."),
    (
        "kvtier:load_failed_tokens",
        "load_failed_tokens",
        "Prompt tokens whose load failed (vLLM recomputed them).",
    ),
    ("kvtier:saved_chunks", "saved_chunks", "Chunks handed to the store."),
    ("kvtier:saved_bytes", "saved_bytes", "Payload bytes handed to the store."),
    ("kvtier:dropped_writes", "dropped_writes", "Background tier writes dropped (backpressure)."),
)
_TIER_COUNTERS: tuple[tuple[str, str, str], ...] = (
    (
        "kvtier:hit_tokens_by_tier",
        "hit_tokens.{tier}",
        "Prompt tokens kvtier planned to load, by the tier expected to serve them.",
    ),
    ("kvtier:tier_hits", "tier.{tier}.hits", "Chunks read and verified from the tier."),
    ("kvtier:tier_misses", "tier.{tier}.misses", "Chunk reads the tier could not answer."),
    ("kvtier:tier_bytes_read", "tier.{tier}.bytes_read", "Payload bytes read from the tier."),
    ("kvtier:tier_puts", "tier.{tier}.puts", "Chunks written to the tier."),
    ("kvtier:tier_errors", "tier.{tier}.errors", "Failed tier operations (all causes)."),
)


class KvtierPromMetrics(KVConnectorPromMetrics):  # type: ignore[misc]
    """Prometheus counters, registered by vLLM's metric classes (multiprocess-safe)."""

    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._plain: list[tuple[str, dict[int, Any]]] = []
        for name, key, doc in _COUNTERS:
            counter = self._counter_cls(name=name, documentation=doc, labelnames=labelnames)
            self._plain.append((key, create_metric_per_engine(counter, per_engine_labelvalues)))
        self._tiered: list[tuple[str, dict[int, dict[str, Any]]]] = []
        for name, pattern, doc in _TIER_COUNTERS:
            counter = self._counter_cls(
                name=name, documentation=doc, labelnames=[*labelnames, "tier"]
            )
            per_engine = {
                idx: {tier: counter.labels(*values, tier) for tier in TIERS}
                for idx, values in per_engine_labelvalues.items()
            }
            self._tiered.append((pattern, per_engine))

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        data = transfer_stats_data
        for key, per_engine in self._plain:
            value = data.get(key, 0)
            if value:
                per_engine[engine_idx].inc(value)
        for pattern, per_engine_tiers in self._tiered:
            for tier, metric in per_engine_tiers[engine_idx].items():
                value = data.get(pattern.format(tier=tier), 0)
                if value:
                    metric.inc(value)
