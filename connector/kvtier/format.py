"""On-tier chunk format: a fixed 64-byte header followed by the raw payload.

Header (little-endian)::

    magic     4s  b"KVTC"
    version   H   FORMAT_VERSION
    algo      B   checksum algorithm (1 = xxh3_64)
    reserved  B
    layout   16s  LayoutFingerprint digest
    chunk    16s  chunk hash
    tokens    I   tokens in the chunk
    length    Q   payload bytes
    checksum  Q   checksum of the payload
    padding   to 64 bytes

The header names the layout and the chunk, so a blob copied under another key or written under
another layout is rejected, not read as KV. xxh3_64 was picked by measurement (docs/benchmarks.md):
~26 GB/s vs crc32 ~4 GB/s and blake2b ~0.8 GB/s on this 2-core machine, so verifying a chunk
never dominates a disk or memory read.
"""

from __future__ import annotations

import struct
from typing import NamedTuple

import xxhash

MAGIC = b"KVTC"
FORMAT_VERSION = 1
ALGO_XXH3_64 = 1
_HEADER = struct.Struct("<4sHBB16s16sIQQ")
HEADER_SIZE = 64
_PAD = b"\0" * (HEADER_SIZE - _HEADER.size)


class FormatError(ValueError):
    """A stored blob that must not be used; ``cause`` is a short counter label."""

    def __init__(self, cause: str, message: str) -> None:
        super().__init__(message)
        self.cause = cause


class Header(NamedTuple):
    magic: bytes
    version: int
    algo: int
    layout: bytes
    chunk: bytes
    num_tokens: int
    length: int
    checksum: int


def read_header(blob: bytes | memoryview) -> Header | None:
    """The header fields of a stored blob (e.g. its first 64 bytes), or None if not kvtier's."""
    if len(blob) < HEADER_SIZE:
        return None
    magic, version, algo, _, layout, chunk, tokens, length, want = _HEADER.unpack_from(blob)
    if magic != MAGIC:
        return None
    return Header(magic, version, algo, layout, chunk, tokens, length, want)


def checksum(payload: bytes | memoryview) -> int:
    return xxhash.xxh3_64_intdigest(payload)


def pack_header(layout: bytes, chunk: bytes, num_tokens: int, payload: bytes | memoryview) -> bytes:
    return (
        _HEADER.pack(
            MAGIC,
            FORMAT_VERSION,
            ALGO_XXH3_64,
            0,
            layout,
            chunk,
            num_tokens,
            len(payload),
            checksum(payload),
        )
        + _PAD
    )


def pack(layout: bytes, chunk: bytes, num_tokens: int, payload: bytes | memoryview) -> bytes:
    """Header + payload as one bytes object (tiers that need one body, e.g. an S3 PUT)."""
    return b"".join((pack_header(layout, chunk, num_tokens, payload), payload))


def verify(
    header: bytes | memoryview,
    payload: bytes | memoryview,
    layout: bytes,
    chunk: bytes,
    check_payload: bool = True,
) -> int:
    """Check a stored (header, payload) against the expected layout and chunk; return tokens.

    Raises :class:`FormatError` with a cause among ``truncated``, ``bad_magic``, ``version``,
    ``layout_mismatch``, ``key_mismatch``, ``checksum``.
    """
    if len(header) < HEADER_SIZE:
        raise FormatError("truncated", f"blob of {len(header)} bytes is shorter than the header")
    magic, version, algo, _, got_layout, got_chunk, tokens, length, want = _HEADER.unpack_from(
        header
    )
    if magic != MAGIC:
        raise FormatError("bad_magic", f"not a kvtier chunk (magic {magic!r})")
    if version != FORMAT_VERSION or algo != ALGO_XXH3_64:
        raise FormatError("version", f"format version {version}/algo {algo} not readable")
    if got_layout != layout:
        raise FormatError("layout_mismatch", "chunk was written under another layout")
    if got_chunk != chunk:
        raise FormatError("key_mismatch", "chunk header names another chunk hash")
    if len(payload) != length:
        raise FormatError("truncated", f"payload is {len(payload)} bytes, header says {length}")
    if check_payload and checksum(payload) != want:
        raise FormatError("checksum", "payload checksum mismatch (corrupted data)")
    return int(tokens)


def split(blob: bytes | bytearray | memoryview) -> tuple[memoryview, memoryview]:
    """(header, payload) views of a whole stored blob."""
    view = memoryview(blob)
    return view[:HEADER_SIZE], view[HEADER_SIZE:]


def unpack(
    blob: bytes | bytearray | memoryview,
    layout: bytes,
    chunk: bytes,
    verify_payload: bool = True,
) -> tuple[memoryview, int]:
    """Check a whole stored blob; return (payload view, tokens). See :func:`verify`."""
    header, payload = split(blob)
    return payload, verify(header, payload, layout, chunk, verify_payload)
