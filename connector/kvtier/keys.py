"""Chunk keys: chained content hashes of token ids plus a layout fingerprint.

Both are pure functions of their inputs (blake2b over fixed-width little-endian integers and over
canonical JSON), so every process on every host computes the same keys without PYTHONHASHSEED.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from array import array
from collections.abc import Sequence
from dataclasses import asdict, dataclass

#: Bytes of a chunk hash (hex string is twice as long).
HASH_BYTES = 16
#: Bumped whenever the hashing scheme changes, so old and new keys never collide.
_CHAIN_SEED = hashlib.blake2b(b"kvtier-chunk-chain-v1", digest_size=HASH_BYTES).digest()
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


def chunk_hashes(
    token_ids: Sequence[int], chunk_size: int, include_partial: bool = False
) -> list[str]:
    """Hex hash per chunk of ``chunk_size`` tokens; chunk i's hash covers chunks 0..i.

    The trailing chunk shorter than ``chunk_size`` gets a hash only when ``include_partial``
    (its hash differs from any full chunk's, since the token bytes differ in length).
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    raw = _token_bytes(token_ids)
    step = chunk_size * 8
    end = len(raw) if include_partial else len(raw) - len(raw) % step
    prev = _CHAIN_SEED
    out: list[str] = []
    for start in range(0, end, step):
        h = hashlib.blake2b(prev, digest_size=HASH_BYTES)
        h.update(raw[start : min(start + step, end)])
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

    def canonical(self) -> bytes:
        fields = asdict(self)
        if self.object_chunks == 1:  # an object per chunk: the digests from before runs existed
            del fields["object_chunks"]
        return json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()

    def digest(self) -> str:
        """32 hex characters (16 bytes)."""
        return hashlib.blake2b(
            b"kvtier-layout-v1\0" + self.canonical(), digest_size=HASH_BYTES
        ).hexdigest()
