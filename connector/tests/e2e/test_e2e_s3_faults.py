"""Faults behind the server's back. S3 tier only, vLLM's prefix cache OFF (every repeat asks
kvtier).

- objects deleted from the bucket: the next request is a clean miss with the same tokens;
- one object corrupted: detected, recomputed, same tokens; the negative control (checksum
  verification off, a test-only setting) shows the same corruption changes the output;
- one object replaced by random bytes, cut short, or by a chunk of another model, another
  chunk size, another format version or another chunk: each detected (counted under its cause
  in /metrics), recomputed, same tokens.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Callable
from typing import Any

import pytest
from _e2e import CHUNK, OUTPUT_TOKENS, Counters, S3Target, Servers, prompt

from kvtier.format import HEADER_SIZE
from kvtier.keys import chunk_hashes
from kvtier.vllm.server import VllmServer

DELETED = prompt(4_000, seed=11)
CORRUPTED = prompt(4_000, seed=12)
MIDDLE = len(CORRUPTED) // CHUNK // 2


@pytest.fixture(scope="module")
def server(servers: Servers, s3_target: S3Target) -> VllmServer:
    srv = servers.make("s3-noprefix", s3_target.kvtier(), prefix_caching=False, env=s3_target.env)
    srv.complete(prompt(64, seed=97), max_tokens=4)
    return srv


def test_deleted_objects_are_a_clean_miss(server: VllmServer, s3_target: S3Target) -> None:
    cold = server.complete(DELETED, max_tokens=OUTPUT_TOKENS)
    n = len(DELETED) // CHUNK
    assert len(s3_target.wait_for_objects(n)) == n
    c = Counters(server)
    warm = server.complete(DELETED, max_tokens=OUTPUT_TOKENS)
    assert c.delta("kvtier:loaded_tokens_total") >= 0.9 * len(DELETED), server.log_tail()
    assert warm.token_ids == cold.token_ids

    s3_target.clear()
    c = Counters(server)
    again = server.complete(DELETED, max_tokens=OUTPUT_TOKENS)
    assert c.delta("vllm:external_prefix_cache_hits_total") == 0
    assert c.delta("kvtier:hit_tokens_total") == 0
    assert c.delta("kvtier:load_failed_tokens_total") == 0
    assert again.token_ids == cold.token_ids
    assert "Traceback" not in server.log_text()


def _corrupt(s3_target: S3Target, key: str, original: bytes) -> None:
    # Keep the header (so the blob still parses) and overwrite the KV payload with values
    # (bf16 0x4747 ~ 5e4) far outside what attention ever sees.
    bad = original[:HEADER_SIZE] + b"\x47" * (len(original) - HEADER_SIZE)
    s3_target.client().put_object(Bucket=s3_target.bucket, Key=key, Body=bad)


@pytest.fixture(scope="module")
def corrupted(server: VllmServer, s3_target: S3Target) -> dict[str, Any]:
    """Cold tokens of CORRUPTED and one of its objects (key, original bytes), corrupted."""
    s3_target.clear()
    cold = server.complete(CORRUPTED, max_tokens=OUTPUT_TOKENS)
    objs = s3_target.wait_for_objects(len(CORRUPTED) // CHUNK)
    # The middle chunk: the ones before it still load, it and the rest are recomputed.
    middle = chunk_hashes(CORRUPTED, CHUNK)[MIDDLE]
    key = next(k for k in objs if k.endswith("/" + middle))
    original = s3_target.client().get_object(Bucket=s3_target.bucket, Key=key)["Body"].read()
    _corrupt(s3_target, key, original)
    return {"cold": cold, "key": key, "original": original}


def test_corrupted_object_is_detected_and_recomputed(
    server: VllmServer, corrupted: dict[str, Any]
) -> None:
    c = Counters(server)
    out = server.complete(CORRUPTED, max_tokens=OUTPUT_TOKENS)
    assert c.delta("kvtier:tier_errors_total", tier="s3") >= 1, server.log_tail()
    # Chunks before the corrupted one load; from it on, vLLM recomputes (counted as failed).
    assert c.delta("kvtier:loaded_tokens_total") == MIDDLE * CHUNK
    assert c.delta("kvtier:load_failed_tokens_total") == c.delta("kvtier:hit_tokens_total") - (
        MIDDLE * CHUNK
    )
    assert out.token_ids == corrupted["cold"].token_ids
    assert "checksum" in server.log_text()


def test_negative_control_without_verification_output_changes(
    servers: Servers, s3_target: S3Target, corrupted: dict[str, Any]
) -> None:
    # The verifying server dropped the bad object; put the same corruption back.
    _corrupt(s3_target, corrupted["key"], corrupted["original"])
    unsafe = servers.make(
        "s3-noverify",
        s3_target.kvtier(verify_checksums=False),
        prefix_caching=False,
        env=s3_target.env,
    )
    c = Counters(unsafe)
    out = unsafe.complete(CORRUPTED, max_tokens=OUTPUT_TOKENS)
    assert c.delta("kvtier:loaded_tokens_total") >= 0.9 * len(CORRUPTED), unsafe.log_tail()
    assert out.token_ids != corrupted["cold"].token_ids
    unsafe.stop()


def _other_layout(blob: bytes) -> bytes:
    return blob[:8] + bytes(16) + blob[24:]  # another model's layout digest


def _other_chunk_size(blob: bytes) -> bytes:
    # What a writer with twice the chunk size stores: its own layout digest, twice the tokens
    # and payload.
    tokens, length = struct.unpack_from("<IQ", blob, 40)
    header = bytearray(blob[:HEADER_SIZE])
    header[8:24] = bytes(range(16))
    struct.pack_into("<IQ", header, 40, 2 * tokens, 2 * length)
    payload = blob[HEADER_SIZE:]
    return bytes(header) + payload + payload


def _other_version(blob: bytes) -> bytes:
    return blob[:4] + struct.pack("<H", 99) + blob[6:]


def _other_chunk(blob: bytes) -> bytes:
    return blob[:24] + bytes(16) + blob[40:]  # a chunk copied under another chunk's key


FOREIGN: dict[str, tuple[str, Callable[[bytes], bytes]]] = {
    "random bytes": ("bad_magic", lambda blob: os.urandom(len(blob))),
    "truncated": ("truncated", lambda blob: blob[: HEADER_SIZE + (len(blob) - HEADER_SIZE) // 2]),
    "another model": ("layout_mismatch", _other_layout),
    "another chunk size": ("layout_mismatch", _other_chunk_size),
    "another format version": ("version", _other_version),
    "another chunk's object": ("key_mismatch", _other_chunk),
}


@pytest.mark.parametrize("kind", list(FOREIGN))
def test_foreign_and_damaged_objects_are_detected_and_recomputed(
    server: VllmServer, s3_target: S3Target, kind: str
) -> None:
    cause, damage = FOREIGN[kind]
    doc = prompt(4_000, seed=300 + list(FOREIGN).index(kind))
    s3_target.clear()
    cold = server.complete(doc, max_tokens=OUTPUT_TOKENS)
    objs = s3_target.wait_for_objects(len(doc) // CHUNK)
    middle = chunk_hashes(doc, CHUNK)[MIDDLE]
    key = next(k for k in objs if k.endswith("/" + middle))
    client = s3_target.client()
    original = client.get_object(Bucket=s3_target.bucket, Key=key)["Body"].read()
    client.put_object(Bucket=s3_target.bucket, Key=key, Body=damage(original))
    c = Counters(server)
    out = server.complete(doc, max_tokens=OUTPUT_TOKENS)
    assert c.delta("kvtier:tier_errors_total", tier="s3", cause=cause) >= 1, server.log_tail()
    assert c.delta("kvtier:loaded_tokens_total") == MIDDLE * CHUNK
    assert out.token_ids == cold.token_ids
