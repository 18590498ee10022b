"""A request's identity beyond its tokens, per chunk, as kvtier keys it.

vLLM's prefix cache hashes each block's tokens together with "extra keys"
(`vllm.v1.core.kv_cache_utils.generate_block_hash_extra_keys`): the LoRA adapter (name and
path), the multimodal items overlapping the block (identifier, offset in the block), the
request's ``cache_salt`` (first block only) and a digest of the block's prompt embeddings.
kvtier asks that same function for each chunk's token range, so its keys cover whatever vLLM's
do, and encodes the answer with `kvtier.keys.encode_extra_keys` (chained: a salt in chunk 0
reaches every later chunk's key, as in vLLM).

kvtier's chunks outlive the process, vLLM's cache does not, so one thing is added: the content
of the adapter's files. An adapter replaced under the same name and path, then loaded by a
restarted server, computes other KV; its digest (blake2b of the adapter directory's files,
read once per adapter and process) makes those other keys.

Fail closed: an extra key of a kind kvtier cannot encode (a later vLLM's, say) or an adapter
whose files cannot be read raises `Uncacheable`; the connector then serves the request without
kvtier (nothing looked up, loaded or saved), logs the reason once and counts it.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from typing import Any

from vllm.v1.core.kv_cache_utils import generate_block_hash_extra_keys

from kvtier.keys import UnkeyableExtraKey, chunk_bounds, encode_extra_keys


class Uncacheable(Exception):
    """A request kvtier must not cache; ``reason`` is the label it is counted under."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


def adapter_digest(path: str) -> str:
    """blake2b (16 bytes, hex) of the regular files of a LoRA adapter directory: names, sizes
    and contents, in name order."""
    if not os.path.isdir(path):
        raise Uncacheable(
            "lora_unreadable",
            f"LoRA adapter path {path!r} is not a directory this process can read, so kvtier "
            "cannot tell its content apart from another adapter's",
        )
    h = hashlib.blake2b(b"kvtier-lora-v1", digest_size=16)
    try:
        for name in sorted(os.listdir(path)):
            full = os.path.join(path, name)
            if not os.path.isfile(full):
                continue
            h.update(name.encode() + b"\0" + os.path.getsize(full).to_bytes(8, "little"))
            with open(full, "rb") as f:
                while block := f.read(1 << 20):
                    h.update(block)
    except OSError as exc:
        raise Uncacheable(
            "lora_unreadable", f"LoRA adapter files under {path!r} cannot be read: {exc}"
        ) from exc
    return h.hexdigest()


class RequestIdentity:
    """Per-chunk extra keys of vLLM requests (one instance per connector, one thread)."""

    def __init__(self, chunk_size: int, include_partial: bool) -> None:
        self.chunk_size = chunk_size
        self.include_partial = include_partial
        #: (lora_int_id, path) -> digest: an adapter is read once per process, as vLLM loads it
        #: once per id.
        self._adapters: dict[tuple[int, str], str] = {}

    def prompt(self, request: Any) -> list[int]:
        """The prompt's token ids as vLLM hashes them (placeholders where embeddings stand)."""
        return list(request.all_token_ids[: request.num_prompt_tokens])

    def chunk_extras(self, request: Any) -> list[bytes] | None:
        """One encoded entry per chunk of the prompt (`kvtier.keys.chunk_bounds`); None when the
        request has no extra keys at all. Raises `Uncacheable`."""
        bounds = chunk_bounds(request.num_prompt_tokens, self.chunk_size, self.include_partial)
        out: list[bytes] = []
        for start, end in bounds:
            # The first multimodal item to consider: 0 lets vLLM skip those before the range.
            keys, _ = generate_block_hash_extra_keys(request, start, end, 0)
            out.append(self._encode(request, keys))
        return out if any(out) else None

    def _encode(self, request: Any, keys: Sequence[Any] | None) -> bytes:
        resolved = [self._with_adapter(request, key) for key in keys or ()]
        try:
            return encode_extra_keys(resolved)
        except UnkeyableExtraKey as exc:
            raise Uncacheable(
                "unknown_extra_key",
                f"vLLM keys this request's blocks with {exc}, which kvtier cannot encode",
            ) from exc

    def _with_adapter(self, request: Any, key: Any) -> Any:
        if not (isinstance(key, tuple) and key and key[0] == "lora"):
            return key
        lora = request.lora_request
        path = str(getattr(lora, "lora_path", "") or "")
        ident = (int(getattr(lora, "lora_int_id", 0)), path)
        digest = self._adapters.get(ident)
        if digest is None:
            digest = self._adapters[ident] = adapter_digest(path)
        return (*key, digest)
