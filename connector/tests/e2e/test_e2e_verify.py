"""`kvtier verify` (what the kv_verify role runs) against a real server with CPU, disk and S3
tiers: a healthy stack passes all five steps without touching the production namespace, and a
threshold it cannot meet fails naming the step, the expected and the measured value."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from _e2e import VERIFY_NAMESPACE, S3Target, Servers, prompt, verify_settings

from kvtier.config import load_config
from kvtier_tools.admin.chunks import count_chunks
from kvtier_tools.server import VllmServer
from kvtier_tools.verify.checks import Step
from kvtier_tools.verify.report import first_failure, markdown, report
from kvtier_tools.verify.settings import Settings
from kvtier_tools.verify.steps import run

# Asserts the warm/cold TTFT ratio: CI runs it alone.
pytestmark = pytest.mark.alone


@pytest.fixture(scope="module")
def stack(servers: Servers, s3_target: S3Target, e2e_root: Path) -> dict[str, Any]:
    values = s3_target.kvtier(
        local_cpu=True,
        max_local_cpu_size=1.0,
        local_disk=str(e2e_root / "verify-disk"),
        max_local_disk_size=1.0,
        request_namespaces=[VERIFY_NAMESPACE],
    )
    server = servers.make("verify", values, env=s3_target.env)
    return {"server": server, "values": values}


def _settings(stack: dict[str, Any], **overrides: Any) -> Settings:
    return verify_settings(stack["server"], stack["values"], **overrides)


def test_healthy_stack_passes_every_step_and_leaves_production_alone(
    stack: dict[str, Any], s3_target: S3Target, monkeypatch: pytest.MonkeyPatch
) -> None:
    for key, value in s3_target.env.items():
        monkeypatch.setenv(key, value)
    server: VllmServer = stack["server"]
    cfg = load_config(stack["values"])
    server.complete(prompt(1024, seed=11), max_tokens=4)  # production traffic: 4 chunks
    server.restart()  # flushes the background writes
    production = count_chunks(cfg, cfg.namespace)
    assert production["s3"] == 4 and production["disk"] == 4

    s = _settings(stack)
    steps: list[Step] = []
    run(s, steps)
    doc = report(s, steps, None)
    assert doc["ok"], (first_failure(steps), server.log_tail())
    assert [step["number"] for step in doc["steps"]] == [1, 2, 3, 4, 5]
    by_number = {step.number: step for step in steps}
    # the warm round's token reference really came from vLLM's prefix cache
    documents_tokens = s.documents * s.document_tokens
    assert by_number[2].values["reference"]["prefix_cache_hit_tokens"] >= 0.9 * documents_tokens
    assert by_number[3].values["objects"]["s3"] == documents_tokens // cfg.chunk_size
    assert by_number[4].values["s3_share"] >= 0.9
    assert by_number[4].values["warm_cold_ttft_ratio"] <= 0.6
    assert "PASSED" in markdown(doc, "test-host").splitlines()[0]
    # the verification namespace is gone, production's chunks are all still there
    assert count_chunks(cfg, VERIFY_NAMESPACE) == {"disk": 0, "s3": 0}
    assert count_chunks(cfg, cfg.namespace) == production


def test_unmet_threshold_names_step_expected_and_measured(
    stack: dict[str, Any], s3_target: S3Target, monkeypatch: pytest.MonkeyPatch
) -> None:
    for key, value in s3_target.env.items():
        monkeypatch.setenv(key, value)
    s = _settings(stack, documents=2, document_tokens=2048, seed=8, max_warm_cold_ratio=0.001)
    steps: list[Step] = []
    run(s, steps)
    failure = first_failure(steps)
    assert failure is not None
    assert failure.startswith("step 4 (warm round (from Ceph only)): median TTFT warm / cold:")
    assert re.search(r"expected <= 0\.001, measured \d+\.\d{3} \(\d", failure), failure
    assert [step.number for step in steps] == [1, 2, 3, 4]  # stopped at the failed step
    doc = report(s, steps, None)
    assert not doc["ok"] and doc["failure"] == failure
    assert "**FAILED**" in markdown(doc, "test-host")
    assert count_chunks(load_config(stack["values"]), VERIFY_NAMESPACE) == {"disk": 0, "s3": 0}
