"""kvtier's chunk keys against vLLM's own block hashes of the same requests (vLLM's Request
objects and hasher; runs under the vLLM venv: `make test-cuda-cpu`).

The property: wherever vLLM's block hashes of two requests differ at a block, kvtier's keys of
the chunk holding that block differ too; where vLLM's agree over a whole chunk, so do kvtier's
(nothing shared is lost), except for what kvtier adds on purpose (the adapter's content).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from vllm import SamplingParams
from vllm.lora.request import LoRARequest
from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.request import Request

from kvtier.keys import chunk_hashes
from kvtier.vllm import identity as identity_module
from kvtier.vllm.identity import RequestIdentity, Uncacheable

BLOCK = 16
CHUNK = 64  # 4 blocks: chunks of several blocks, as in production
TOKENS = [(i * 7919) % 8000 + 300 for i in range(4 * CHUNK + 20)]  # 4 full chunks + a partial

init_none_hash(sha256)
_HASHER = get_request_block_hasher(BLOCK, sha256)


def _request(
    tokens: list[int] = TOKENS,
    *,
    salt: str | None = None,
    lora: LoRARequest | None = None,
    mm: list[tuple[str, int, int]] = (),  # type: ignore[assignment]
    embeds: Any = None,
) -> Request:
    features = [
        MultiModalFeatureSpec(
            data=None,
            modality="image",
            identifier=ident,
            mm_position=PlaceholderRange(offset=offset, length=length),
        )
        for ident, offset, length in mm
    ]
    return Request(
        request_id="r",
        prompt_token_ids=tokens,
        sampling_params=SamplingParams(max_tokens=1),
        pooling_params=None,
        prompt_embeds=embeds,
        mm_features=features or None,
        lora_request=lora,
        cache_salt=salt,
        block_hasher=_HASHER,
    )


def _keys(req: Request, ident: RequestIdentity | None = None) -> list[str]:
    ident = ident or RequestIdentity(CHUNK, include_partial=True)
    return chunk_hashes(ident.prompt(req), CHUNK, True, ident.chunk_extras(req))


def _first_differing_chunk_vllm(a: Request, b: Request) -> int | None:
    for i, (x, y) in enumerate(zip(a.block_hashes, b.block_hashes, strict=True)):
        if x != y:
            return i * BLOCK // CHUNK
    return None


def _agree_like_vllm(a: Request, b: Request) -> None:
    ka, kb = _keys(a), _keys(b)
    first = _first_differing_chunk_vllm(a, b)
    full = len(a.block_hashes) * BLOCK // CHUNK  # chunks vLLM hashed whole
    for c in range(len(ka)):
        if first is not None and c >= first:
            assert ka[c] != kb[c], f"vLLM's hashes differ at chunk {c}, kvtier's keys agree"
        elif c < full:
            assert ka[c] == kb[c], f"vLLM's hashes agree over chunk {c}, kvtier's keys differ"


def _adapter(root: Path, name: str, content: bytes) -> LoRARequest:
    path = root / name
    path.mkdir(exist_ok=True)
    (path / "adapter_config.json").write_text('{"r": 8}')
    (path / "adapter_model.safetensors").write_bytes(content)
    return LoRARequest(name, 1 + hash(name) % 1000, str(path))


def test_plain_requests_are_keyed_by_tokens_alone() -> None:
    req = _request()
    assert _keys(req) == chunk_hashes(TOKENS, CHUNK, True)  # what kvtier ls/explain compute
    other = _request([*TOKENS[:100], 1, *TOKENS[101:]])
    _agree_like_vllm(req, other)


def test_cache_salt_changes_every_chunk() -> None:
    plain, a, b = _request(), _request(salt="tenant-a"), _request(salt="tenant-b")
    for x, y in ((plain, a), (a, b), (plain, b)):
        assert _first_differing_chunk_vllm(x, y) == 0
        _agree_like_vllm(x, y)
    assert _keys(a) == _keys(_request(salt="tenant-a"))


def test_lora_adapters_and_their_content(tmp_path: Path) -> None:
    a = _adapter(tmp_path, "a", b"weights of a")
    b = _adapter(tmp_path, "b", b"weights of b")
    base, with_a, with_b = _request(), _request(lora=a), _request(lora=b)
    for x, y in ((base, with_a), (with_a, with_b), (base, with_b)):
        _agree_like_vllm(x, y)
    assert _keys(with_a) == _keys(_request(lora=a))
    # The same name and path, other weights (an adapter replaced, a server restarted): vLLM's
    # hashes agree (its cache dies with the process); kvtier's chunks outlive it: they differ.
    before = _keys(with_a)
    _adapter(tmp_path, "a", b"new weights of a")
    replaced = _request(lora=a)
    assert replaced.block_hashes == with_a.block_hashes
    after = _keys(replaced, RequestIdentity(CHUNK, include_partial=True))
    assert all(x != y for x, y in zip(before, after, strict=True))


def test_an_adapter_kvtier_cannot_read_is_not_cached(tmp_path: Path) -> None:
    gone = LoRARequest("gone", 7, str(tmp_path / "missing"))
    with pytest.raises(Uncacheable) as err:
        _keys(_request(lora=gone))
    assert err.value.reason == "lora_unreadable"


def test_multimodal_items_at_their_positions() -> None:
    one = _request(mm=[("img-1", 70, 40)])
    other_image = _request(mm=[("img-2", 70, 40)])
    moved = _request(mm=[("img-1", 74, 40)])
    for x, y in ((one, other_image), (one, moved), (_request(), one)):
        assert _first_differing_chunk_vllm(x, y) == 1  # the item starts in chunk 1
        _agree_like_vllm(x, y)
    two = _request(mm=[("img-1", 70, 40), ("img-3", 200, 30)])
    swapped = _request(mm=[("img-1", 70, 40), ("img-4", 200, 30)])
    assert _first_differing_chunk_vllm(two, swapped) == 3
    _agree_like_vllm(two, swapped)


def test_prompt_embeddings() -> None:
    import torch

    gen = torch.Generator().manual_seed(0)
    e1 = torch.randn(len(TOKENS), 8, generator=gen)
    e2 = e1.clone()
    e2[150] += 1.0  # one position in chunk 2
    x, y = _request(None, embeds=e1), _request(None, embeds=e2)  # type: ignore[arg-type]
    assert _first_differing_chunk_vllm(x, y) == 2
    _agree_like_vllm(x, y)


def test_an_extra_key_of_a_new_kind_is_not_cached(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(
        identity_module,
        "generate_block_hash_extra_keys",
        lambda request, start, end, mm_idx: ((("speculative_tree", 3),), mm_idx),
    )
    with pytest.raises(Uncacheable) as err:
        _keys(_request())
    assert err.value.reason == "unknown_extra_key"
    assert "speculative_tree" in str(err.value)
