"""Admission to the shared tier (``remote_admit_after: 2``, kvtier.admission) in a vLLM server
with CPU and S3 tiers:

- a prompt seen once is kept by the CPU tier only: nothing reaches the bucket, and a one-off
  prompt never does;
- seen a second time (vLLM's own prefix cache serves it, the CPU tier holds it too), its
  chunks are written to S3 from the request's KV ("late admission"), counted on /metrics;
- after a restart (CPU tier and vLLM's cache gone), the third sight loads every chunk from
  S3 and gives the cold run's tokens: what the late admission wrote is the prompt's KV.
"""

from __future__ import annotations

import time

from _e2e import CHUNK, OUTPUT_TOKENS, Counters, S3Target, Servers, assert_same_tokens, prompt

from kvtier.format import short_hash
from kvtier.keys import chunk_hashes

CHUNKS = 8
DOC = prompt(CHUNKS * CHUNK + 1, seed=910)
ONE_OFF = prompt(CHUNKS * CHUNK + 1, seed=911)


def test_a_prompt_reaches_s3_on_its_second_sight_and_a_one_off_never(
    servers: Servers, s3_target: S3Target
) -> None:
    values = s3_target.kvtier(local_cpu=True, max_local_cpu_size=0.5, remote_admit_after=2)
    server = servers.make("admission", values, env=s3_target.env)
    c = Counters(server)
    server.complete(ONE_OFF, max_tokens=OUTPUT_TOKENS)
    cold = server.complete(DOC, max_tokens=OUTPUT_TOKENS)
    assert c.delta("kvtier:remote_unadmitted_chunks_total") == 2 * CHUNKS
    assert c.delta("kvtier:tier_puts_total", tier="cpu") == 2 * CHUNKS
    time.sleep(2)  # what a background write would need to land
    assert s3_target.chunks() == 0

    c = Counters(server)
    server.complete(DOC, max_tokens=OUTPUT_TOKENS)
    assert c.delta("vllm:prefix_cache_hits_total") == CHUNKS * CHUNK  # vLLM's cache served it
    assert c.delta("kvtier:remote_late_admitted_chunks_total") == CHUNKS
    assert s3_target.wait_for_chunks(CHUNKS) == CHUNKS
    time.sleep(1)
    listed = [h for chunks in s3_target.chunk_lists().values() for h in chunks]
    assert sorted(listed) == sorted(short_hash(h) for h in chunk_hashes(DOC, CHUNK))

    server.stop()
    server.start()
    c = Counters(server)
    warm = server.complete(DOC, max_tokens=OUTPUT_TOKENS)
    assert c.delta("kvtier:tier_hits_total", tier="s3") == CHUNKS, server.log_tail()
    assert c.delta("kvtier:remote_late_admitted_chunks_total") == 0  # a first sight here
    assert_same_tokens(warm, cold, c)
    server.stop()
