"""`kvtier bench soak`: a mixed workload against a running server for a fixed time, watching
for what a long run would reveal: failed requests, TTFT drifting, memory, file descriptors or
S3 connections growing, the bucket holding other than the chunks saved.

The workload is experiment C's (kvtier_tools.bench.presets.MixedLoad: new prompts and continuations
of open sessions, ``--inflight`` at a time). Every ``--window`` seconds one row: requests and
errors in the window, TTFT p50/p99, and of the server's process tree (``--pid``): RSS, threads,
open file descriptors and TCP connections to the S3 endpoint's port. At the end: the RSS slope
per 1,000 requests (least squares over the windows), the growth of descriptors and connections,
and, with ``--config`` and ``--namespace`` (the requests then carry that namespace, which the
server must allow in request_namespaces), the objects in the bucket under it against the chunks
the server saved (from /metrics). Output: the table, JSON (``--json``), one CSV row per request
(``--csv``), a PNG of TTFT and RSS over time (``--plot``).
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from kvtier_tools.bench.load import (
    Record,
    csv_rows,
    percentile,
    positive_int,
    run_requests,
    summarize,
    warm_up,
    write_csv,
    write_json,
)
from kvtier_tools.bench.plot import NO_MATPLOTLIB, pyplot, save
from kvtier_tools.bench.presets import MixedLoad, Sizes
from kvtier_tools.cli import add_command
from kvtier_tools.completions import Completion, stream_completion


@dataclass(frozen=True)
class Window:
    end_s: float
    requests: int
    errors: int
    ttft_p50_s: float
    ttft_p99_s: float
    rss_mib: float
    threads: int
    fds: int
    s3_connections: int


def process_tree(pid: int) -> list[int]:
    """``pid`` and its descendants (vLLM's engine and workers are children of the server)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    tree, todo = [], [pid]
    while todo:
        p = todo.pop()
        tree.append(p)
        todo.extend(children.get(p, []))
    return tree


def _status(pid: int, field: str) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def _sockets(pid: int) -> set[str]:
    inodes: set[str] = set()
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    except OSError:
        pass
    return inodes


def _connections_to(port: int, inodes: set[str], pid: int) -> int:
    """Established TCP connections among ``inodes`` whose remote port is ``port``."""
    count = 0
    for table in (f"/proc/{pid}/net/tcp", f"/proc/{pid}/net/tcp6"):
        try:
            with open(table) as f:
                next(f)
                for line in f:
                    cols = line.split()
                    remote, state, inode = cols[2], cols[3], cols[9]
                    if (
                        state == "01"
                        and inode in inodes
                        and int(remote.rsplit(":", 1)[1], 16) == port
                    ):
                        count += 1
        except (OSError, StopIteration, ValueError, IndexError):
            continue
    return count


def sample(pid: int | None, s3_port: int | None) -> dict[str, float]:
    """RSS (MiB), threads, open descriptors and S3 connections of ``pid``'s process tree."""
    if pid is None:
        return {"rss_mib": 0.0, "threads": 0, "fds": 0, "s3_connections": 0}
    tree = process_tree(pid)
    inodes: set[str] = set()
    fds = 0
    for p in tree:
        try:
            fds += len(os.listdir(f"/proc/{p}/fd"))
        except OSError:
            continue
        inodes |= _sockets(p)
    return {
        "rss_mib": sum(_status(p, "VmRSS") for p in tree) / 1024,
        "threads": sum(_status(p, "Threads") for p in tree),
        "fds": fds,
        "s3_connections": _connections_to(s3_port, inodes, pid) if s3_port else 0,
    }


def slope_per_1000(xs: Sequence[float], ys: Sequence[float]) -> float:
    """Least-squares slope of ``ys`` over ``xs`` (requests), times 1,000; 0 for < 2 points."""
    n = len(xs)
    if n < 2:
        return 0.0
    mx, my = sum(xs) / n, sum(ys) / n
    var = sum((x - mx) ** 2 for x in xs)
    return (
        1000 * sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / var if var else 0.0
    )


def _windows(records: list[Record], samples: list[tuple[float, dict[str, float]]]) -> list[Window]:
    rows: list[Window] = []
    previous = 0.0
    for end, s in samples:
        done = [r for r in records if previous <= r.start + r.latency < end]
        ttfts = [r.ttft for r in done if not r.error]
        rows.append(
            Window(
                end_s=round(end, 1),
                requests=len(done),
                errors=sum(1 for r in done if r.error),
                ttft_p50_s=percentile(ttfts, 50),
                ttft_p99_s=percentile(ttfts, 99),
                rss_mib=round(s["rss_mib"], 1),
                threads=int(s["threads"]),
                fds=int(s["fds"]),
                s3_connections=int(s["s3_connections"]),
            )
        )
        previous = end
    return rows


def _metric(base_url: str, name: str) -> float:
    import urllib.request

    from kvtier_tools.server import metric_sum, parse_metrics

    with urllib.request.urlopen(base_url.rstrip("/") + "/metrics", timeout=10) as resp:
        return metric_sum(parse_metrics(resp.read().decode()), name)


class _Sampler:
    """Samples the server's process tree every ``window`` seconds in a thread."""

    def __init__(self, pid: int | None, s3_port: int | None, window: float) -> None:
        self.pid, self.port, self.window = pid, s3_port, window
        self.samples: list[tuple[float, dict[str, float]]] = []
        self._stop = threading.Event()
        self._begin = time.perf_counter()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        while not self._stop.wait(self.window):
            self.samples.append((time.perf_counter() - self._begin, sample(self.pid, self.port)))

    def __enter__(self) -> _Sampler:
        self.first = sample(self.pid, self.port)
        self._begin = time.perf_counter()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.samples.append((time.perf_counter() - self._begin, sample(self.pid, self.port)))


def run(args: argparse.Namespace) -> dict[str, Any]:
    """The soak: its summary, windows and records."""
    from kvtier.config import load_config
    from kvtier_tools.admin.chunks import count_chunks, purge_namespace

    cfg = load_config(args.config) if args.config else None
    api_key = Path(args.api_key_file).read_text().strip() if args.api_key_file else None
    extra = {"kv_transfer_params": {"kvtier_namespace": args.namespace}} if args.namespace else {}
    base = args.base_url.rstrip("/").removesuffix("/v1")

    def complete(prompt: Sequence[int], max_tokens: int) -> Completion:
        return stream_completion(
            base, args.model, prompt, max_tokens, api_key=api_key, extra_body=extra, timeout=300
        )

    counted = cfg is not None and bool(args.namespace)
    if cfg is not None and counted:
        purge_namespace(cfg, args.namespace)
    endpoint = cfg.endpoint_url if cfg is not None and cfg.endpoint_url else None
    s3_port = urlparse(endpoint).port if endpoint else args.s3_port
    warm_up(complete)
    saved_before = _metric(base, "kvtier:saved_chunks_total")
    dropped_before = _metric(base, "kvtier:dropped_writes_total")
    load = MixedLoad(Sizes(c_inflight=args.inflight, c_output=args.output_len), args.seed)
    with _Sampler(args.pid, s3_port, args.window) as sampler:
        records = run_requests(
            complete,
            load.stream("soak"),
            output_len=args.output_len,
            inflight=args.inflight,
            duration=args.duration,
            label="soak",
        )
    time.sleep(args.settle)  # background writes land, counters reach /metrics
    windows = _windows(records, sampler.samples)
    saved = _metric(base, "kvtier:saved_chunks_total") - saved_before
    dropped = _metric(base, "kvtier:dropped_writes_total") - dropped_before
    chunks = None
    if cfg is not None and counted:
        chunks = count_chunks(cfg, args.namespace, "s3").get("s3")
        purge_namespace(cfg, args.namespace)
    done = [w.requests for w in windows]
    cumulative = [sum(done[: i + 1]) for i in range(len(done))]
    first, last = sampler.first, sampler.samples[-1][1]
    summary = {
        **summarize(records),
        "rss_mib_start": round(first["rss_mib"], 1),
        "rss_mib_end": round(last["rss_mib"], 1),
        "rss_mib_per_1000_requests": round(
            slope_per_1000(cumulative, [w.rss_mib for w in windows]), 2
        ),
        "fds_start": int(first["fds"]),
        "fds_end": int(last["fds"]),
        "s3_connections_start": int(first["s3_connections"]),
        "s3_connections_end": int(last["s3_connections"]),
        "chunks_saved": saved,
        "writes_dropped": dropped,
        "bucket_chunks": chunks,
    }
    return {"summary": summary, "windows": [asdict(w) for w in windows], "records": records}


def _print(result: dict[str, Any]) -> None:
    cols = ("end_s", "requests", "errors", "ttft_p50_s", "ttft_p99_s", "rss_mib", "fds")
    print("  ".join(f"{c:>10}" for c in (*cols, "s3_conns")))
    for w in result["windows"]:
        cells = [f"{w[c]:10.3f}" if isinstance(w[c], float) else f"{w[c]:10}" for c in cols]
        print("  ".join([*cells, f"{w['s3_connections']:10}"]))
    s = result["summary"]
    print(
        f"{s['requests']} requests, {s['failed']} failed; TTFT p50 {s['ttft_p50_s']:.3f} s, "
        f"p99 {s['ttft_p99_s']:.3f} s; RSS {s['rss_mib_start']} -> {s['rss_mib_end']} MiB "
        f"({s['rss_mib_per_1000_requests']} MiB per 1,000 requests); fds {s['fds_start']} -> "
        f"{s['fds_end']}; S3 connections {s['s3_connections_start']} -> "
        f"{s['s3_connections_end']}; chunks saved {s['chunks_saved']:.0f}, dropped "
        f"{s['writes_dropped']:.0f}, in the bucket {s['bucket_chunks']} chunks"
    )


def _plot(result: dict[str, Any], path: str) -> str:
    plt = pyplot()
    if plt is None:
        return NO_MATPLOTLIB
    windows = result["windows"]
    fig, (ttft, rss) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    t = [w["end_s"] for w in windows]
    ttft.plot(t, [w["ttft_p50_s"] for w in windows], marker="o", label="p50")
    ttft.plot(t, [w["ttft_p99_s"] for w in windows], marker="o", label="p99")
    ttft.set_ylabel("TTFT (s)")
    ttft.legend()
    rss.plot(t, [w["rss_mib"] for w in windows], marker="o", color="tab:red")
    rss.set_ylabel("server RSS (MiB)")
    rss.set_xlabel("time (s)")
    ttft.set_title("kvtier bench soak")
    return save(plt, fig, path)


def _cmd(args: argparse.Namespace) -> int:
    result = run(args)
    _print(result)
    records = result.pop("records")
    if args.json:
        write_json(
            args.json, {**result, "settings": {k: v for k, v in vars(args).items() if k != "func"}}
        )
    csv_path = args.csv or (str(Path(args.json).with_suffix(".csv")) if args.json else None)
    if csv_path:
        write_csv(csv_path, csv_rows(records))
    plot_path = args.plot or (str(Path(args.json).with_suffix(".png")) if args.json else None)
    if plot_path:
        print(f"plot: {_plot(result, plot_path)}", file=sys.stderr)
    return 1 if result["summary"]["failed"] else 0


def register(subparsers: Any) -> None:
    """Add `soak` to `kvtier bench`."""
    summary = "a mixed workload for a fixed time: errors, TTFT, RSS, descriptors, S3 connections"
    p = add_command(subparsers, "soak", summary, __doc__)
    p.add_argument("--base-url", required=True, help="e.g. http://127.0.0.1:8100")
    p.add_argument("--model", required=True, help="the served model name")
    p.add_argument("--api-key-file", help="file holding the API key (sent as a bearer token)")
    p.add_argument("--duration", type=float, default=600.0, help="seconds of load")
    p.add_argument("--window", type=float, default=10.0, help="seconds per table row")
    p.add_argument("--inflight", type=positive_int, default=4)
    p.add_argument("--output-len", type=positive_int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--pid", type=int, help="the server's main pid (RSS, descriptors, connections)")
    p.add_argument("--config", help="the server's kvtier YAML (bucket objects, with --namespace)")
    p.add_argument("--namespace", help="a request namespace of the server for the soak's chunks")
    p.add_argument("--s3-port", type=int, help="S3 endpoint port, when --config has none")
    p.add_argument("--settle", type=float, default=3.0, help="seconds after the load")
    p.add_argument("--json", help="summary, windows and settings as JSON")
    p.add_argument("--csv", help="one row per request (default: the --json path, .csv)")
    p.add_argument("--plot", help="PNG of TTFT and RSS over time (default: the --json path, .png)")
    p.set_defaults(func=_cmd)
