"""The soak benchmark's own arithmetic: the process tree, the RSS slope, the windows."""

from __future__ import annotations

import math
import os
import subprocess
import sys

from kvtier_tools.bench.load import Record
from kvtier_tools.bench.soak import _windows, process_tree, sample, slope_per_1000


def test_the_process_tree_holds_the_children() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(5)"])
    try:
        assert child.pid in process_tree(os.getpid())
        s = sample(os.getpid(), None)
        assert s["rss_mib"] > 1 and s["fds"] >= 3 and s["threads"] >= 1
    finally:
        child.kill()
        child.wait()


def test_the_slope_is_megabytes_per_thousand_requests() -> None:
    assert slope_per_1000([0, 500, 1000, 1500], [100, 101, 102, 103]) == 2.0
    assert slope_per_1000([10], [5]) == 0.0


def _record(start: float, ttft: float, error: str = "") -> Record:
    return Record("soak", 0, "d", "first", 10, start, ttft, 0.4, 4, error=error)


def test_windows_count_requests_by_their_end() -> None:
    records = [_record(0.1, 0.2), _record(1.5, 0.3), _record(2.1, math.nan, error="boom")]
    stats = {"rss_mib": 1.0, "threads": 1, "fds": 3, "s3_connections": 0}
    rows = _windows(records, [(1.0, stats), (3.0, stats)])
    assert [(w.requests, w.errors) for w in rows] == [(1, 0), (2, 1)]
    assert rows[1].ttft_p50_s == 0.3
