"""Sending benchmark requests to an OpenAI-compatible server and measuring them: the load
generator that `kvtier bench longdoc` and `kvtier bench compare` share.

Requests stream /v1/completions with token-id prompts (:mod:`kvtier_tools.completions`); TTFT is the
time to the first streamed token. :func:`run_requests` keeps up to N in flight (one thread
each), optionally for a fixed duration, draws a progress bar on stderr and records failures
instead of raising, so that a broken server shows up in the results, not as a lost run.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvtier_tools.bench.servers import random_tokens
from kvtier_tools.completions import Completion, CompletionError, stream_completion
from kvtier_tools.server import ServerError

#: Every benchmark has a cold round (nothing cached yet) and a warm round (repeats).
ROUNDS = ("cold", "warm")
#: One column per field of :class:`Record` that a reader of the CSV needs (not the token ids).
CSV_FIELDS = (
    "round",
    "index",
    "doc",
    "kind",
    "prompt_tokens",
    "start_s",
    "ttft_s",
    "latency_s",
    "output_tokens",
    "error",
)
#: What a failed request can raise: it is recorded (``Record.error``), the run goes on.
#: ``stream_completion`` turns every network, HTTP and stream error into CompletionError;
#: ``VllmServer.complete`` re-raises it as ServerError.
REQUEST_ERRORS = (CompletionError, ServerError)

#: ``complete(prompt_token_ids, max_tokens)``: :meth:`Endpoint.complete` or
#: ``VllmServer.complete``.
CompleteFn = Callable[[Sequence[int], int], Completion]
#: Sent before timing (LMCache's pre-warm-up): a server's first request pays one-off costs.
#: Shorter than a KV chunk, so it never creates a hit.
WARMUP_PROMPT: tuple[int, ...] = tuple(random_tokens(64, "warm-up"))


def warm_up(complete: CompleteFn) -> None:
    complete(WARMUP_PROMPT, 4)


@dataclass(frozen=True)
class Request:
    """One request to send."""

    round: str
    doc: str
    #: ``first`` (never sent before), ``repeat`` (sent before: a cache can answer it), ``new``
    #: (first sent in the warm round: a miss) or ``continuation`` (an earlier prompt plus new
    #: tokens: its prefix can be answered from a cache).
    kind: str
    prompt: Sequence[int] = field(repr=False)


@dataclass(frozen=True)
class Record:
    """What one request measured. Seconds; ``start`` counts from the start of its round."""

    round: str
    index: int
    doc: str
    kind: str
    prompt_tokens: int
    start: float
    ttft: float
    latency: float
    output_tokens: int
    error: str = ""
    #: The generated tokens (the next turn of a conversation appends them); not in the CSV.
    output_ids: tuple[int, ...] = field(default=(), repr=False)

    def row(self) -> dict[str, Any]:
        return {
            "round": self.round,
            "index": self.index,
            "doc": self.doc,
            "kind": self.kind,
            "prompt_tokens": self.prompt_tokens,
            "start_s": round(self.start, 4),
            "ttft_s": round(self.ttft, 4),
            "latency_s": round(self.latency, 4),
            "output_tokens": self.output_tokens,
            "error": self.error,
        }


@dataclass(frozen=True)
class Endpoint:
    """An OpenAI-compatible server. ``base_url`` without ``/v1`` (a trailing one is dropped)."""

    base_url: str
    model: str
    api_key: str | None = None
    timeout: float = 300.0

    def complete(self, prompt: Sequence[int], max_tokens: int) -> Completion:
        url = self.base_url.rstrip("/").removesuffix("/v1")
        return stream_completion(
            url, self.model, prompt, max_tokens, api_key=self.api_key, timeout=self.timeout
        )


class Progress:
    """One line on stderr, redrawn in place: ``[#####.....] 12/40 warm`` or, for a timed
    round, the seconds elapsed of the duration and the requests done."""

    width = 30

    def __init__(self, label: str, total: int | None = None, duration: float | None = None):
        self.label, self.total, self.duration = label, total, duration

    def update(self, done: int, elapsed: float) -> None:
        if self.duration:
            share = elapsed / self.duration
            count = f"{elapsed:.1f}/{self.duration:g} s, {done} done,"
        else:
            share, count = done / (self.total or 1), f"{done}/{self.total}"
        filled = min(self.width, int(share * self.width))
        bar = "#" * filled + "." * (self.width - filled)
        sys.stderr.write(f"\r[{bar}] {count} {self.label}")
        sys.stderr.flush()

    def close(self) -> None:
        sys.stderr.write("\n")
        sys.stderr.flush()


def run_requests(
    complete: CompleteFn,
    requests: Iterable[Request],
    *,
    output_len: int,
    inflight: int = 1,
    duration: float | None = None,
    label: str = "",
    total: int | None = None,
    on_record: Callable[[Record], None] | None = None,
) -> list[Record]:
    """Send ``requests`` in order with at most ``inflight`` at a time; with ``duration``, stop
    sending when it is over (``requests`` may then be endless) and let those in flight finish.
    Records come back in sending order; a failed request is recorded with its error.

    ``on_record`` sees each record before the next request is taken from ``requests``: with
    ``inflight=1`` a generator can build a request from the previous answer (a conversation)."""
    source = iter(requests)
    lock = threading.Lock()
    records: list[Record] = []
    issued = 0
    bar = Progress(label, total=total, duration=duration)
    begin = time.perf_counter()

    def take() -> tuple[int, Request] | None:
        nonlocal issued
        with lock:  # generators are not thread-safe: one next() at a time, in order
            if duration is not None and time.perf_counter() - begin >= duration:
                return None
            request = next(source, None)
            if request is None:
                return None
            issued += 1
            return issued - 1, request

    def worker() -> None:
        while (item := take()) is not None:
            record = _send(complete, *item, output_len, begin)
            with lock:
                records.append(record)
                if on_record is not None:
                    on_record(record)
                bar.update(len(records), time.perf_counter() - begin)

    threads = [threading.Thread(target=worker, daemon=True) for _ in range(max(1, inflight))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    bar.close()
    return sorted(records, key=lambda r: r.index)


def _send(
    complete: CompleteFn, index: int, request: Request, output_len: int, begin: float
) -> Record:
    """Send one request; what it measured, or the error it failed with."""
    sent = time.perf_counter()

    def record(**measured: Any) -> Record:
        return Record(request.round, index, request.doc, request.kind, **measured)

    try:
        done = complete(request.prompt, output_len)
    except REQUEST_ERRORS as exc:
        failed = time.perf_counter()
        return record(
            prompt_tokens=len(request.prompt),
            start=sent - begin,
            ttft=math.nan,
            latency=failed - sent,
            output_tokens=0,
            error=str(exc)[:500],
        )
    return record(
        prompt_tokens=done.prompt_tokens or len(request.prompt),
        start=sent - begin,
        ttft=done.ttft,
        latency=done.total,
        output_tokens=len(done.token_ids),
        output_ids=tuple(done.token_ids),
    )


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (an observed value, also for few samples); NaN when empty."""
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def summarize(records: Sequence[Record]) -> dict[str, Any]:
    """TTFT mean/p50/p99 of the successful requests, the span from the first start to the last
    end, and throughput over that span (prompt + output tokens, and output tokens alone)."""
    ok = [r for r in records if not r.error]
    ttfts = [r.ttft for r in ok]
    span = max((r.start + r.latency for r in records), default=0.0) - min(
        (r.start for r in records), default=0.0
    )
    prompt_tokens = sum(r.prompt_tokens for r in ok)
    output_tokens = sum(r.output_tokens for r in ok)

    def per_s(x: float) -> float:
        return x / span if span > 0 else math.nan

    return {
        "requests": len(records),
        "failed": len(records) - len(ok),
        "ttft_mean_s": sum(ttfts) / len(ttfts) if ttfts else math.nan,
        "ttft_p50_s": percentile(ttfts, 50),
        "ttft_p99_s": percentile(ttfts, 99),
        "latency_mean_s": sum(r.latency for r in ok) / len(ok) if ok else math.nan,
        "time_s": span,
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "requests_per_s": per_s(len(ok)),
        "tokens_per_s": per_s(prompt_tokens + output_tokens),
        "output_tokens_per_s": per_s(output_tokens),
    }


def csv_rows(records: Iterable[Record], **context: str) -> list[dict[str, Any]]:
    """CSV rows of ``records``, each prefixed with the ``context`` columns (e.g. scenario)."""
    return [{**context, **r.row()} for r in records]


def write_csv(path: str, rows: Sequence[Mapping[str, Any]]) -> None:
    fields = list(rows[0]) if rows else list(CSV_FIELDS)
    with open(path, "w", newline="") as out:
        writer = csv.DictWriter(out, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)


def write_json(path: str, report: Mapping[str, Any]) -> None:
    """``report`` as JSON; NaN (a round without successful requests) is written as null."""
    Path(path).write_text(json.dumps(_no_nan(report), indent=2) + "\n")


def _no_nan(value: Any) -> Any:
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, Mapping):
        return {k: _no_nan(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_no_nan(v) for v in value]
    return value


def positive_int(text: str) -> int:
    """argparse type: a whole number >= 1."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"pass a whole number >= 1 (e.g. 4), got {text!r}")
    return value
