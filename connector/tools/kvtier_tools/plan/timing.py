"""Prefill throughput and tier bandwidth for the TTFT estimate: given, or read from the JSON that
`kvtier bench ttft --json` and `kvtier bench store` write.

- ``bench ttft``: prefill rate = prompt tokens / median cold TTFT without a connector (valid for
  the model the benchmark ran only); a tier's rate = the bytes of a whole hit (prompt tokens x
  the benchmark model's KV bytes per token) / the median warm TTFT of ``kvtier-cpu``,
  ``kvtier-disk``, ``kvtier-s3``: the measured hit, with its lookups and its last block's
  forward pass, so it is conservative.
- ``bench store``: kvtier's S3 tier GETs (the best client) and its disk tier reads from a cold
  page cache, at the object size nearest one chunk.

Figures given as flags win over the JSON. The estimate is linear in tokens; a real prefill grows
faster than linearly with the prompt (attention), so long prompts gain more than it says.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvtier_tools.plan.shape import KVShape, PlanError, load_shape

_MIB = 1024 * 1024
_TTFT_SCENARIOS = {"cpu": "kvtier-cpu", "disk": "kvtier-disk", "s3": "kvtier-s3"}


@dataclass
class Speeds:
    """Tokens/s of prefill and bytes/s of one rank's loads per tier, with where each came from."""

    prefill_tokens_per_s: float | None = None
    tier_bytes_per_s: dict[str, float] = field(default_factory=dict)
    sources: list[str] = field(default_factory=list)

    def seconds_per_hit_token(self, tier: str, shape: KVShape) -> float | None:
        bw = self.tier_bytes_per_s.get(tier)
        return shape.bytes_per_token_per_rank / bw if bw else None


def _json(path: str, what: str, key: str) -> dict[str, Any]:
    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise PlanError(f"cannot read {path}: {exc}") from exc
    if not isinstance(doc, dict) or key not in doc:
        raise PlanError(f"{path} is not the JSON of `{what}` (no {key!r}): pass the file it wrote")
    return doc


def _same_model(bench: KVShape | None, shape: KVShape) -> bool:
    if bench is None:
        return True
    return (bench.num_layers, bench.num_kv_heads, bench.head_size) == (
        shape.num_layers,
        shape.num_kv_heads,
        shape.head_size,
    )


def from_bench_ttft(path: str, shape: KVShape, speeds: Speeds) -> None:
    """Fill ``speeds`` from `kvtier bench ttft --json` output (where not already set)."""
    doc = _json(path, "kvtier bench ttft --json", "median_ttft_seconds")
    medians: dict[str, dict[str, float]] = doc["median_ttft_seconds"]
    tokens = int(doc.get("prompt_tokens") or 0)
    model = str(doc.get("model") or "?")
    try:
        bench: KVShape | None = load_shape(model, shape.dtype, 1)
    except PlanError:
        bench = None  # the benchmark's model is not readable here: taken as this one
    cold = medians.get("none", {}).get("cold")
    if speeds.prefill_tokens_per_s is None and cold and tokens:
        if _same_model(bench, shape):
            speeds.prefill_tokens_per_s = tokens / cold
            speeds.sources.append(f"prefill: {path} (no connector, cold, model {model})")
        else:
            speeds.sources.append(
                f"prefill: not taken from {path}: it measured {model}, not this model "
                "(pass --prefill-tps)"
            )
    per_token = (bench or shape).bytes_per_token_per_rank
    for tier, scenario in _TTFT_SCENARIOS.items():
        warm = medians.get(scenario, {}).get("warm")
        if tier not in speeds.tier_bytes_per_s and warm and tokens and math.isfinite(warm):
            speeds.tier_bytes_per_s[tier] = tokens * per_token / warm
            speeds.sources.append(f"{tier}: {path} ({scenario}, warm, {model})")


def _nearest(cells: list[dict[str, Any]], size: int) -> dict[str, Any] | None:
    if not cells:
        return None
    best = min(abs(math.log(max(1, int(c["size"])) / size)) for c in cells)
    near = [c for c in cells if abs(math.log(max(1, int(c["size"])) / size)) == best]
    return max(near, key=lambda c: float(c["mib_s"]))


def from_bench_store(path: str, object_bytes: int, speeds: Speeds) -> None:
    """Fill ``speeds`` from `kvtier bench store` output (where not already set)."""
    doc = _json(path, "kvtier bench store", "cells")
    cells: list[dict[str, Any]] = [c for c in doc["cells"] if not c.get("errors")]
    picks = {
        "s3": [c for c in cells if str(c["client"]).startswith("kvtier s3") and c["op"] == "get"],
        "disk": [c for c in cells if c["client"] == "kvtier disk" and c["op"] == "get cold"],
    }
    for tier, found in picks.items():
        cell = _nearest(found, object_bytes)
        if cell is not None and tier not in speeds.tier_bytes_per_s:
            speeds.tier_bytes_per_s[tier] = float(cell["mib_s"]) * _MIB
            speeds.sources.append(
                f"{tier}: {path} ({cell['client']} {cell['op']}, {int(cell['size']) // 1024} KiB)"
            )


def speeds_from(
    shape: KVShape,
    chunk_size: int,
    prefill_tps: float | None,
    mib_s: dict[str, float | None],
    bench_ttft: str | None,
    bench_store: str | None,
) -> Speeds:
    """Flags first, then the benchmark JSON files."""
    speeds = Speeds(prefill_tps)
    if prefill_tps is not None:
        speeds.sources.append("prefill: --prefill-tps")
    for tier, value in mib_s.items():
        if value is not None:
            if value <= 0:
                raise PlanError(f"--{tier}-mib-s {value}: pass a bandwidth > 0")
            speeds.tier_bytes_per_s[tier] = value * _MIB
            speeds.sources.append(f"{tier}: --{tier}-mib-s")
    if prefill_tps is not None and prefill_tps <= 0:
        raise PlanError(f"--prefill-tps {prefill_tps}: pass tokens per second > 0")
    if bench_ttft:
        from_bench_ttft(bench_ttft, shape, speeds)
    if bench_store:
        from_bench_store(bench_store, shape.object_bytes(chunk_size), speeds)
    return speeds
