"""S3 tier only (CPU and disk tiers off), vLLM's prefix cache ON: hits are asserted after a restart.

One server, restarted once: cold runs of a 12k-token prompt and of a prompt longer than the batch
budget (chunked prefill), then restart, then warm runs that must hit S3 and produce the same tokens.
"""

from __future__ import annotations

from typing import Any

import pytest
from _e2e import (
    BATCH_BUDGET,
    CHUNK,
    OBJECT_CHUNKS,
    OUTPUT_TOKENS,
    Counters,
    S3Target,
    Servers,
    assert_same_tokens,
    prompt,
)

from kvtier_tools.server import Completion, VllmServer

LONG = prompt(12_000, seed=1)
OVER_BUDGET = prompt(3 * BATCH_BUDGET + 300, seed=2)


@pytest.fixture(scope="module")
def run(servers: Servers, s3_target: S3Target) -> dict[str, Any]:
    """Shared state: the server and the cold results."""
    server = servers.make("s3-only", s3_target.kvtier(), env=s3_target.env)
    server.complete(prompt(64, seed=99), max_tokens=4)  # first-request warm-up
    return {"server": server, "cold": {}}


def test_cold_run_misses_and_writes_full_chunks(run: dict[str, Any], s3_target: S3Target) -> None:
    server: VllmServer = run["server"]
    c = Counters(server)
    cold = server.complete(LONG, max_tokens=OUTPUT_TOKENS)
    run["cold"]["long"] = cold
    assert c.delta("vllm:external_prefix_cache_hits_total") == 0
    assert c.delta("kvtier:hit_tokens_total") == 0
    assert c.delta("kvtier:lookup_tokens_total") == len(LONG)
    full = len(LONG) // CHUNK
    assert s3_target.wait_for_chunks(full) == full, server.log_tail()
    # Runs of chunks, one object each (the last one shorter).
    assert len(s3_target.objects()) == -(-full // OBJECT_CHUNKS)
    assert f"({OBJECT_CHUNKS} chunks per object)" in server.log_text()


def test_prompt_over_batch_budget_cold(run: dict[str, Any]) -> None:
    server: VllmServer = run["server"]
    c = Counters(server)
    run["cold"]["over"] = server.complete(OVER_BUDGET, max_tokens=OUTPUT_TOKENS)
    assert c.delta("kvtier:saved_chunks_total") == len(OVER_BUDGET) // CHUNK


def test_after_restart_s3_hits_and_same_tokens(run: dict[str, Any], s3_target: S3Target) -> None:
    server: VllmServer = run["server"]
    expected = len(LONG) // CHUNK + len(OVER_BUDGET) // CHUNK
    assert s3_target.wait_for_chunks(expected) == expected
    server.restart()
    server.complete(prompt(64, seed=98), max_tokens=4)
    c = Counters(server)
    warm = server.complete(LONG, max_tokens=OUTPUT_TOKENS)
    cold: Completion = run["cold"]["long"]
    hit_tokens = c.delta("vllm:external_prefix_cache_hits_total")
    assert c.delta("kvtier:tier_hits_total", tier="s3") > 0, server.log_tail()
    assert hit_tokens >= 0.9 * len(LONG), server.log_tail()
    assert hit_tokens <= len(LONG) - 1
    assert c.delta("kvtier:load_failed_tokens_total") == 0
    assert_same_tokens(warm, cold, c)
    assert len(warm.token_ids) == OUTPUT_TOKENS


def test_prompt_over_batch_budget_hits_after_restart(run: dict[str, Any]) -> None:
    server: VllmServer = run["server"]
    c = Counters(server)
    warm = server.complete(OVER_BUDGET, max_tokens=OUTPUT_TOKENS)
    assert c.delta("kvtier:loaded_tokens_total") >= 0.9 * len(OVER_BUDGET), server.log_tail()
    assert_same_tokens(warm, run["cold"]["over"], c)
    assert "Traceback" not in server.log_text()
