"""`kvtier events` and the index behind it: what a router learns from vLLM's KV-event stream.

The index's semantics on hand-made batches; the command end to end against real ZMQ publishers
on 127.0.0.1 that send frames as vLLM's ``ZmqEventPublisher`` does (topic, 8-byte big-endian
sequence number, msgpack batch). The publishers are XPUB sockets: a PUB that also reports the
subscription, so a test sends only once the command listens (no sleep, no lost first batch).
"""

from __future__ import annotations

import json
import sys
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import zmq

from kvtier_tools.cli import main
from kvtier_tools.kvevents.index import PrefixIndex, Score
from kvtier_tools.kvevents.wire import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    KVEventBatch,
    encode_batch,
    encode_seq,
)


def h(i: int) -> bytes:
    return bytes([i]) * 32


def stored(hashes: list[Any], medium: str | None, group: int | None = 0, **kw: Any) -> BlockStored:
    return BlockStored(
        block_hashes=hashes,
        parent_block_hash=None,
        token_ids=list(range(16 * len(hashes))),
        block_size=16,
        lora_id=None,
        medium=medium,
        lora_name=kw.pop("lora_name", None),
        group_idx=group,
        **kw,
    )


def batch(*events: KVEvent) -> KVEventBatch:
    return KVEventBatch(ts=1700000000.5, events=list(events), data_parallel_rank=0)


# --- the index ---------------------------------------------------------------------------------


def test_scores_count_leading_blocks_per_source_and_medium() -> None:
    index = PrefixIndex()
    index.apply("a", batch(stored([h(1), h(2), h(3), h(4)], "GPU"), stored([h(1), h(2)], "CPU")))
    index.apply("b", batch(stored([h(1), h(2), h(3)], "DISK"), stored([h(9)], "S3")))
    prompt = [h(1), h(2), h(3), h(4), h(5)]
    assert index.score(prompt) == [
        Score("a", "GPU", 4),
        Score("b", "DISK", 3),
        Score("a", "CPU", 2),
    ]
    assert index.score([h(7), h(1)]) == []  # a prefix, not a set: the first block decides

    # Medium None is vLLM's GPU; the prefix now stops at the hole, though h3 and h4 are held.
    index.apply("a", batch(BlockRemoved(block_hashes=[h(2)], medium=None, group_idx=0)))
    assert index.holds("a", "GPU", h(3)) and not index.holds("a", "GPU", h(2))
    assert index.score(prompt) == [
        Score("b", "DISK", 3),
        Score("a", "CPU", 2),
        Score("a", "GPU", 1),
    ]
    assert index.counts() == {("a", "CPU"): 2, ("a", "GPU"): 3, ("b", "DISK"): 3, ("b", "S3"): 1}


def test_all_blocks_cleared_empties_only_that_sources_gpu() -> None:
    index = PrefixIndex()
    index.apply("a", batch(stored([h(1)], "GPU"), stored([h(1)], "DISK")))
    index.apply("b", batch(stored([h(1)], "GPU")))
    index.apply("a", batch(AllBlocksCleared()))
    assert index.counts() == {("a", "DISK"): 1, ("b", "GPU"): 1}
    assert index.score([h(1)]) == [Score("b", "GPU", 1), Score("a", "DISK", 1)]
    index.apply("b", batch(AllBlocksCleared()))
    assert index.sources() == ["a"]


def test_equal_matches_rank_the_faster_medium_first_and_int_hashes_work() -> None:
    index = PrefixIndex()
    for medium in ("S3", "DISK", "CPU", "GPU"):
        index.apply("a", batch(stored([11, 12], medium)))  # VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES
    assert [s.medium for s in index.score([11, 12, 13])] == ["GPU", "CPU", "DISK", "S3"]
    assert {s.matched_blocks for s in index.score([11, 12, 13])} == {2}


def test_a_block_stays_while_any_kv_cache_group_holds_it() -> None:
    index = PrefixIndex()
    index.apply("a", batch(stored([h(1)], "GPU", group=0), stored([h(1)], "GPU", group=1)))
    index.apply("a", batch(stored([h(1)], "GPU", group=0)))  # a reuse report: no double count
    index.apply("a", batch(BlockRemoved(block_hashes=[h(1)], medium="GPU", group_idx=0)))
    assert index.holds("a", "GPU", h(1))
    index.apply("a", batch(BlockRemoved(block_hashes=[h(1)], medium="GPU", group_idx=1)))
    assert not index.holds("a", "GPU", h(1))
    index.apply("a", batch(stored([h(2)], "CPU", group=0), stored([h(2)], "CPU", group=1)))
    index.apply("a", batch(BlockRemoved(block_hashes=[h(2)], medium="CPU")))  # no group: all
    assert index.counts() == {}
    index.apply("a", batch(BlockRemoved(block_hashes=[h(3)], medium="S3")))  # unknown: no error


# --- the command, against real ZMQ publishers --------------------------------------------------


@pytest.fixture
def ctx() -> Iterator[zmq.Context[zmq.Socket[bytes]]]:
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    yield context
    context.destroy(linger=0)


def publisher(ctx: zmq.Context[zmq.Socket[bytes]]) -> tuple[zmq.Socket[bytes], str]:
    sock = ctx.socket(zmq.XPUB)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    return sock, f"tcp://127.0.0.1:{port}"


def wait_subscribed(sock: zmq.Socket[bytes], topic: bytes) -> None:
    assert sock.poll(10_000), "kvtier events did not subscribe within 10 s"
    assert sock.recv() == b"\x01" + topic


def send(sock: zmq.Socket[bytes], seq: int, *events: KVEvent, topic: bytes = b"kv") -> None:
    """One batch, framed as vLLM's ZmqEventPublisher frames it."""
    sock.send_multipart((topic, encode_seq(seq), encode_batch(batch(*events))))


def start(*args: str) -> tuple[threading.Thread, list[int]]:
    status: list[int] = []
    thread = threading.Thread(target=lambda: status.append(main(["events", *args])), daemon=True)
    thread.start()
    return thread, status


def test_events_json_lists_the_events_of_every_source(
    ctx: zmq.Context[zmq.Socket[bytes]], capsys: pytest.CaptureFixture[str]
) -> None:
    a, endpoint_a = publisher(ctx)
    b, endpoint_b = publisher(ctx)
    cli = ["--endpoint", endpoint_a, "--endpoint", endpoint_b, "--topic", "kv"]
    thread, status = start(*cli, "--count", "4", "--json", "--seconds", "30")
    wait_subscribed(a, b"kv")
    wait_subscribed(b, b"kv")

    send(a, 0, stored([h(8)], "GPU"), topic=b"other")  # not subscribed to: never arrives
    a.send_multipart((b"kv", encode_seq(1), b"\xc1 not msgpack"))  # warned about, skipped
    send(a, 2, stored([h(1), h(2), h(3)], "GPU", lora_name="adapter-a", session_id="s1"))
    send(a, 3, BlockRemoved(block_hashes=[h(3)], medium=None, group_idx=0))
    send(b, 5, stored([11, 12], "S3"))
    send(b, 7, AllBlocksCleared())  # seq 6 lost on the way
    thread.join(30)
    assert status == [0]

    captured = capsys.readouterr()
    *lines, summary = [json.loads(line) for line in captured.out.splitlines()]
    src_a, src_b = endpoint_a.removeprefix("tcp://"), endpoint_b.removeprefix("tcp://")
    events = sorted(lines, key=lambda e: (e["source"] != src_a, e["seq"]))
    assert [(e["source"], e["seq"], e["type"]) for e in events] == [
        (src_a, 2, "BlockStored"),
        (src_a, 3, "BlockRemoved"),
        (src_b, 5, "BlockStored"),
        (src_b, 7, "AllBlocksCleared"),
    ]
    first = events[0]
    assert first["block_hashes"] == [h(1).hex(), h(2).hex(), h(3).hex()]
    assert (first["medium"], first["lora_name"], first["session_id"]) == ("GPU", "adapter-a", "s1")
    assert (first["ts"], first["data_parallel_rank"], first["block_size"]) == (1700000000.5, 0, 16)
    assert events[1]["medium"] is None and events[2]["block_hashes"] == [11, 12]
    assert summary == {
        "type": "Summary",
        "events": 4,
        "batches": 4,
        "missed_batches": {src_b: 1},
        "held": sorted(  # by source: the ports' order
            [
                {"source": src_a, "medium": "GPU", "blocks": 2},  # 3 stored, 1 removed
                {"source": src_b, "medium": "S3", "blocks": 2},  # AllBlocksCleared: GPU only
            ],
            key=lambda row: row["source"],
        ),
    }
    assert f"warning: {src_a}: not a vLLM KV event batch" in captured.err


def test_events_text_lines_and_summary_table(
    ctx: zmq.Context[zmq.Socket[bytes]], capsys: pytest.CaptureFixture[str]
) -> None:
    pub, endpoint = publisher(ctx)
    thread, status = start("--endpoint", endpoint, "--count", "2", "--seconds", "30")
    wait_subscribed(pub, b"")  # default topic: everything
    send(pub, 0, stored([h(1), h(2)], "DISK", lora_name="adapter-a"), AllBlocksCleared())
    thread.join(30)
    assert status == [0]

    source = endpoint.removeprefix("tcp://")
    assert capsys.readouterr().out.splitlines() == [
        f"{source} #0 BlockStored      DISK    2 blocks 01010101..02020202 lora=adapter-a",
        f"{source} #0 AllBlocksCleared GPU  all blocks",
        "kvtier events: 2 events in 1 batch from 1 source",
        "",
        "| source | medium | blocks held |",
        "|---|---|---|",
        f"| {source} | DISK | 2 |",
    ]


def test_events_stops_after_seconds_with_nothing_published(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["events", "--endpoint", "tcp://127.0.0.1:9", "--seconds", "0.2"]) == 0
    assert capsys.readouterr().out.splitlines() == [
        "kvtier events: 0 events in 0 batches from 1 source",
        "no blocks held (none stored since subscribing)",
    ]


@pytest.mark.parametrize(
    ("endpoint", "message"),
    [
        ("localhost:5557", "--endpoint 'localhost:5557': expected tcp://HOST:PORT"),
        ("tcp://10.0.0.5:70000", "expected tcp://HOST:PORT, e.g. tcp://10.0.0.5:5557"),
        ("tcp://*:5557", "'*' is what the server binds; name the host that runs it"),
    ],
)
def test_bad_endpoint_is_refused_with_the_expected_form(
    endpoint: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["events", "--endpoint", endpoint, "--seconds", "5"]) == 2
    assert message in capsys.readouterr().err


def test_missing_pyzmq_names_the_install_command(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "zmq", None)  # `import zmq` now raises ImportError
    assert main(["events", "--endpoint", "tcp://127.0.0.1:9", "--seconds", "5"]) == 2
    err = capsys.readouterr().err
    assert "error: kvtier events needs pyzmq and msgspec: pip install pyzmq msgspec" in err
