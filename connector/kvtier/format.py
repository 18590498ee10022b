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
another layout is rejected, not read as KV. xxh3_64 was picked by measurement
(docs/benchmarks.md): ~26 GB/s vs crc32 ~4 GB/s and blake2b ~0.8 GB/s on this 2-core machine,
so verifying a chunk never dominates a disk or memory read.

An S3 object may hold a run of consecutive chunks of one prompt (``remote_chunks_per_object``):
its body is their blobs one after the other, its key the first chunk's, and its user metadata
``kvtier-chunks`` lists the short hashes of all of them in order (:func:`encode_chunk_list`), so
a HEAD tells a lookup which chunks the object holds. An object of one chunk is the chunk's blob
and may carry no list. :func:`split_object` cuts a body back into blobs.
"""

from __future__ import annotations

import struct
from typing import NamedTuple

import xxhash

from kvtier.keys import chunk_digest

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


#: An object of several chunks is cut at about this size when ``remote_chunks_per_object`` is
#: 0 (auto). On this RGW a GET costs ~3.4 ms plus ~2.2 ms per MiB (docs/benchmarks.md): at 8 MiB
#: the fixed cost is ~17 % of a request instead of ~90 % for a 256 KiB chunk. Measured S3 hits
#: of 16k-token prompts of the tiny model (256 KiB chunks), chunks per object -> seconds:
#: 1 -> 0.284, 4 -> 0.185, 8 -> 0.160, 16 -> 0.147, 32 -> 0.133, 64 -> 0.125; past 8 MiB the
#: gain is within noise, while a read that needs a few chunks still fetches the whole object.
OBJECT_TARGET_BYTES = 8 << 20
#: Most chunks in one object (its chunk list stays far below S3's 2 KiB of user metadata).
MAX_OBJECT_CHUNKS = 64


def chunks_per_object(payload_bytes: int, configured: int = 0) -> int:
    """Chunks per S3 object for chunks of ``payload_bytes``: ``configured``, or with 0 as many
    as ``OBJECT_TARGET_BYTES`` of payload hold (1 for a model whose chunk alone is larger: a
    7B model's 256-token chunk is 14 MiB)."""
    if configured > 0:
        return min(configured, MAX_OBJECT_CHUNKS)
    return max(1, min(MAX_OBJECT_CHUNKS, OBJECT_TARGET_BYTES // max(1, payload_bytes)))


#: S3 user metadata key of a multi-chunk object: its chunks' short hashes, comma-separated.
CHUNK_LIST_META = "kvtier-chunks"
#: Hex characters of a chunk hash in a chunk list (8 bytes: a list of 32 chunks is 543 bytes;
#: a clash only costs a failed load, the header's full hash decides).
SHORT_HASH_CHARS = 16


def short_hash(chunk_id: str) -> str:
    """The short form of a chunk id or key (`kvtier.keys`) in a chunk list."""
    return chunk_digest(chunk_id)[:SHORT_HASH_CHARS]


def encode_chunk_list(chunk_ids: list[str]) -> str:
    return ",".join(short_hash(c) for c in chunk_ids)


def decode_chunk_list(value: str | None) -> list[str]:
    """The short hashes of an object's ``kvtier-chunks``; [] when it has none."""
    return [v for v in (value or "").split(",") if v]


def split_object(
    header: bytes | memoryview, rest: bytes | memoryview
) -> tuple[list[tuple[bytes, bytes]], FormatError | None]:
    """The (header, payload) blobs of an object read as its first ``HEADER_SIZE`` bytes and the
    rest, and what broke the walk through them: each blob's length comes from its own header,
    so a header that is not kvtier's (``bad_magic``) or a length past the end (``truncated``)
    ends it, with the blobs before it returned. The blobs are verified by the caller
    (:func:`verify`)."""
    blobs: list[tuple[bytes, bytes]] = []
    head: bytes | memoryview = header
    offset = 0
    while True:
        fields = read_header(head)
        if fields is None:
            cause = "truncated" if len(head) < HEADER_SIZE else "bad_magic"
            return blobs, FormatError(cause, f"blob {len(blobs)} of the object is not a chunk")
        end = offset + fields.length
        if end > len(rest):
            left = len(rest) - offset
            return blobs, FormatError(
                "truncated", f"blob {len(blobs)} needs {fields.length} bytes, {left} left"
            )
        whole = offset == 0 and end == len(rest)  # one chunk: its payload as read, no copy
        payload = rest if whole and isinstance(rest, bytes) else bytes(rest[offset:end])
        blobs.append((bytes(head), payload))
        if end == len(rest):
            return blobs, None
        head, offset = rest[end : end + HEADER_SIZE], end + HEADER_SIZE
