"""The benchmarks' PNG plots, drawn from small made-up results (the benchmarks themselves need
vLLM servers or RGW and run elsewhere: test_bench_store.py, docs/benchmarks.md)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest

from kvtier_tools.bench import tier_client_runs as store_runs
from kvtier_tools.bench import tier_clients as bench_store
from kvtier_tools.bench import ttft as bench_ttft

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"

REPORT: dict[str, Any] = {
    "prompt_tokens": 16384,
    "prompts": 3,
    "output_tokens": 32,
    "max_num_batched_tokens": 16448,
    "model": "/tmp/tiny",
    "median_ttft_seconds": {
        "none": {"cold": 2.0, "warm": 0.05},
        "kvtier-disk": {"cold": 2.1, "warm": 0.12},
        "example": {"cold": 2.2, "warm": math.nan},  # no samples: drawn as n/a, not a crash
    },
    "ratios": {
        "disk_hit_after_restart / example_connector_hit (goal <= 1.0)": 0.8,
        "s3_hit_after_restart / cold_no_connector (goal <= 0.08)": None,
    },
}


def _is_png(path: Path) -> bool:
    return path.stat().st_size > len(PNG_MAGIC) and path.read_bytes()[:8] == PNG_MAGIC


def test_ttft_plot_writes_a_png(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    path = tmp_path / "bench-ttft.png"
    assert bench_ttft.plot_report(REPORT, str(path)) == str(path)
    assert _is_png(path)


def test_ttft_plot_without_matplotlib_writes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(bench_ttft, "pyplot", lambda: None)
    path = tmp_path / "bench-ttft.png"
    assert bench_ttft.plot_report(REPORT, str(path)) is None
    assert not path.exists()


def test_store_plot_writes_a_png(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    mib = 1024 * 1024
    cells = [
        store_runs.Cell(client, mib, op, speed, 1.0)
        for op in ("put", "get")
        for client, speed in (("raw boto3 16 thr", 300.0), ("kvtier s3 (boto3)", 280.0))
    ]
    path = tmp_path / "bench-store.png"
    assert bench_store._plot(cells, str(path)) == str(path)
    assert _is_png(path)


def test_ttft_command_writes_the_plot_next_to_the_json(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The command's output handling only: the measurement is replaced by REPORT."""
    pytest.importorskip("matplotlib")
    from kvtier_tools.cli import main as cli_main

    monkeypatch.setattr(bench_ttft, "run_bench", lambda args: REPORT)
    report = tmp_path / "bench-ttft.json"
    assert cli_main(["bench", "ttft", "--model", "unused", "--json", str(report)]) == 0
    assert _is_png(tmp_path / "bench-ttft.png")
    assert f"plot: {tmp_path / 'bench-ttft.png'}" in capsys.readouterr().out
