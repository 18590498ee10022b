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

from kvtier_tools.completions import Completion, stream_completion
from kvtier_tools.server import VllmServer

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
                "kvtier_tools.cli",
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


def ask(server: VllmServer, doc: list[int], identity: dict[str, Any]) -> Completion:
    """``identity``: the request's ``model`` (an adapter) and ``cache_salt``, if any."""
    body = {k: v for k, v in identity.items() if k != "model"}
    return stream_completion(
        server.base_url,
        identity.get("model") or server.served_model_name,
        doc,
        OUTPUT_TOKENS,
        extra_body=body or None,
    )


def restart(server: VllmServer) -> None:
    server.restart()
    server.complete(prompt(64, seed=94), max_tokens=4)


def _isolated(
    server: VllmServer,
    s3_target: S3Target,
    doc: list[int],
    owner: dict[str, Any],
    others: list[dict[str, Any]],
) -> tuple[Completion, list[Completion]]:
    """``doc`` stored under ``owner``'s identity; each of ``others`` after a restart: nothing
    from kvtier; ``owner`` again after a restart: hits, its cold tokens. The owner's cold
    output and the others' outputs."""
    before = s3_target.chunks()
    cold = ask(server, doc, owner)
    wanted = before + len(doc) // CHUNK
    assert s3_target.wait_for_chunks(wanted) == wanted
    outputs = []
    for identity in others:
        restart(server)
        c = Counters(server)
        outputs.append(ask(server, doc, identity))
        hits = c.delta("vllm:external_prefix_cache_hits_total")
        assert hits == 0, (identity, hits, server.log_tail())
        assert c.delta("kvtier:hit_tokens_total") == 0
    restart(server)
    c = Counters(server)
    again = ask(server, doc, owner)
    assert c.delta("vllm:external_prefix_cache_hits_total") >= 0.9 * len(doc), server.log_tail()
    assert c.delta("kvtier:load_failed_tokens_total") == 0
    assert_same_tokens(again, cold, c)
    return cold, outputs


def test_a_tenant_never_loads_another_tenants_chunks(
    server: VllmServer, s3_target: S3Target
) -> None:
    _isolated(server, s3_target, SALTED, {"cache_salt": "tenant-a"}, [{"cache_salt": "b"}, {}])


def test_a_lora_adapter_never_loads_another_adapters_chunks(
    server: VllmServer, s3_target: S3Target
) -> None:
    cold_a, others = _isolated(server, s3_target, ADAPTED, {"model": "a"}, [{"model": "b"}, {}])
    for out in others:  # the adapter changes what the model says
        assert out.token_ids != cold_a.token_ids
    assert "Traceback" not in server.log_text()
