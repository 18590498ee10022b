"""The shared tier's cap (``max_remote_size``) in a vLLM server: S3 only, a cap that holds two
prompts' objects (4 MiB each: the tiny model's 16 chunks of 256 KiB in one object), eight
prompts written (3.2 x the cap):

- the prefix stays under the cap plus the writer's slack at every sample, and under the cap
  once the writer's pass has run; the evictions and the fill are in ``/metrics``; a write that
  did not fit waited for a pass that made room, so none was skipped; every request is
  answered;
- after a restart the newest prompt loads from S3 with the cold run's tokens, and the oldest,
  evicted, is computed again (0 chunks from S3).
"""

from __future__ import annotations

import time
from typing import Any

import pytest
from _e2e import CHUNK, OUTPUT_TOKENS, Counters, S3Target, Servers, assert_same_tokens, prompt

from kvtier_tools.server import metric_sum

MIB = 1 << 20
CAP = 10 * MIB
SLACK = CAP // 20
DOCS = [prompt(16 * CHUNK + 1, seed=700 + i) for i in range(8)]


@pytest.fixture(scope="module")
def capped(servers: Servers, s3_target: S3Target) -> Any:
    values = s3_target.kvtier(max_remote_size=CAP / (1 << 30), remote_evict_interval_secs=1.0)
    server = servers.make("capped", values, env=s3_target.env)
    server.complete(prompt(64, seed=96), max_tokens=4)
    return server


def _fill(s3_target: S3Target) -> int:
    return sum(int(size) for size in s3_target.objects().values())


def test_the_prefix_stays_under_its_cap_and_keeps_the_newest_prompts(
    capped: Any, s3_target: S3Target
) -> None:
    cold, fills = [], []
    for doc in DOCS:
        cold.append(capped.complete(doc, max_tokens=OUTPUT_TOKENS))
        time.sleep(1.5)  # the object lands in the background
        fills.append(_fill(s3_target))
    assert all(len(c.token_ids) == OUTPUT_TOKENS for c in cold)
    assert max(fills) <= CAP + SLACK, [round(f / MIB, 1) for f in fills]
    time.sleep(2.5)  # a pass after the last write
    assert _fill(s3_target) <= CAP
    metrics = capped.metrics()
    assert metric_sum(metrics, "kvtier:tier_evictions_total", tier="s3") > 0
    assert metric_sum(metrics, "kvtier:tier_capacity_bytes", tier="s3") == CAP
    assert 0 < metric_sum(metrics, "kvtier:tier_used_bytes", tier="s3") <= CAP + SLACK
    # Each write that did not fit waited for a pass that evicted enough for it: none skipped.
    assert metric_sum(metrics, "kvtier:tier_errors_total", tier="s3", cause="over_cap") == 0
    capped.stop()  # vLLM's own prefix cache goes: what follows comes from S3 or is computed
    capped.start()
    c = Counters(capped)
    newest = capped.complete(DOCS[-1], max_tokens=OUTPUT_TOKENS)
    assert c.delta("kvtier:tier_hits_total", tier="s3") == 16, capped.log_tail()
    assert_same_tokens(newest, cold[-1], c)
    c = Counters(capped)
    oldest = capped.complete(DOCS[0], max_tokens=OUTPUT_TOKENS)
    assert c.delta("kvtier:tier_hits_total", tier="s3") == 0
    assert c.delta("kvtier:load_failed_tokens_total") == 0
    assert_same_tokens(oldest, cold[0], c)
