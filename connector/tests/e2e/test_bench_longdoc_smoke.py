"""What CI runs of the benchmarks, against real vLLM servers: `kvtier bench compare --smoke`
(two scenarios, tiny sizes) and a small `kvtier bench longdoc`. What a user reads after them
(tables, progress bar, JSON, CSV, PNGs), and that repeated prompts are faster than their cold
round and served by a cache (kvtier's, where the test says so).
"""

from __future__ import annotations

import csv
import json
import socket
from collections.abc import Callable
from pathlib import Path

import pytest
from _e2e import VLLM_PYTHON, Counters, Servers, free_port

from kvtier_tools.cli import main
from kvtier_tools.server import VllmServer

# Asserts that warm beats cold: CI runs it alone.
pytestmark = pytest.mark.alone

SMOKE_SCENARIOS = {"vllm-prefix", "kvtier-cpu"}


def _bench_port() -> int:
    """A free port of the benchmarks' range (compare's default 8940 and up), else any."""
    for port in range(8940, 8950):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    return free_port()


def test_compare_smoke_warm_beats_cold_and_writes_the_files(
    tiny_model: str, scratch: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    report_path = scratch / "bench-compare.json"
    status = main(
        [
            "bench", "compare", "--smoke", "--model", tiny_model, "--vllm-python", VLLM_PYTHON,
            "--port", str(_bench_port()), "--work-dir", str(scratch / "work"),
            "--json", str(report_path),
        ]
    )  # fmt: skip
    out = capsys.readouterr().out
    assert status == 0, out
    for title in ("A: one long prompt", "B: conversation", "C: mixed load", "D: short prompt"):
        assert title in out

    report = json.loads(report_path.read_text())
    assert set(report["scenarios"]) == SMOKE_SCENARIOS
    for name, scenario in report["scenarios"].items():
        assert "error" not in scenario, f"{name}: {scenario.get('error')}"
        a = scenario["presets"]["A"]
        assert a["warm"]["ttft_p50_s"] < a["cold"]["ttft_p50_s"], (name, a)
        assert a["cold"]["hit_rate"] == 0 and a["warm"]["hit_rate"] > 0.9, (name, a)
    kvtier_a = report["scenarios"]["kvtier-cpu"]["presets"]["A"]["warm"]
    assert kvtier_a["kvtier_loaded_tokens"] >= 0.9 * kvtier_a["server_prompt_tokens"]

    with report_path.with_suffix(".csv").open() as f:
        rows = list(csv.DictReader(f))
    assert [r for r in rows if r["error"]] == []
    for name in SMOKE_SCENARIOS:
        mine = [r for r in rows if r["scenario"] == name]
        a = [(r["round"], r["doc"], r["kind"]) for r in mine if r["preset"] == "A"]
        assert a == [("cold", "prompt-0", "first"), ("warm", "prompt-0", "repeat"), a[1]]
        cold, *warm = (float(r["ttft_s"]) for r in mine if r["preset"] == "A")
        assert all(t < cold for t in warm), (name, cold, warm)
        assert sum(r["preset"] == "B" for r in mine) == 2 * 3  # 3 turns, then their replay
        assert sum(r["preset"] == "D" for r in mine) == 2
        assert {r["round"] for r in mine if r["preset"] == "C"} == {"cold", "warm"}

    for key in "ABCD":
        png = report_path.with_name(f"bench-compare-{key}.png")
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", png


def test_longdoc_against_vllm_with_kvtier_repeats_are_served_by_kvtier(
    servers: Servers,
    counters: Callable[[VllmServer], Counters],
    scratch: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    # kvtier's CPU tier with vLLM's prefix cache off: every hit of the warm round is kvtier's.
    server = servers.make(
        "longdoc", {"local_cpu": True, "max_local_cpu_size": 0.5}, prefix_caching=False
    )
    seen = counters(server)
    report_path = scratch / "longdoc.json"
    status = main(
        [
            "bench", "longdoc", "--base-url", server.base_url + "/v1", "--model",
            server.served_model_name, "--num-documents", "3", "--document-length", "2048",
            "--output-len", "8", "--repeat-count", "2", "--repeat-mode", "tile",
            "--hit-miss-ratio", "2:1", "--max-inflight-requests", "1",
            "--json", str(report_path),
        ]
    )  # fmt: skip
    out = capsys.readouterr()
    assert status == 0, out
    assert "[##############################] 6/6 warm round" in out.err
    report = json.loads(report_path.read_text())
    repeats = report["warm_by_kind"]["repeat"]
    assert repeats["ttft_mean_s"] < report["rounds"]["cold"]["ttft_mean_s"], report["rounds"]
    # 4 repeated documents in the warm round (2:1 of 6), all full chunks but the last
    # block of each loaded by kvtier; the 2 new documents and the cold round load nothing.
    assert seen.delta("kvtier:loaded_tokens_total") >= 4 * (2048 - 256)
    with report_path.with_suffix(".csv").open() as f:
        rows = list(csv.DictReader(f))
    assert [r["round"] for r in rows] == ["cold"] * 3 + ["warm"] * 6
    assert [r for r in rows if r["error"]] == []
    assert report_path.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
