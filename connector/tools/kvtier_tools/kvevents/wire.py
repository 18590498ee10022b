"""The wire format of vLLM 0.32's KV events (``vllm/distributed/kv_events.py``), mirrored.

vLLM's ``ZmqEventPublisher`` sends each batch as three ZMQ frames: the topic (UTF-8), the
batch's sequence number (8 bytes, big-endian) and the batch, encoded by
``msgspec.msgpack.Encoder``. The batch is an array ``[ts, events, data_parallel_rank]``
(``array_like``, the rank left out while unset); each event a map tagged by its class name
(``{"type": "BlockStored", ...}``) without the fields still at their default (``omit_defaults``).

The Structs below carry the same names, fields, field order and options, so msgspec decodes
vLLM's bytes into them (and vLLM decodes theirs) with no vLLM installed; the vLLM-venv test
``test_kvevents_wire.py`` holds them to vLLM's. Fields a later vLLM adds are ignored on decoding.
"""

from __future__ import annotations

from typing import Any, TypeAlias

import msgspec

BlockHash: TypeAlias = bytes | int
"""sha256 bytes, or their low 64 bits as an int with ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``."""

MEDIUM_GPU = "GPU"  # vLLM's own prefix cache
MEDIUM_CPU = "CPU"  # kvtier's tiers, as the connector publishes them
MEDIUM_DISK = "DISK"
MEDIUM_S3 = "S3"


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """One change to what a source holds; the tag is the class name."""


class BlockStored(KVCacheEvent):
    """Blocks now held in ``medium`` (None: vLLM's GPU cache, as older vLLM sent it)."""

    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None  # deprecated by vLLM in favour of lora_name
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None  # per block: lora, mm, salt...
    group_idx: int | None = None  # the KV cache group (hybrid models have several)
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None  # LOCAL or REMOTE, relative to the publisher
    ownership: str | None = None  # the offloading tier that generated it, if any
    session_id: str | None = None  # the request context that stored or reused the blocks


class BlockRemoved(KVCacheEvent):
    """Blocks no longer held in ``medium``."""

    block_hashes: list[BlockHash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    """vLLM reset its (GPU) prefix cache: every block it held there is gone."""


KVEvent: TypeAlias = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """The events of one engine step (vLLM's ``EventBatch`` adds nothing to the wire)."""

    ts: float
    events: list[KVEvent]
    data_parallel_rank: int | None = None


class WireError(ValueError):
    """A payload that is not a KV event batch."""


_decoder = msgspec.msgpack.Decoder(KVEventBatch)
_encoder = msgspec.msgpack.Encoder()


def decode_batch(payload: bytes) -> KVEventBatch:
    """The batch in a message's last frame; :class:`WireError` if it is not one."""
    try:
        return _decoder.decode(payload)
    except msgspec.DecodeError as exc:  # ValidationError is a DecodeError
        raise WireError(f"not a vLLM KV event batch: {exc}") from exc


def encode_batch(batch: KVEventBatch) -> bytes:
    """The bytes vLLM's publisher would send for ``batch``."""
    return _encoder.encode(batch)


def encode_seq(seq: int) -> bytes:
    """A sequence-number frame, as vLLM's publisher writes it."""
    return seq.to_bytes(8, "big")


def decode_seq(frame: bytes) -> int:
    """A sequence-number frame's value (-1: the end marker of a replay)."""
    if len(frame) != 8:
        raise WireError(f"a sequence number is 8 bytes, got {len(frame)}")
    return int.from_bytes(frame, "big", signed=True)
