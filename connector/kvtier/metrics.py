"""Every number kvtier reports, in one place: the key a process counts it under, the series
vLLM's ``/metrics`` shows it as, and what it means.

Scheduler and workers each report a flat ``{key: number}`` delta per step
(`kvtier.vllm.connector_stats` sums them and feeds the series below; it imports vLLM, this
module does not). A key ending in ``SAMPLES`` holds durations (seconds) for a histogram. Keys
with ``{tier}`` are one per tier (``TIERS``), with ``{reason}`` / ``{cause}`` one per label
value.

Adding a metric is one entry here (name, key, meaning), the code that counts it under that
key, and its row in docs/metrics.md: connector/tests/test_metrics.py checks that every key the
scheduler, the workers and the store report is catalogued here, and test_monitoring that every
series here is documented (CONTRIBUTING.md).
"""

from __future__ import annotations

import re
from typing import NamedTuple

#: Suffix of a key that holds a list of durations (seconds) for a histogram.
SAMPLES = "@samples"
TIERS = ("cpu", "disk", "s3")
#: Histogram buckets (seconds) of loads, saves and remote lookups: 1 ms .. 10 s.
BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class Metric(NamedTuple):
    #: Prometheus name (a counter's series add ``_total``).
    name: str
    #: The stats key it is counted under.
    key: str
    help: str


# Counters: kvtier:<name>_total.
COUNTERS: tuple[Metric, ...] = (
    Metric(
        "kvtier:lookup_requests", "lookup_requests", "Requests kvtier looked up (one lookup each)."
    ),
    Metric("kvtier:lookup_tokens", "lookup_tokens", "Prompt tokens kvtier looked up."),
    Metric("kvtier:hit_tokens", "hit_tokens", "Prompt tokens kvtier planned to load."),
    Metric("kvtier:loaded_tokens", "loaded_tokens", "Prompt tokens loaded into the KV cache."),
    Metric("kvtier:loaded_chunks", "loaded_chunks", "Chunks loaded into the KV cache."),
    Metric(
        "kvtier:load_failed_chunks",
        "load_failed_chunks",
        "Chunks whose load failed (vLLM recomputed their tokens).",
    ),
    Metric(
        "kvtier:planned_save_chunks",
        "planned_save_chunks",
        "Chunks the scheduler asked the workers to save.",
    ),
    Metric(
        "kvtier:load_failed_tokens",
        "load_failed_tokens",
        "Prompt tokens whose load failed (vLLM recomputed them).",
    ),
    Metric("kvtier:saved_chunks", "saved_chunks", "Chunks handed to the store."),
    Metric(
        "kvtier:remote_unadmitted_chunks",
        "remote_unadmitted_chunks",
        "Chunks saved without the remote tier: their prefix not yet seen remote_admit_after times.",
    ),
    Metric(
        "kvtier:remote_late_admitted_chunks",
        "remote_late_admitted_chunks",
        "Chunks a local tier held, saved to the remote tier on the sight that admitted them.",
    ),
    Metric("kvtier:saved_bytes", "saved_bytes", "Payload bytes handed to the store."),
    Metric(
        "kvtier:dropped_writes", "dropped_writes", "Background tier writes dropped (backpressure)."
    ),
    Metric(
        "kvtier:save_dropped_chunks",
        "save_dropped_chunks",
        "Chunks not saved: no pinned save buffer came free within save_wait_secs (CUDA).",
    ),
    Metric(
        "kvtier:save_failed_chunks",
        "save_failed_chunks",
        "Chunks whose copy out failed, or that the store could not take.",
    ),
    Metric(
        "kvtier:kv_events_published",
        "kv_events_published",
        "KV events (BlockStored, BlockRemoved) kvtier handed to vLLM's publisher.",
    ),
    Metric(
        "kvtier:kv_events_dropped",
        "kv_events_dropped",
        "KV events or workers' reports dropped: over the bounds, or of chunks no longer known.",
    ),
    Metric("kvtier:remote_lookups", "remote_lookups", "Lookups that asked the remote tier."),
    Metric(
        "kvtier:remote_lookup_requests",
        "remote_lookup_requests",
        "Requests (HEADs) the remote tier's lookups made.",
    ),
    Metric(
        "kvtier:lookup_timeouts",
        "lookup_timeouts",
        "Remote lookups given up after lookup_timeout_secs (the request went on without them).",
    ),
    Metric(
        "kvtier:load_timeouts",
        "load_timeouts",
        "Loads that took longer than blocking_timeout_secs.",
    ),
    Metric(
        "kvtier:prefix_divergences",
        "prefix_divergences",
        "Requests whose prompt differs from an earlier one with the same first chunk right where "
        "their lookup stopped (a changing value in the prompt; the server log names the chunk).",
    ),
    # Where a hit's time goes (seconds, summed over the steps that loaded chunks).
    Metric(
        "kvtier:load_fetch_seconds", "load_fetch_seconds", "Fetching loaded chunks from the tiers."
    ),
    Metric(
        "kvtier:load_verify_seconds",
        "load_verify_seconds",
        "Checking fetched chunks' headers and checksums (part of the fetch).",
    ),
    Metric(
        "kvtier:load_copy_seconds", "load_copy_seconds", "Copying fetched chunks into the KV cache."
    ),
    Metric(
        "kvtier:forward_seconds",
        "forward_seconds",
        "The forward passes of the steps that loaded chunks (after the load).",
    ),
    Metric("kvtier:forward_steps", "forward_steps", "Steps that loaded chunks."),
)
TIER_COUNTERS: tuple[Metric, ...] = (
    Metric(
        "kvtier:hit_tokens_by_tier",
        "hit_tokens.{tier}",
        "Prompt tokens kvtier planned to load, by the tier expected to serve them.",
    ),
    Metric("kvtier:tier_hits", "tier.{tier}.hits", "Chunks read and verified from the tier."),
    Metric("kvtier:tier_misses", "tier.{tier}.misses", "Chunk reads the tier could not answer."),
    Metric("kvtier:tier_bytes_read", "tier.{tier}.bytes_read", "Payload bytes read from the tier."),
    Metric("kvtier:tier_puts", "tier.{tier}.puts", "Chunks written to the tier."),
    Metric(
        "kvtier:tier_bytes_written",
        "tier.{tier}.bytes_written",
        "Bytes written to the tier (chunk header and payload).",
    ),
    Metric(
        "kvtier:tier_evictions",
        "tier.{tier}.evictions",
        "Chunks the tier evicted to stay under its cap (CPU, disk).",
    ),
    Metric(
        "kvtier:tier_circuit_opened",
        "tier.{tier}.circuit_opened",
        "Times the tier's circuit breaker opened (the tier stopped being asked).",
    ),
)
# Gauges of a tier's fill, moved by the changes the processes report (so their sum).
TIER_GAUGES: tuple[Metric, ...] = (
    Metric(
        "kvtier:tier_used_bytes",
        "tier.{tier}.used_bytes",
        "Bytes the tier holds now (CPU, disk: the ones with a cap), summed over the workers.",
    ),
    Metric(
        "kvtier:tier_capacity_bytes",
        "tier.{tier}.capacity_bytes",
        "The tier's cap in bytes (max_local_cpu_size, max_local_disk_size), summed over the "
        "workers.",
    ),
)
HISTOGRAMS: tuple[Metric, ...] = (
    Metric(
        "kvtier:load_seconds", "load_seconds", "Loading the chunks of one step (fetch and copy)."
    ),
    Metric(
        "kvtier:save_seconds",
        "save_copy_seconds",
        "vLLM's thread in wait_for_save: queueing one step's chunk copies (the store's work "
        "runs in the save thread).",
    ),
    Metric(
        "kvtier:remote_lookup_seconds",
        "remote_lookup_seconds",
        "A request's wait for the remote tier's lookup (answered or given up).",
    ),
)


# Series with a label of their own, fed from keys with that label in them.
UNCACHED_REQUESTS = Metric(
    "kvtier:uncached_requests",
    "uncached_requests.{reason}",
    "Requests served without kvtier (nothing looked up, loaded or saved), by reason: "
    "namespace_not_allowed, unknown_extra_key (an identity the chunk keys cannot cover), "
    "lora_unreadable (adapter files kvtier cannot read).",
)
TIER_ERRORS = Metric(
    "kvtier:tier_errors",
    "tier.{tier}.errors.{cause}",
    "Failed tier operations, by cause (timeout, connection, checksum, no_space, ...).",
)
#: A gauge moved by two keys: +1 for each ``circuit_opened``, -1 for each ``circuit_closed``.
TIER_CIRCUIT_OPEN = Metric(
    "kvtier:tier_circuit_open",
    "tier.{tier}.circuit_closed",
    "Processes (scheduler, workers) whose circuit breaker keeps the tier out now.",
)
#: Keys the processes report for vLLM's log line ("KV Transfer metrics") only, and why they
#: are no series of their own.
LOG_ONLY = {
    "tier.{tier}.errors": "the sum of kvtier:tier_errors_total over causes",
}


def _patterns() -> list[str]:
    labelled = [*COUNTERS, *TIER_COUNTERS, *TIER_GAUGES, UNCACHED_REQUESTS, TIER_ERRORS]
    # A histogram's key holds its samples; the key itself, the sum of the seconds (the worker's
    # `_sample`), goes to the log line.
    sampled = [m.key + SAMPLES for m in HISTOGRAMS] + [m.key for m in HISTOGRAMS]
    return [m.key for m in labelled] + sampled + [TIER_CIRCUIT_OPEN.key, *LOG_ONLY]


def _regex(pattern: str) -> re.Pattern[str]:
    """``pattern`` with ``{tier}`` one of ``TIERS`` and any other ``{label}`` one dot-free
    value."""
    parts = re.split(r"(\{\w+\})", pattern)
    tier = "(?:" + "|".join(TIERS) + ")"
    return re.compile(
        "".join(
            tier if p == "{tier}" else r"[^.]+" if p.startswith("{") else re.escape(p)
            for p in parts
        )
    )


def catalogued(key: str) -> bool:
    """Whether a key a process reports is one of this catalogue's."""
    return any(_regex(p).fullmatch(key) for p in _patterns())
