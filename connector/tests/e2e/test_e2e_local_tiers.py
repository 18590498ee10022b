"""CPU-tier-only and disk-tier-only configurations (no S3).

The CPU-only server runs with VLLM_ENABLE_V1_MULTIPROCESSING=1 and the mp executor: scheduler,
worker and API server are separate processes, as in production, so its hit counters in /metrics
can only have crossed through connector metadata and KVConnectorStats.
"""

from __future__ import annotations

from pathlib import Path

from _e2e import OUTPUT_TOKENS, Counters, Servers, assert_same_tokens, prompt

CPU_PROMPT = prompt(5_000, seed=31)
DISK_PROMPT = prompt(5_000, seed=32)


def test_cpu_tier_only_hits_with_scheduler_and_worker_in_separate_processes(
    servers: Servers,
) -> None:
    server = servers.make(
        "cpu-only-mp",
        {"local_cpu": True, "max_local_cpu_size": 0.5},
        prefix_caching=False,  # else vLLM's own prefix cache answers the repeat
        env={"VLLM_ENABLE_V1_MULTIPROCESSING": "1"},
        extra_args=("--distributed-executor-backend", "mp"),
    )
    cold = server.complete(CPU_PROMPT, max_tokens=OUTPUT_TOKENS)
    c = Counters(server)
    warm = server.complete(CPU_PROMPT, max_tokens=OUTPUT_TOKENS)
    assert c.delta("kvtier:tier_hits_total", tier="cpu") > 0, server.log_tail()
    assert c.delta("kvtier:hit_tokens_by_tier_total", tier="cpu") >= 0.9 * len(CPU_PROMPT)
    assert c.delta("kvtier:loaded_tokens_total") >= 0.9 * len(CPU_PROMPT)
    assert c.delta("vllm:prompt_tokens_cached_by_source_total", source="host") > 0
    assert_same_tokens(warm, cold, c)
    server.stop()


def test_disk_tier_only_hits_across_restart(servers: Servers, scratch: Path) -> None:
    server = servers.make(
        "disk-only",
        {"local_cpu": False, "local_disk": str(scratch / "disk"), "max_local_disk_size": 1.0},
    )
    cold = server.complete(DISK_PROMPT, max_tokens=OUTPUT_TOKENS)
    server.restart()
    c = Counters(server)
    warm = server.complete(DISK_PROMPT, max_tokens=OUTPUT_TOKENS)
    assert c.delta("kvtier:tier_hits_total", tier="disk") > 0, server.log_tail()
    assert c.delta("vllm:external_prefix_cache_hits_total") >= 0.9 * len(DISK_PROMPT)
    assert c.delta("vllm:prompt_tokens_cached_by_source_total", source="disk") > 0
    assert_same_tokens(warm, cold, c)
    server.stop()
