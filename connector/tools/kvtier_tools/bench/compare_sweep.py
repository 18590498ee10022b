"""The capacity sweep of `kvtier bench compare`, after preset C: kvtier's CPU tier at 100, 50, 25
and 10 % of C's working set, without and with a disk tier twice the working set, prefix caching
off, the same first requests of C's stream for every size."""

from __future__ import annotations

import functools
import itertools
import json
import os
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from kvtier.format import HEADER_SIZE
from kvtier_tools.bench.load import Record, Request, csv_rows, run_requests, warm_up
from kvtier_tools.bench.presets import MixedLoad, Sizes
from kvtier_tools.bench.rounds import SCENARIO_ERRORS, measure
from kvtier_tools.bench.servers import ServerFactory, cpu_tier
from kvtier_tools.server import VllmServer

SWEEP_SHARES = (1.0, 0.5, 0.25, 0.1)
CHUNK_TOKENS = 256  # kvtier's default chunk_size: the unit the working set is counted in
_GIB = 1024**3
_MIB = 1024**2


def working_set_chunks(prompts: Iterable[Sequence[int]], chunk: int = CHUNK_TOKENS) -> int:
    """Distinct full chunks in ``prompts``, each identified by its whole prefix (as the
    connector keys them): what a tier must hold for every repeated prefix to hit."""
    seen: set[int] = set()
    for prompt in prompts:
        key = 0
        for end in range(chunk, len(prompt) + 1, chunk):
            key = hash((key, tuple(prompt[end - chunk : end])))
            seen.add(key)
    return len(seen)


def kv_bytes_per_token(model: str) -> int | None:
    """KV-cache bytes per token of a local dense-attention model (K and V of every layer), from
    its config.json; None when that cannot be read."""
    try:
        cfg = json.loads((Path(model) / "config.json").read_text())
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
        kv_heads = cfg.get("num_key_value_heads", cfg["num_attention_heads"])
        layers = cfg["num_hidden_layers"]
    except (OSError, ValueError, KeyError):
        return None
    dtype_bytes = 4 if cfg.get("torch_dtype") == "float32" else 2
    return int(2 * layers * kv_heads * head_dim * dtype_bytes)


def measure_c_round(
    server: VllmServer, requests: Sequence[Request], sizes: Sizes, label: str
) -> tuple[dict[str, Any], list[Record]]:
    """Send ``requests`` (C's stream) as preset C does (its answer length, its requests in
    flight): the round's summary with the server's cache counters, and the records."""
    run = functools.partial(
        run_requests,
        server.complete,
        requests,
        output_len=sizes.c_output,
        inflight=sizes.c_inflight,
        label=label,
        total=len(requests),
    )
    return measure(server, run, keep_ttfts=False)


def run_sweep(
    factory: ServerFactory, sizes: Sizes, seed: int, model: str, run_id: str
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """C's first ``sweep_requests`` requests against kvtier with the CPU tier at each share of
    their working set, without and with a disk tier of twice the working set."""
    requests = list(itertools.islice(MixedLoad(sizes, seed).stream("sweep"), sizes.sweep_requests))
    per_token = kv_bytes_per_token(model)
    if per_token is None:
        return {"skipped": f"cannot read the KV size per token from {model}/config.json"}, []
    chunks = working_set_chunks(r.prompt for r in requests)
    ws_bytes = chunks * (CHUNK_TOKENS * per_token + HEADER_SIZE)
    sweep: dict[str, Any] = {
        "requests": len(requests),
        "working_set_chunks": chunks,
        "working_set_mib": ws_bytes / _MIB,
        "rows": [],
    }
    rows: list[dict[str, Any]] = []
    # Each size without, then with, the disk tier: a pair runs minutes apart at most, so a
    # change of the machine's load during the sweep does not masquerade as the disk's effect.
    for share, disk in itertools.product(SWEEP_SHARES, (False, True)):
        name = f"sweep-cpu{round(share * 100)}{'-disk' if disk else ''}"
        extra = (
            {
                "local_disk": str(factory.work / "sweep" / f"{run_id}-{name}"),
                "max_local_disk_size": 2 * ws_bytes / _GIB,
            }
            if disk
            else {}
        )
        kv = cpu_tier(share * ws_bytes / _GIB, **extra)
        row: dict[str, Any] = {"cpu_share": share, "cpu_mib": share * ws_bytes / _MIB, "disk": disk}
        print(f"[bench compare] {name} ...", file=sys.stderr, flush=True)
        try:
            with factory(name, kv, "--no-enable-prefix-caching") as server:
                warm_up(server.complete)
                summary, records = measure_c_round(server, requests, sizes, name)
                row |= summary
                rows += csv_rows(records, scenario=name, preset="C-sweep")
        except SCENARIO_ERRORS as exc:
            row["error"] = str(exc)[-3000:]
        row["loadavg_after"] = os.getloadavg()
        sweep["rows"].append(row)
    return sweep, rows
