"""Chunk keys: chained hashes of a request's identity per chunk, plus a layout fingerprint.

A chunk's hash covers its tokens and what else decides the KV computed for them: the "extra
keys" vLLM's own prefix cache puts into a block hash (the LoRA adapter, multimodal items and
their offsets, the ``cache_salt`` on the first chunk, prompt-embedding digests; see
`kvtier.vllm.identity`), encoded here by `encode_extra_keys`. Both are pure functions of their
inputs (blake2b over fixed-width little-endian integers, length-prefixed fields and canonical
JSON), so every process on every host computes the same keys without PYTHONHASHSEED.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from array import array
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

#: Bytes of a chunk hash (hex string is twice as long).
HASH_BYTES = 16
#: Bumped whenever the hashing scheme changes, so old and new keys never collide. v1 hashed the
#: tokens only: its chunks of a salted, LoRA or multimodal request would match a plain request
#: of the same tokens, so under v2 they are never found (misses, then lifecycle expiry).
_CHAIN_SEED = hashlib.blake2b(b"kvtier-chunk-chain-v2", digest_size=HASH_BYTES).digest()
#: The extra keys kvtier can encode, with the types of their fields (vLLM's tags, plus the
#: digest of the adapter's files kvtier adds to "lora"). Anything else is not keyable.
EXTRA_KEY_FIELDS: dict[str, tuple[type, ...]] = {
    "lora": (str, str, str),  # name, path, digest of the adapter's files
    "mm": (str, int),  # the item's identifier (a content hash or the user's uuid), its offset
    "cache_salt": (str,),
    "prompt_embeds": (bytes,),  # vLLM's sha256 of the chunk's prompt embeddings
}


class UnkeyableExtraKey(ValueError):
    """An extra key kvtier cannot encode: the request must not be cached."""


#: Files whose content decides what a model computes (weights are covered by the served name
#: plus config: hashing GBs of weights at startup would cost minutes).
MODEL_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
)


def _token_bytes(token_ids: Sequence[int]) -> bytes:
    # int64 little-endian: token ids never overflow it, and the byte order is fixed.
    arr = array("q", token_ids)
    if sys.byteorder != "little":
        arr.byteswap()
    return arr.tobytes()


def _field(value: Any) -> bytes:
    if isinstance(value, bool):  # a bool is an int to isinstance: never a field here
        raise UnkeyableExtraKey(f"a boolean field {value!r}")
    if isinstance(value, int):
        return b"i" + value.to_bytes(16, "little", signed=True)
    if isinstance(value, str):
        data = value.encode("utf-8", "surrogatepass")
        return b"s" + len(data).to_bytes(8, "little") + data
    if isinstance(value, bytes):
        return b"b" + len(value).to_bytes(8, "little") + value
    raise UnkeyableExtraKey(f"a field of type {type(value).__name__}")


def encode_extra_keys(keys: Sequence[Sequence[Any]] | None) -> bytes:
    """The canonical bytes of one chunk's extra keys (``b""`` for none), in their order.

    Each key is a tuple ``(tag, *fields)`` with a tag of `EXTRA_KEY_FIELDS` and fields of the
    types it lists; anything else raises `UnkeyableExtraKey` (fail closed: a key kvtier cannot
    write down is a request it must not cache).
    """
    out = bytearray()
    for key in keys or ():
        if not isinstance(key, tuple) or not key or not isinstance(key[0], str):
            raise UnkeyableExtraKey(f"an extra key {key!r} that is not a tagged tuple")
        tag, fields = key[0], key[1:]
        types = EXTRA_KEY_FIELDS.get(tag)
        if types is None:
            raise UnkeyableExtraKey(f"an extra key of kind {tag!r}")
        if len(fields) != len(types) or not all(
            isinstance(f, t) and not isinstance(f, bool) for f, t in zip(fields, types, strict=True)
        ):
            raise UnkeyableExtraKey(f"an extra key {tag!r} with fields {fields!r}")
        out += _field(tag) + len(fields).to_bytes(1, "little")
        for f in fields:
            out += _field(f)
    return bytes(out)


def chunk_bounds(num_tokens: int, chunk_size: int, include_partial: bool) -> list[tuple[int, int]]:
    """(start, end) token range of each chunk that gets a hash (see `chunk_hashes`)."""
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    end = num_tokens if include_partial else num_tokens - num_tokens % chunk_size
    return [(s, min(s + chunk_size, end)) for s in range(0, end, chunk_size)]


def chunk_hashes(
    token_ids: Sequence[int],
    chunk_size: int,
    include_partial: bool = False,
    extras: Sequence[bytes] | None = None,
) -> list[str]:
    """Hex hash per chunk of ``chunk_size`` tokens; chunk i's hash covers chunks 0..i.

    ``extras`` (one entry per chunk of `chunk_bounds`, from `encode_extra_keys`) adds each
    chunk's extra keys; none, or ``b""``, for a request with only tokens. The trailing chunk
    shorter than ``chunk_size`` gets a hash only when ``include_partial`` (its hash differs from
    any full chunk's: the token bytes are length-prefixed).
    """
    bounds = chunk_bounds(len(token_ids), chunk_size, include_partial)
    if extras is not None and len(extras) != len(bounds):
        raise ValueError(f"{len(extras)} extra keys for {len(bounds)} chunks")
    raw = _token_bytes(token_ids)
    prev = _CHAIN_SEED
    out: list[str] = []
    for i, (start, end) in enumerate(bounds):
        tokens = raw[start * 8 : end * 8]
        extra = extras[i] if extras is not None else b""
        h = hashlib.blake2b(prev, digest_size=HASH_BYTES)
        h.update(len(tokens).to_bytes(8, "little") + tokens)
        h.update(len(extra).to_bytes(8, "little") + extra)
        prev = h.digest()
        out.append(prev.hex())
    return out


def model_identity(served_model_name: str, model_dir: str | None) -> str:
    """``name@hash`` where hash covers the model's config and tokenizer files.

    Two hosts serving the same model from different local paths agree: when the served name is
    itself a filesystem path (vLLM's default when ``--served-model-name`` is not given), it is
    replaced by ``local`` so that only the files' content identifies the model.
    """
    name = served_model_name
    if model_dir is not None and (name == model_dir or (os.sep in name and os.path.exists(name))):
        name = "local"
    if model_dir is None:
        return name
    h = hashlib.blake2b(digest_size=8)
    found = 0
    for fname in MODEL_FILES:
        path = os.path.join(model_dir, fname)
        try:
            with open(path, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            continue
        found += 1
        h.update(fname.encode() + b"\0" + len(data).to_bytes(8, "little") + data)
    if not found:
        return name
    return f"{name}@{h.hexdigest()}"


@dataclass(frozen=True)
class LayoutFingerprint:
    """Everything that decides how the stored bytes must be read back.

    ``kv_layout`` is the attention backend's memory layout as the connector names it (e.g.
    ``"cpu:vec16"``, ``"flash_attn:nhd"``): data written under another layout is never read as
    this one because the digest differs.
    """

    model_id: str
    dtype: str
    num_layers: int
    num_kv_heads: int
    head_size: int
    block_size: int
    chunk_size: int
    tp_rank: int
    tp_size: int
    kv_layout: str
    #: Chunks per S3 object (kvtier.format): hosts that cut runs differently share nothing.
    object_chunks: int = 1
    #: Pipeline stage: a stage holds only its own layers, ``layers`` = ``"<start>-<end>"`` of
    #: the model's layer indices (vLLM's split, `kvtier.vllm.layout.PipelineStage`), so stages
    #: of the same shape never read each other's chunks.
    pp_rank: int = 0
    pp_size: int = 1
    layers: str = ""

    def canonical(self) -> bytes:
        fields = asdict(self)
        if self.object_chunks == 1:  # an object per chunk: the digests from before runs existed
            del fields["object_chunks"]
        if self.pp_size == 1:  # one stage holds every layer: the digests from before PP
            for name in ("pp_rank", "pp_size", "layers"):
                del fields[name]
        return json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()

    def digest(self) -> str:
        """32 hex characters (16 bytes)."""
        return hashlib.blake2b(
            b"kvtier-layout-v1\0" + self.canonical(), digest_size=HASH_BYTES
        ).hexdigest()


@dataclass(frozen=True)
class ChunkKey:
    """Where a chunk is filed in every tier: ``<namespace>/<fingerprint>/<hash>``.

    The only place that builds or parses that layout (the store and its tiers, `kvtier
    ls/purge/explain`, verify), so writers and readers cannot drift. Inside a server a chunk is
    named by its *chunk id*: ``<hash>``, or ``<namespace>/<hash>`` for a request that chose its
    own namespace (`chunk_id`, `ChunkKey.of`).
    """

    namespace: str
    fingerprint: str
    digest: str

    def __post_init__(self) -> None:
        for part in (self.namespace, self.fingerprint, self.digest):
            # A hidden name is never a chunk (kvtier doctor's probes, ".", "..").
            if not part or "/" in part or part.startswith("."):
                raise ValueError(f"malformed chunk key {str(self)!r}")

    def __str__(self) -> str:
        return f"{self.namespace}/{self.fingerprint}/{self.digest}"

    @classmethod
    def parse(cls, key: str) -> ChunkKey:
        """The key of ``<namespace>/<fingerprint>/<hash>``; ValueError for anything else."""
        parts = key.split("/")
        if len(parts) != 3:
            raise ValueError(f"malformed chunk key {key!r}")
        return cls(*parts)

    @classmethod
    def of(cls, chunk_id: str, namespace: str, fingerprint: str) -> ChunkKey:
        """The key of a chunk id under the store's ``namespace`` (unless the id names its own)."""
        own, _, digest = chunk_id.rpartition("/")
        return cls(own or namespace, fingerprint, digest)


def chunk_id(digest: str, namespace: str | None = None) -> str:
    """A chunk's id inside a server: its hash, filed under ``namespace`` when given."""
    return f"{namespace}/{digest}" if namespace is not None else digest


def chunk_digest(chunk_id_or_key: str) -> str:
    """The chained hash of a chunk id or a key (its last part)."""
    return chunk_id_or_key.rpartition("/")[2]
