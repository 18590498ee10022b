"""Chunk keys are stable across processes and depend on everything that shapes the bytes."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from kvtier.keys import (
    ChunkKey,
    LayoutFingerprint,
    UnkeyableExtraKey,
    chunk_bounds,
    chunk_hashes,
    chunk_id,
    encode_extra_keys,
    model_identity,
)

FP = LayoutFingerprint("m@abc", "bfloat16", 2, 2, 64, 16, 256, 0, 1, "cpu:vec16")


def test_chain_and_partial_chunks() -> None:
    toks = list(range(1000))
    full = chunk_hashes(toks, 256)
    assert len(full) == 3
    assert len(chunk_hashes(toks, 256, include_partial=True)) == 4
    assert chunk_hashes(toks[:768], 256) == full
    # the chain: changing token 0 changes every later chunk's hash
    changed = chunk_hashes([7, *toks[1:]], 256)
    assert all(a != b for a, b in zip(full, changed, strict=True))
    # changing a token in chunk 2 keeps chunks 0-1
    later = chunk_hashes([*toks[:600], 9999, *toks[601:]], 256)
    assert later[:2] == full[:2] and later[2] != full[2]
    # same tokens at another chunk position hash differently (prefix is part of the key)
    assert chunk_hashes(toks[256:512], 256)[0] != full[1]
    assert chunk_hashes([], 256) == []
    assert len(full[0]) == 32


def test_stable_across_processes_without_hashseed() -> None:
    code = (
        "from kvtier.keys import chunk_hashes;print(chunk_hashes(list(range(600)), 256, True)[-1])"
    )
    outs = set()
    for seed in ("1", "2", "random"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        res = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
        )
        outs.add(res.stdout.strip())
    assert outs == {chunk_hashes(list(range(600)), 256, True)[-1]}


def test_every_layout_field_changes_the_digest() -> None:
    changes = {
        "model_id": "other",
        "dtype": "float16",
        "num_layers": 3,
        "num_kv_heads": 4,
        "head_size": 128,
        "block_size": 32,
        "chunk_size": 128,
        "tp_rank": 1,
        "tp_size": 2,
        "kv_layout": "cpu:amx",
    }
    digests = {FP.digest()} | {replace(FP, **{k: v}).digest() for k, v in changes.items()}
    assert len(digests) == len(changes) + 1
    assert FP.digest() == LayoutFingerprint(*FP.__dict__.values()).digest()


def test_model_identity_ignores_local_path(tmp_path: Path) -> None:
    a, b = tmp_path / "a" / "tiny", tmp_path / "b" / "tiny-copy"
    for d in (a, b):
        d.mkdir(parents=True)
        (d / "config.json").write_text('{"hidden_size": 256}')
        (d / "tokenizer.json").write_text('{"v": 1}')
        (d / "model.safetensors").write_bytes(b"\0" * 10)
    assert model_identity(str(a), str(a)) == model_identity(str(b), str(b))
    assert model_identity("tiny", str(a)) == model_identity("tiny", str(b))
    assert model_identity("tiny", str(a)).startswith("tiny@")
    (b / "tokenizer.json").write_text('{"v": 2}')
    assert model_identity("tiny", str(a)) != model_identity("tiny", str(b))
    assert model_identity("tiny", str(a)) != model_identity("other", str(a))
    assert model_identity("org/model", None) == "org/model"


def test_extra_keys_are_encoded_canonically_and_unknown_ones_refused() -> None:
    salt_a = encode_extra_keys([("cache_salt", "a")])
    assert (
        salt_a
        == encode_extra_keys([("cache_salt", "a")])
        != encode_extra_keys([("cache_salt", "b")])
    )
    assert encode_extra_keys(None) == encode_extra_keys([]) == b""
    lora = ("lora", "name", "/path", "digest")
    assert encode_extra_keys([lora, ("mm", "img", 3)]) != encode_extra_keys([("mm", "img", 3)])
    # Fields do not run into each other: ("ab", "c") and ("a", "bc") differ.
    assert encode_extra_keys([("lora", "ab", "c", "d")]) != encode_extra_keys(
        [("lora", "a", "bc", "d")]
    )
    for bad in (("new_kind", 1), ("mm", "img", True), ("mm", "img"), ("cache_salt", 3), "salt"):
        with pytest.raises(UnkeyableExtraKey):
            encode_extra_keys([bad])  # type: ignore[list-item]


def test_extras_change_the_chunk_and_every_later_one() -> None:
    toks = list(range(1000))
    plain = chunk_hashes(toks, 256)
    assert chunk_hashes(toks, 256, extras=[b"", b"", b""]) == plain
    salted = chunk_hashes(toks, 256, extras=[b"s", b"", b""])
    assert all(a != b for a, b in zip(plain, salted, strict=True))
    later = chunk_hashes(toks, 256, extras=[b"", b"", b"img"])
    assert later[:2] == plain[:2] and later[2] != plain[2]
    assert chunk_bounds(1000, 256, True)[-1] == (768, 1000)
    with pytest.raises(ValueError, match="3 chunks"):
        chunk_hashes(toks, 256, extras=[b""])


def test_one_key_type_builds_and_parses_every_key() -> None:
    key = ChunkKey("prod", "f" * 32, "a" * 32)
    assert str(key) == f"prod/{'f' * 32}/{'a' * 32}"
    assert ChunkKey.parse(str(key)) == key
    assert ChunkKey.of("a" * 32, "prod", "f" * 32) == key
    own = ChunkKey.of(chunk_id("a" * 32, "tenant-b"), "prod", "f" * 32)
    assert own.namespace == "tenant-b" and own.digest == "a" * 32
    for bad in ("prod/x", "prod/.doctor/123", "a/b/c/d", "/f/a", "prod/../a"):
        with pytest.raises(ValueError, match="malformed chunk key"):
            ChunkKey.parse(bad)
