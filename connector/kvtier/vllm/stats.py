"""kvtier's counters inside vLLM's metrics: KVConnectorStats and Prometheus.

Scheduler and workers each produce a flat ``{name: number}`` delta per step; vLLM sums them
(``aggregate``) across workers and with the scheduler's own, ships them to the API process,
logs them ("KV Transfer metrics: ...") and hands them to `KvtierPromMetrics.observe`. Nothing
crosses processes any other way (no module globals, no default Prometheus registry). A key
ending in ``@samples`` holds a list of durations (seconds) for a histogram; aggregating joins
the lists.

Names (values are token or chunk counts unless the name says otherwise):
- scheduler: ``lookup_requests``, ``lookup_tokens`` (prompt tokens looked up), ``hit_tokens``
  (tokens planned to load), ``hit_tokens.<tier>`` (by the tier expected to serve them),
  ``planned_save_chunks``, ``remote_unadmitted_chunks`` and ``remote_late_admitted_chunks``
  (admission to the remote tier, kvtier.admission), ``remote_lookups``, ``lookup_timeouts``
  (remote lookups given up after lookup_timeout_secs), ``remote_lookup_seconds@samples``,
  ``prefix_divergences`` (requests whose prompt diverged from an earlier one's where their
  lookup stopped),
  ``uncached_requests.<reason>`` (requests served without kvtier, `kvtier.vllm.identity`);
- worker: ``loaded_chunks``, ``loaded_tokens``, ``load_failed_chunks``, ``load_failed_tokens``,
  ``load_timeouts``, ``load_seconds`` (and ``@samples``), ``saved_chunks``, ``saved_bytes``,
  ``save_failed_chunks``, ``save_dropped_chunks``, ``save_copy_seconds`` (and ``@samples``);
- both (from their store): ``dropped_writes``, ``remote_lookup_requests`` and per tier
  ``tier.<tier>.{hits,misses,bytes_read,puts,bytes_written,errors,errors.<cause>,
  circuit_opened,circuit_closed}``;
- worker only (its store's tiers with a cap): ``tier.<tier>.{evictions,used_bytes,
  capacity_bytes}``, the last two as changes (the first report carries the whole value). The
  scheduler's store only looks up: its disk index is the one it read at start.

Prometheus (docs/metrics.md): counters ``kvtier:<name>_total`` in base units (tokens, chunks,
bytes, seconds), histograms ``kvtier:<name>_seconds``, the gauges ``kvtier:tier_circuit_open``,
``kvtier:tier_used_bytes`` and ``kvtier:tier_capacity_bytes``. A gauge is moved by the changes
the processes report, so it is their sum (workers of several ranks with their caps) and needs
no report from a process that has nothing new.
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

from kvtier.stats import SAMPLES

TIERS = ("cpu", "disk", "s3")
#: Histogram buckets (seconds) of loads, saves and remote lookups: 1 ms .. 10 s.
_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


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


# (metric name without _total, stats key, help text)
_COUNTERS: tuple[tuple[str, str, str], ...] = (
    ("kvtier:lookup_requests", "lookup_requests", "Requests kvtier looked up (one lookup each)."),
    ("kvtier:lookup_tokens", "lookup_tokens", "Prompt tokens kvtier looked up."),
    ("kvtier:hit_tokens", "hit_tokens", "Prompt tokens kvtier planned to load."),
    ("kvtier:loaded_tokens", "loaded_tokens", "Prompt tokens loaded into the KV cache."),
    (
        "kvtier:load_failed_tokens",
        "load_failed_tokens",
        "Prompt tokens whose load failed (vLLM recomputed them).",
    ),
    ("kvtier:saved_chunks", "saved_chunks", "Chunks handed to the store."),
    (
        "kvtier:remote_unadmitted_chunks",
        "remote_unadmitted_chunks",
        "Chunks saved without the remote tier: their prefix not yet seen remote_admit_after times.",
    ),
    (
        "kvtier:remote_late_admitted_chunks",
        "remote_late_admitted_chunks",
        "Chunks a local tier held, saved to the remote tier on the sight that admitted them.",
    ),
    ("kvtier:saved_bytes", "saved_bytes", "Payload bytes handed to the store."),
    ("kvtier:dropped_writes", "dropped_writes", "Background tier writes dropped (backpressure)."),
    (
        "kvtier:save_dropped_chunks",
        "save_dropped_chunks",
        "Chunks not saved: no pinned save buffer came free within save_wait_secs (CUDA).",
    ),
    ("kvtier:save_failed_chunks", "save_failed_chunks", "Chunks whose copy out failed."),
    (
        "kvtier:kv_events_published",
        "kv_events_published",
        "KV events (BlockStored, BlockRemoved) kvtier handed to vLLM's publisher.",
    ),
    (
        "kvtier:kv_events_dropped",
        "kv_events_dropped",
        "KV events or workers' reports dropped: over the bounds, or of chunks no longer known.",
    ),
    ("kvtier:remote_lookups", "remote_lookups", "Lookups that asked the remote tier."),
    (
        "kvtier:remote_lookup_requests",
        "remote_lookup_requests",
        "Requests (HEADs) the remote tier's lookups made.",
    ),
    (
        "kvtier:lookup_timeouts",
        "lookup_timeouts",
        "Remote lookups given up after lookup_timeout_secs (the request went on without them).",
    ),
    ("kvtier:load_timeouts", "load_timeouts", "Loads that took longer than blocking_timeout_secs."),
    (
        "kvtier:prefix_divergences",
        "prefix_divergences",
        "Requests whose prompt differs from an earlier one with the same first chunk right where "
        "their lookup stopped (a changing value in the prompt; the server log names the chunk).",
    ),
    # Where a hit's time goes (seconds, summed over the steps that loaded chunks).
    ("kvtier:load_fetch_seconds", "load_fetch_seconds", "Fetching loaded chunks from the tiers."),
    (
        "kvtier:load_verify_seconds",
        "load_verify_seconds",
        "Checking fetched chunks' headers and checksums (part of the fetch).",
    ),
    ("kvtier:load_copy_seconds", "load_copy_seconds", "Copying fetched chunks into the KV cache."),
    (
        "kvtier:forward_seconds",
        "forward_seconds",
        "The forward passes of the steps that loaded chunks (after the load).",
    ),
    ("kvtier:forward_steps", "forward_steps", "Steps that loaded chunks."),
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
    (
        "kvtier:tier_bytes_written",
        "tier.{tier}.bytes_written",
        "Bytes written to the tier (chunk header and payload).",
    ),
    (
        "kvtier:tier_evictions",
        "tier.{tier}.evictions",
        "Chunks the tier evicted to stay under its cap (CPU, disk).",
    ),
    (
        "kvtier:tier_circuit_opened",
        "tier.{tier}.circuit_opened",
        "Times the tier's circuit breaker opened (the tier stopped being asked).",
    ),
)
# (metric name, stats key of its changes, help text): gauges of a tier's fill.
_TIER_GAUGES: tuple[tuple[str, str, str], ...] = (
    (
        "kvtier:tier_used_bytes",
        "tier.{tier}.used_bytes",
        "Bytes the tier holds now (CPU, disk: the ones with a cap), summed over the workers.",
    ),
    (
        "kvtier:tier_capacity_bytes",
        "tier.{tier}.capacity_bytes",
        "The tier's cap in bytes (max_local_cpu_size, max_local_disk_size), summed over the "
        "workers.",
    ),
)
_HISTOGRAMS: tuple[tuple[str, str, str], ...] = (
    ("kvtier:load_seconds", "load_seconds", "Loading the chunks of one step (fetch and copy)."),
    (
        "kvtier:save_seconds",
        "save_copy_seconds",
        "vLLM's thread in wait_for_save: queueing one step's chunk copies (the store's work "
        "runs in the save thread).",
    ),
    (
        "kvtier:remote_lookup_seconds",
        "remote_lookup_seconds",
        "A request's wait for the remote tier's lookup (answered or given up).",
    ),
)


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

        self._plain = [(k, per_engine(self._counter_cls, n, d)) for n, k, d in _COUNTERS]
        self._tiered = [(k, per_tier(self._counter_cls, n, d)) for n, k, d in _TIER_COUNTERS]
        self._hist = [
            (k, per_engine(self._histogram_cls, n, d, buckets=list(_BUCKETS)))
            for n, k, d in _HISTOGRAMS
        ]
        self._uncached = self._counter_cls(
            name="kvtier:uncached_requests",
            documentation="Requests served without kvtier (nothing looked up, loaded or saved), "
            "by reason: namespace_not_allowed, unknown_extra_key (an identity the chunk keys "
            "cannot cover), lora_unreadable (adapter files kvtier cannot read).",
            labelnames=[*labelnames, "reason"],
        )
        self._errors = per_tier(
            self._counter_cls,
            "kvtier:tier_errors",
            "Failed tier operations, by cause (timeout, connection, checksum, no_space, ...).",
            ("cause",),
        )
        self._circuit_open = per_tier(
            self._gauge_cls,
            "kvtier:tier_circuit_open",
            "Processes (scheduler, workers) whose circuit breaker keeps the tier out now.",
        )
        self._fill = [(k, per_tier(self._gauge_cls, n, d)) for n, k, d in _TIER_GAUGES]
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
