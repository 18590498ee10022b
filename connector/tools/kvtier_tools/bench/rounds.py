"""One measured round against a vLLM server, as `kvtier bench compare` and its capacity sweep
take them: the load generator's summary plus the deltas of the server's cache counters."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

from kvtier_tools.bench.load import Record, summarize
from kvtier_tools.completions import CompletionError
from kvtier_tools.server import Sample, ServerError, VllmServer, metric_sum

#: What ends a scenario early (a server that died or did not start); the report says which.
SCENARIO_ERRORS = (ServerError, CompletionError, OSError)

_COUNTERS: dict[str, tuple[str, dict[str, str]]] = {
    "server_prompt_tokens": ("vllm:prompt_tokens_total", {}),
    "local_hit_tokens": ("vllm:prefix_cache_hits_total", {}),
    "external_hit_tokens": ("vllm:external_prefix_cache_hits_total", {}),
    "kvtier_loaded_tokens": ("kvtier:loaded_tokens_total", {}),
    "kvtier_cpu_hit_chunks": ("kvtier:tier_hits_total", {"tier": "cpu"}),
    "kvtier_disk_hit_chunks": ("kvtier:tier_hits_total", {"tier": "disk"}),
    "kvtier_s3_hit_chunks": ("kvtier:tier_hits_total", {"tier": "s3"}),
}


def cache_counters(before: Sequence[Sample], after: Sequence[Sample]) -> dict[str, float]:
    """Deltas of the cache counters between two /metrics snapshots, and the hit rate."""
    out = {
        key: metric_sum(after, name, **labels) - metric_sum(before, name, **labels)
        for key, (name, labels) in _COUNTERS.items()
    }
    served = out["local_hit_tokens"] + out["external_hit_tokens"]
    prompt = out["server_prompt_tokens"]
    out["hit_rate"] = served / prompt if prompt else math.nan
    return out


def measure(
    server: VllmServer, run: Callable[[], list[Record]], keep_ttfts: bool
) -> tuple[dict[str, Any], list[Record]]:
    """Run one round; its summary with the server's cache counters over the round."""
    before = server.metrics()
    records = run()
    summary = summarize(records)
    try:
        summary |= cache_counters(before, server.metrics())
    except OSError as exc:  # the server died during the round: the records say how
        summary["metrics_error"] = str(exc)
    if keep_ttfts:
        summary["ttft_per_request_s"] = [r.ttft for r in records]
    return summary, records
