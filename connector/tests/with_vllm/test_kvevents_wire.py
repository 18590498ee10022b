"""kvtier's mirror of the KV-event wire format against vLLM's own Structs and publisher (runs
under the vLLM venv: `make test-cuda-cpu`).

The property: the same events encode to the same bytes with vLLM's classes and kvtier's, and
each side decodes the other's field for field; `kvtier events` reads a real
``ZmqEventPublisher``. A vLLM upgrade that changes the format fails here first.
"""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

import msgspec
import pytest
from vllm.distributed import kv_events as vllm_events

from kvtier_tools.cli import main
from kvtier_tools.kvevents import wire

PAIRS = [
    (vllm_events.KVEventBatch, wire.KVEventBatch),
    (vllm_events.BlockStored, wire.BlockStored),
    (vllm_events.BlockRemoved, wire.BlockRemoved),
    (vllm_events.AllBlocksCleared, wire.AllBlocksCleared),
]

STORED_GPU: dict[str, Any] = dict(  # every field set, bytes hashes
    block_hashes=[b"\x01" * 32, b"\x02" * 32],
    parent_block_hash=b"\x00" * 32,
    token_ids=list(range(32)),
    block_size=16,
    lora_id=3,
    medium="GPU",
    lora_name="adapter-a",
    extra_keys=[("adapter-a", ("img-1", 0), "salt"), None],
    group_idx=1,
    kv_cache_spec_kind="sliding_window",
    kv_cache_spec_sliding_window=128,
    locality="LOCAL",
    ownership="kvtier",
    session_id="session-7",
)
STORED_S3: dict[str, Any] = dict(  # only the fields without a default, int hashes
    block_hashes=[2**64 - 1, 7],
    parent_block_hash=None,
    token_ids=[5] * 16,
    block_size=16,
    lora_id=None,
    medium="S3",
    lora_name=None,
)
REMOVED: dict[str, Any] = dict(
    block_hashes=[b"\x02" * 32], medium=None, group_idx=1, locality="REMOTE", ownership="kvtier"
)


def _batches(module: Any) -> list[Any]:
    """The same two batches, built from ``module``'s classes (vLLM's or kvtier's)."""
    events = [
        module.BlockStored(**STORED_GPU),
        module.BlockStored(**STORED_S3),
        module.BlockRemoved(**REMOVED),
        module.AllBlocksCleared(),
    ]
    return [
        module.KVEventBatch(ts=1700000000.25, events=events, data_parallel_rank=1),
        module.KVEventBatch(ts=1700000001.0, events=events[2:]),  # rank unset: left out
    ]


def _plain(value: Any) -> Any:
    """Struct fields as comparable data: extra_keys' tuples come back as msgpack arrays."""
    if isinstance(value, msgspec.Struct):
        return (type(value).__name__, _plain(msgspec.structs.asdict(value)))
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value


@pytest.mark.parametrize(("theirs", "ours"), PAIRS, ids=lambda c: c.__name__)
def test_structs_have_vllms_fields_order_and_options(theirs: Any, ours: Any) -> None:
    def shape(cls: Any) -> tuple[Any, ...]:
        c = cls.__struct_config__
        fields = [(f.name, f.default) for f in msgspec.structs.fields(cls)]
        return (cls.__name__, fields, c.array_like, c.omit_defaults, c.tag_field, c.tag)

    assert shape(ours) == shape(theirs)


def test_the_same_events_are_the_same_bytes_and_decode_both_ways() -> None:
    vllm_decoder = msgspec.msgpack.Decoder(vllm_events.KVEventBatch)
    encoder = msgspec.msgpack.Encoder()  # as ZmqEventPublisher._publisher_thread makes it
    for theirs, ours in zip(_batches(vllm_events), _batches(wire), strict=True):
        payload = encoder.encode(theirs)
        assert wire.encode_batch(ours) == payload
        assert _plain(wire.decode_batch(payload)) == _plain(theirs)
        assert _plain(vllm_decoder.decode(wire.encode_batch(ours))) == _plain(theirs)

    decoded = wire.decode_batch(encoder.encode(_batches(vllm_events)[0]))
    stored = decoded.events[0]
    assert isinstance(stored, wire.BlockStored)
    assert stored.block_hashes == [b"\x01" * 32, b"\x02" * 32]
    assert (stored.medium, stored.lora_name, stored.group_idx) == ("GPU", "adapter-a", 1)
    assert decoded.events[1] == wire.BlockStored(**STORED_S3)  # int hashes, defaults left out


def test_kvtier_events_reads_a_real_zmq_publisher(capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    publisher = vllm_events.ZmqEventPublisher(
        data_parallel_rank=0, endpoint=f"tcp://*:{port}", topic="kv"
    )
    status: list[int] = []
    cli = ["events", "--endpoint", f"tcp://127.0.0.1:{port}", "--topic", "kv", "--count", "2"]
    thread = threading.Thread(
        target=lambda: status.append(main([*cli, "--json", "--seconds", "60"])), daemon=True
    )
    thread.start()
    try:
        # A PUB drops what it sends before the subscription arrives: publish until heard.
        while thread.is_alive():
            stored = vllm_events.BlockStored(**STORED_GPU)
            publisher.publish(vllm_events.KVEventBatch(ts=time.time(), events=[stored]))
            thread.join(0.05)
    finally:
        publisher.shutdown()
    assert status == [0]

    *events, summary = [msgspec.json.decode(line) for line in capsys.readouterr().out.splitlines()]
    assert [e["type"] for e in events] == ["BlockStored", "BlockStored"]
    assert events[1]["seq"] == events[0]["seq"] + 1
    first = events[0]
    assert first["block_hashes"] == [(b"\x01" * 32).hex(), (b"\x02" * 32).hex()]
    assert first["data_parallel_rank"] == 0  # the publisher's, filled in by publish()
    assert (first["medium"], first["lora_name"], first["session_id"]) == (
        "GPU",
        "adapter-a",
        "session-7",
    )
    assert summary["held"] == [{"source": f"127.0.0.1:{port}", "medium": "GPU", "blocks": 2}]
