"""`kvtier bench compare --smoke` against real vLLM servers (two scenarios, tiny sizes; what CI
runs of the benchmarks): what a user reads after it, the tables, the JSON, the CSV and the PNGs,
and that the repeated long prompt's warm round is faster than its cold round, served by a cache.
"""

from __future__ import annotations

import csv
import json
import socket
from pathlib import Path

import pytest
from _e2e import VLLM_PYTHON, free_port

from kvtier.cli import main

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
