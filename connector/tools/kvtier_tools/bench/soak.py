"""`kvtier bench soak`: a mixed workload against a running server for a fixed time, watching
for what a long run would reveal: failed requests, TTFT drifting, memory, file descriptors or
S3 connections growing, the bucket holding other than the chunks saved.

The workload is experiment C's (kvtier_tools.bench.presets.MixedLoad: new prompts and continuations
of open sessions, ``--inflight`` at a time). Every ``--window`` seconds one row: requests and
errors in the window, TTFT p50/p99, and of the server's process tree (``--pid``): RSS, threads,
open file descriptors and TCP connections to the S3 endpoint's port. At the end: the RSS slope
per 1,000 requests (least squares over the windows), the growth of descriptors and connections,
and, with ``--config`` and ``--namespace`` (the requests then carry that namespace, which the
server must allow in request_namespaces), the chunks in the bucket under it against the chunks
of every prompt sent (each full chunk's chained hash, as the server keys it): none missing but
for writes the server counted as dropped or failed, none that no prompt holds. Two requests in
flight with one uncached prefix (a session's prompt and its continuation) both compute and save
it: the chunks written to S3 (/metrics) may exceed the distinct chunks the bucket holds.
Output: the table, JSON (``--json``), one CSV row per request (``--csv``), a PNG of TTFT and
RSS over time (``--plot``).
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from kvtier_tools.bench.load import (
    WARMUP_PROMPT,
    Record,
    Request,
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


def _recorded(requests: Iterable[Request], sent: list[Sequence[int]]) -> Iterator[Request]:
    """``requests``, each prompt kept in ``sent`` as it is taken (then it is sent)."""
    for request in requests:
        sent.append(request.prompt)
        yield request


_WRITE_COUNTERS = {
    "saved": ("kvtier:saved_chunks_total", {}),
    "dropped": ("kvtier:dropped_writes_total", {}),
    # Chunks the workers did not hand to the store: no save buffer in time, a failed copy.
    "save_dropped": ("kvtier:save_dropped_chunks_total", {}),
    "save_failed": ("kvtier:save_failed_chunks_total", {}),
    "s3_written": ("kvtier:tier_puts_total", {"tier": "s3"}),
    # The S3 tier's failed writes, backpressure (the dropped ones) included.
    "s3_errors": ("kvtier:tier_errors_total", {"tier": "s3"}),
}


def _write_counters(base_url: str) -> dict[str, float]:
    """The write counters from one scrape of the server's /metrics."""
    import urllib.request

    from kvtier_tools.server import metric_sum, parse_metrics

    with urllib.request.urlopen(base_url.rstrip("/") + "/metrics", timeout=10) as resp:
        samples = parse_metrics(resp.read().decode())
    return {k: metric_sum(samples, name, **labels) for k, (name, labels) in _WRITE_COUNTERS.items()}


def _settle(
    base_url: str, before: dict[str, float], limit: float, nudge: Callable[[], object]
) -> dict[str, float]:
    """The write counters since ``before``, once every chunk handed to the store has been
    written to S3 or has failed there and the counters stood still for a second, or after
    ``limit`` seconds (``settled`` 0): a busy server's last writes land after its last answer.
    vLLM reports its workers' counters with its steps, so an idle server's stand still: each
    poll first sends ``nudge`` (a prompt shorter than a chunk: nothing to save)."""
    deadline = time.monotonic() + limit
    last: dict[str, float] | None = None
    while True:
        nudge()
        now = {k: v - before[k] for k, v in _write_counters(base_url).items()}
        ended = now["s3_written"] + now["s3_errors"] >= now["saved"]
        if (ended and now == last) or time.monotonic() >= deadline:
            now["settled"] = float(ended and now == last)
            now["s3_failed"] = now["s3_errors"] - now["dropped"]
            return now
        last = now
        time.sleep(1.0)


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
    from kvtier_tools.admin.chunks import chunks_listed, count_chunks, purge_namespace

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
    sent: list[Sequence[int]] = [WARMUP_PROMPT]
    warm_up(complete)
    before = _write_counters(base)
    load = MixedLoad(Sizes(c_inflight=args.inflight, c_output=args.output_len), args.seed)
    with _Sampler(args.pid, s3_port, args.window) as sampler:
        records = run_requests(
            complete,
            _recorded(load.stream("soak"), sent),
            output_len=args.output_len,
            inflight=args.inflight,
            duration=args.duration,
            label="soak",
        )
    writes = _settle(base, before, args.settle, lambda: complete(WARMUP_PROMPT, 1))
    windows = _windows(records, sampler.samples)
    bucket: dict[str, Any] = {}
    if cfg is not None and counted:
        from kvtier.format import short_hash
        from kvtier.keys import chunk_hashes

        # Each chunk of the prompts: where it first appears (request number, chunk number).
        expected: dict[str, tuple[int, int]] = {}
        for number, prompt in enumerate(sent):
            for k, h in enumerate(chunk_hashes(prompt, cfg.chunk_size, cfg.save_unfull_chunk)):
                expected.setdefault(short_hash(h), (number, k))
        held = chunks_listed(cfg, args.namespace, "s3").get("s3", set())
        missing = sorted(expected[h] + (h,) for h in expected.keys() - held)
        bucket = {
            "bucket_chunks": count_chunks(cfg, args.namespace, "s3").get("s3", 0),
            "chunks_of_prompts": len(expected),
            "chunks_missing": len(missing),
            # The first few: request (0 is the warm-up), chunk, short hash.
            "chunks_missing_first": [list(m) for m in missing[:10]],
            "chunks_unexpected": len(held - expected.keys()),
        }
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
        "chunks_saved": writes["saved"],
        "writes_dropped": writes["dropped"],
        "s3_chunks_written": writes["s3_written"],
        "s3_write_failures": writes["s3_failed"],
        "saves_not_handed": writes["save_dropped"] + writes["save_failed"],
        "writes_settled": writes["settled"],
        **bucket,
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
        f"{s['writes_dropped']:.0f}, written to S3 {s['s3_chunks_written']:.0f}"
        + ("" if s["writes_settled"] else " (writes still in flight at the end)")
    )
    if "chunks_of_prompts" in s:
        print(
            f"bucket: {s['bucket_chunks']} chunks; of the {s['chunks_of_prompts']} chunks of the "
            f"prompts sent, {s['chunks_missing']} missing; {s['chunks_unexpected']} that no "
            "prompt holds"
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
    p.add_argument(
        "--settle", type=float, default=60.0, help="at most this long for the last writes to land"
    )
    p.add_argument("--json", help="summary, windows and settings as JSON")
    p.add_argument("--csv", help="one row per request (default: the --json path, .csv)")
    p.add_argument("--plot", help="PNG of TTFT and RSS over time (default: the --json path, .png)")
    p.set_defaults(func=_cmd)
