"""The chunk header rejects anything that is not exactly the chunk asked for."""

from __future__ import annotations

import os

import pytest

from kvtier.format import HEADER_SIZE, FormatError, pack, read_header, unpack

LAYOUT = bytes(range(16))
CHUNK = bytes(range(16, 32))


def test_roundtrip() -> None:
    payload = os.urandom(4096)
    blob = pack(LAYOUT, CHUNK, 256, payload)
    assert len(blob) == HEADER_SIZE + len(payload)
    view, tokens = unpack(blob, LAYOUT, CHUNK)
    assert bytes(view) == payload and tokens == 256


def _cause(blob: bytes, layout: bytes = LAYOUT, chunk: bytes = CHUNK) -> str:
    with pytest.raises(FormatError) as err:
        unpack(blob, layout, chunk)
    return err.value.cause


def test_rejections() -> None:
    blob = pack(LAYOUT, CHUNK, 10, os.urandom(1000))
    flipped = bytearray(blob)
    flipped[HEADER_SIZE + 500] ^= 0x01
    assert _cause(bytes(flipped)) == "checksum"
    assert _cause(blob[:-1]) == "truncated"
    assert _cause(blob[:10]) == "truncated"
    assert _cause(b"XXXX" + blob[4:]) == "bad_magic"
    assert _cause(blob, layout=bytes(16)) == "layout_mismatch"
    assert _cause(blob, chunk=bytes(16)) == "key_mismatch"
    bad_version = bytearray(blob)
    bad_version[4] = 99
    assert _cause(bytes(bad_version)) == "version"
    # the test-only switch skips only the checksum
    view, _ = unpack(bytes(flipped), LAYOUT, CHUNK, verify_payload=False)
    assert len(view) == 1000


def test_read_header() -> None:
    blob = pack(LAYOUT, CHUNK, 77, b"abc")
    header = read_header(blob[:HEADER_SIZE])
    assert header is not None
    assert (header.layout, header.chunk, header.num_tokens, header.length) == (LAYOUT, CHUNK, 77, 3)
    assert read_header(b"nope" * 20) is None
