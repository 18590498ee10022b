"""A request's identity beyond its tokens is in every chunk key (S3 tier only, vLLM's prefix
cache on, so hits are asserted after a restart, when only kvtier can serve them).

- salt: the same prompt under cache_salt A, then (after a restart) under B: 0 tokens from
  kvtier for B; without a salt: 0; A again after a restart: hits, A's cold tokens;
- LoRA: the same prompt under adapter a, adapter b and the base model: no hits across them;
  a again after a restart: hits, a's cold tokens.

On kvtier's tokens-only keys (before chunk keys covered the identity) B, the base model and b
each loaded the other's chunks (the issue's measurement: 5,376 of 5,500 prompt tokens).
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest
from _e2e import (
    CHUNK,
    OUTPUT_TOKENS,
    VLLM_PYTHON,
    Counters,
    S3Target,
    Servers,
    assert_same_tokens,
    prompt,
)

from kvtier.completions import Completion, stream_completion
from kvtier.vllm.server import VllmServer

SALTED = prompt(12 * CHUNK + 1, seed=401)
ADAPTED = prompt(10 * CHUNK + 1, seed=402)


@pytest.fixture(scope="module")
def server(servers: Servers, s3_target: S3Target, e2e_root: Path) -> VllmServer:
    adapters = []
    for name, seed in (("a", 1), ("b", 2)):
        path = e2e_root / f"lora-{name}"
        done = subprocess.run(
            [
                VLLM_PYTHON,
                "-m",
                "kvtier.cli",
                "model",
                "make-tiny-lora",
                str(path),
                "--seed",
                str(seed),
            ],
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
        assert done.returncode == 0, done.stderr[-3000:]
        adapters.append(f"{name}={path}")
    srv = servers.make(
        "identity",
        s3_target.kvtier(),
        env=s3_target.env,
        extra_args=("--enable-lora", "--max-lora-rank", "8", "--lora-modules", *adapters),
    )
    srv.complete(prompt(64, seed=95), max_tokens=4)
    return srv


def ask(server: VllmServer, doc: list[int], model: str | None = None, **body: Any) -> Completion:
    return stream_completion(
        server.base_url,
        model or server.served_model_name,
        doc,
        OUTPUT_TOKENS,
        extra_body=body or None,
    )


def restart(server: VllmServer) -> None:
    server.restart()
    server.complete(prompt(64, seed=94), max_tokens=4)


def stored(s3_target: S3Target, chunks: int) -> None:
    assert s3_target.wait_for_chunks(chunks) == chunks


def test_a_tenant_never_loads_another_tenants_chunks(
    server: VllmServer, s3_target: S3Target
) -> None:
    before = s3_target.chunks()
    cold_a = ask(server, SALTED, cache_salt="tenant-a")
    stored(s3_target, before + len(SALTED) // CHUNK)
    for salt in ("tenant-b", None):
        restart(server)
        c = Counters(server)
        out = ask(server, SALTED, **({"cache_salt": salt} if salt else {}))
        assert c.delta("vllm:external_prefix_cache_hits_total") == 0, (salt, server.log_tail())
        assert c.delta("kvtier:hit_tokens_total") == 0
        assert len(out.token_ids) == OUTPUT_TOKENS
    restart(server)
    c = Counters(server)
    again = ask(server, SALTED, cache_salt="tenant-a")
    assert c.delta("vllm:external_prefix_cache_hits_total") >= 0.9 * len(SALTED)
    assert c.delta("kvtier:load_failed_tokens_total") == 0
    assert_same_tokens(again, cold_a, c)


def test_a_lora_adapter_never_loads_another_adapters_chunks(
    server: VllmServer, s3_target: S3Target
) -> None:
    before = s3_target.chunks()
    cold_a = ask(server, ADAPTED, model="a")
    stored(s3_target, before + len(ADAPTED) // CHUNK)
    for model in ("b", None):
        restart(server)
        c = Counters(server)
        out = ask(server, ADAPTED, model=model)
        assert c.delta("vllm:external_prefix_cache_hits_total") == 0, (model, server.log_tail())
        assert c.delta("kvtier:hit_tokens_total") == 0
        assert out.token_ids != cold_a.token_ids  # the adapter changes what the model says
    restart(server)
    c = Counters(server)
    again = ask(server, ADAPTED, model="a")
    assert c.delta("vllm:external_prefix_cache_hits_total") >= 0.9 * len(ADAPTED)
    assert_same_tokens(again, cold_a, c)
    assert "Traceback" not in server.log_text()
