"""Faults behind the server's back. S3 tier only, vLLM's prefix cache OFF (every repeat asks
kvtier).

- objects deleted from the bucket: the next request is a clean miss with the same tokens;
- one chunk corrupted inside its object (a run of chunks, kvtier.format): detected, the chunks
  before it loaded, the rest recomputed, same tokens; the negative controls (checksum
  verification off, a test-only setting) load a real chunk of another prompt in its place, then
  the corrupted one, and show that `assert_same_tokens` catches each;
- one chunk replaced by random bytes, cut short, or by a chunk of another model, another chunk
  size, another format version or another chunk: each detected (counted under its cause in
  /metrics), recomputed, same tokens.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
from _e2e import CHUNK, OUTPUT_TOKENS, Counters, S3Target, Servers, assert_same_tokens, prompt

from kvtier.format import HEADER_SIZE
from kvtier.keys import chunk_hashes
from kvtier_tools.server import VllmServer

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
    assert s3_target.wait_for_chunks(n) == n
    c = Counters(server)
    warm = server.complete(DELETED, max_tokens=OUTPUT_TOKENS)
    assert c.delta("kvtier:loaded_tokens_total") >= 0.9 * len(DELETED), server.log_tail()
    assert_same_tokens(warm, cold, c)

    s3_target.clear()
    c = Counters(server)
    again = server.complete(DELETED, max_tokens=OUTPUT_TOKENS)
    assert c.delta("vllm:external_prefix_cache_hits_total") == 0
    assert c.delta("kvtier:hit_tokens_total") == 0
    assert c.delta("kvtier:load_failed_tokens_total") == 0
    assert_same_tokens(again, cold, c)
    assert "Traceback" not in server.log_text()


@dataclass(frozen=True)
class Stored:
    """The object that holds a prompt's middle chunk: its key, its bytes and where in them the
    middle chunk's blob is (the chunks before it in the object are full ones)."""

    key: str
    body: bytes
    meta: dict[str, str]  # its chunk list: kept, so the lookup still finds the chunks
    start: int
    end: int

    def put(self, s3_target: S3Target, damage: Callable[[bytes], bytes], cut: bool = False) -> None:
        """The object again with the middle chunk's blob damaged (and nothing after it: cut)."""
        blob = damage(self.body[self.start : self.end])
        body = self.body[: self.start] + blob + (b"" if cut else self.body[self.end :])
        s3_target.client().put_object(
            Bucket=s3_target.bucket, Key=self.key, Body=body, Metadata=self.meta
        )


def _middle_object(s3_target: S3Target, doc: list[int], stored_before: int = 0) -> Stored:
    """Once the bucket holds every full chunk of ``doc`` (and the ``stored_before`` it held):
    the object holding its middle one."""
    wanted = stored_before + len(doc) // CHUNK
    assert s3_target.wait_for_chunks(wanted) == wanted
    key, position = s3_target.object_of(chunk_hashes(doc, CHUNK)[MIDDLE])
    got = s3_target.client().get_object(Bucket=s3_target.bucket, Key=key)
    body = got["Body"].read()
    blob = HEADER_SIZE + struct.unpack_from("<Q", body, 44)[0]  # a full chunk's blob
    return Stored(key, body, dict(got["Metadata"]), position * blob, (position + 1) * blob)


def _bad_payload(blob: bytes) -> bytes:
    # Keep the header (so the blob still parses) and overwrite the KV payload with values
    # (bf16 0x4747 ~ 5e4) far outside what attention ever sees.
    return blob[:HEADER_SIZE] + b"\x47" * (len(blob) - HEADER_SIZE)


@pytest.fixture(scope="module")
def corrupted(server: VllmServer, s3_target: S3Target) -> dict[str, Any]:
    """Cold tokens of CORRUPTED, and the object that holds its middle chunk, that chunk's
    payload corrupted (the chunks before it still load, it and the rest are recomputed)."""
    s3_target.clear()
    cold = server.complete(CORRUPTED, max_tokens=OUTPUT_TOKENS)
    stored = _middle_object(s3_target, CORRUPTED)
    stored.put(s3_target, _bad_payload)
    return {"cold": cold, "stored": stored}


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
    assert_same_tokens(out, corrupted["cold"], c)
    assert "checksum" in server.log_text()


def test_negative_controls_without_verification_the_tokens_differ(
    servers: Servers, server: VllmServer, s3_target: S3Target, corrupted: dict[str, Any]
) -> None:
    """Wrong KV is caught by the same assertion the tests above pass: the middle chunk's payload
    replaced by the real KV of another prompt's middle chunk (plausible values, a wrong chunk as
    a key mix-up would serve it), then by the corruption above; checksums not verified."""
    other = prompt(len(CORRUPTED), seed=13)
    before = s3_target.chunks()
    server.complete(other, max_tokens=1)
    donor = _middle_object(s3_target, other, stored_before=before)
    wrong_payload = donor.body[donor.start + HEADER_SIZE : donor.end]
    stored: Stored = corrupted["stored"]
    unsafe = servers.make(
        "s3-noverify",
        s3_target.kvtier(verify_checksums=False),
        prefix_caching=False,
        env=s3_target.env,
    )
    for damage in (lambda blob: blob[:HEADER_SIZE] + wrong_payload, _bad_payload):
        stored.put(s3_target, damage)
        c = Counters(unsafe)
        out = unsafe.complete(CORRUPTED, max_tokens=OUTPUT_TOKENS)
        assert c.delta("kvtier:loaded_tokens_total") >= 0.9 * len(CORRUPTED), unsafe.log_tail()
        with pytest.raises(AssertionError, match="tokens differ from the reference"):
            assert_same_tokens(out, corrupted["cold"], c)
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


#: kind -> (the cause counted, what the middle chunk's blob becomes). "truncated" also ends the
#: object there (a short object, as a cut-off write or read leaves it).
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
    _middle_object(s3_target, doc).put(s3_target, damage, cut=kind == "truncated")
    c = Counters(server)
    out = server.complete(doc, max_tokens=OUTPUT_TOKENS)
    assert c.delta("kvtier:tier_errors_total", tier="s3", cause=cause) >= 1, server.log_tail()
    assert c.delta("kvtier:loaded_tokens_total") == MIDDLE * CHUNK
    assert_same_tokens(out, cold, c)
