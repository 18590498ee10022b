"""`kvtier bench longdoc`: LMCache's long_doc_qa benchmark, against a running OpenAI-compatible
server (vLLM), with token-id prompts.

Two rounds, as in LMCache:

- cold: each of ``--documents`` documents (``--document-length`` random token ids; no two share
  a prefix) is sent once, so nothing can be cached yet;
- warm: the documents again, each ``--repeat-count`` times, in the order of ``--repeat-mode``:
  ``tile`` (d0 d1 d2 d0 d1 d2), ``interleave`` (d0 d0 d1 d1 d2 d2) or ``random`` (the tile list
  shuffled with ``--seed``). With ``--hit-miss-ratio H:M``, in every run of H+M warm requests the
  last M are replaced by new documents, never sent before (LMCache's meaning): the misses a
  cache must not make slower.

Each request streams /v1/completions (greedy, exactly ``--output-len`` tokens: vLLM's
``min_tokens``/``ignore_eos``); TTFT is the time to the first streamed token. One short
request goes first, untimed (the server's first request pays one-off costs). Up to
``--max-inflight-requests`` requests are in flight (one thread each). Output: a table per round
on stdout, a progress bar on stderr, one CSV row per request (``--csv``), the summary and every
request as JSON (``--json``), a PNG of TTFT per request with rounds and misses told apart
(``--plot``; by default next to the JSON or CSV; needs matplotlib).
"""

from __future__ import annotations

import argparse
import math
import random
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from kvtier_tools.bench.load import (
    REQUEST_ERRORS,
    ROUNDS,
    Endpoint,
    Record,
    Request,
    csv_rows,
    positive_int,
    run_requests,
    summarize,
    warm_up,
    write_csv,
    write_json,
)
from kvtier_tools.bench.plot import NO_MATPLOTLIB, pyplot, save
from kvtier_tools.bench.servers import random_tokens
from kvtier_tools.cli import add_command

MODES = ("random", "tile", "interleave")


# ---------------------------------------------------------------------------- the request plan
def repeat_order(documents: int, repeat_count: int, mode: str, seed: int) -> list[int]:
    """Document numbers of the warm round, in sending order (LMCache's ``repeat_prompts``)."""
    tiled = list(range(documents)) * repeat_count
    if mode == "tile":
        return tiled
    if mode == "interleave":
        return [d for d in range(documents) for _ in range(repeat_count)]
    if mode == "random":
        random.Random(seed).shuffle(tiled)
        return tiled
    raise ValueError(f"repeat mode must be one of {', '.join(MODES)}, got {mode!r}")


def miss_positions(count: int, hit: int, miss: int) -> list[bool]:
    """Which of ``count`` warm requests become new documents: in every run of ``hit + miss``
    requests, the last ``miss`` (LMCache's ``add_cache_misses``)."""
    return [i % (hit + miss) >= hit for i in range(count)]


def longdoc_plan(
    documents: int,
    document_length: int,
    repeat_count: int,
    mode: str,
    hit_miss: tuple[int, int] | None = None,
    seed: int = 0,
) -> tuple[list[Request], list[Request]]:
    """The cold and the warm round's requests. Documents are ``doc-N``; the misses that
    ``hit_miss`` inserts are ``new-N``, with tokens no other document starts with."""
    docs = [random_tokens(document_length, f"longdoc:{seed}:doc:{d}") for d in range(documents)]
    cold = [Request("cold", f"doc-{d}", "first", docs[d]) for d in range(documents)]
    order = repeat_order(documents, repeat_count, mode, seed)
    misses = miss_positions(len(order), *hit_miss) if hit_miss else [False] * len(order)
    warm: list[Request] = []
    new = 0
    for d, is_miss in zip(order, misses, strict=True):
        if is_miss:
            tokens = random_tokens(document_length, f"longdoc:{seed}:new:{new}")
            warm.append(Request("warm", f"new-{new}", "new", tokens))
            new += 1
        else:
            warm.append(Request("warm", f"doc-{d}", "repeat", docs[d]))
    return cold, warm


def longdoc_report(settings: Mapping[str, Any], records: Sequence[Record]) -> dict[str, Any]:
    """Settings, a summary per round and per kind of warm request, the TTFT gain of the
    repeated documents, and every request."""
    rounds = {name: summarize([r for r in records if r.round == name]) for name in ROUNDS}
    warm_by_kind = {
        kind: summarize([r for r in records if r.round == "warm" and r.kind == kind])
        for kind in ("repeat", "new")
        if any(r.round == "warm" and r.kind == kind for r in records)
    }
    repeat = warm_by_kind.get("repeat", {}).get("ttft_mean_s", math.nan)
    return {
        "settings": dict(settings),
        "rounds": rounds,
        "warm_by_kind": warm_by_kind,
        "ttft_gain_cold_over_warm_repeat": rounds["cold"]["ttft_mean_s"] / repeat
        if repeat
        else math.nan,
        "requests": [r.row() for r in records],
    }


def format_table(report: Mapping[str, Any]) -> str:
    lines = [
        "| round | requests | failed | TTFT mean (s) | p50 | p99 | time (s) | tokens/s "
        "| output tokens/s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    rows = [(name, report["rounds"][name]) for name in ROUNDS]
    rows += [(f"warm, {kind} docs", s) for kind, s in report["warm_by_kind"].items()]
    for name, s in rows:
        lines.append(
            f"| {name} | {s['requests']} | {s['failed']} | {s['ttft_mean_s']:.3f} "
            f"| {s['ttft_p50_s']:.3f} | {s['ttft_p99_s']:.3f} | {s['time_s']:.2f} "
            f"| {s['tokens_per_s']:.0f} | {s['output_tokens_per_s']:.1f} |"
        )
    gain = report["ttft_gain_cold_over_warm_repeat"]
    lines.append(f"\nTTFT gain, cold mean / warm repeated-document mean: {gain:.2f}x")
    return "\n".join(lines)


def plot_requests(records: Sequence[Record], path: str, title: str) -> str | None:
    """TTFT of every request in sending order: cold round, warm repeats and warm misses in
    their own colours, the rounds split by a line. None when matplotlib is not installed."""
    plt = pyplot()
    if plt is None:
        return None
    fig, ax = plt.subplots(figsize=(9, 4.5))
    groups = (
        ("cold", "first", "cold round (first time)", "o", "tab:blue"),
        ("warm", "repeat", "warm round, repeated document", "o", "tab:orange"),
        ("warm", "new", "warm round, new document (miss)", "x", "tab:red"),
    )
    ordered = [r for name in ROUNDS for r in records if r.round == name]
    for round_name, kind, label, marker, colour in groups:
        points = [
            (i, r.ttft)
            for i, r in enumerate(ordered)
            if r.round == round_name and r.kind == kind and not r.error
        ]
        if points:
            xs, ys = zip(*points, strict=True)
            ax.scatter(xs, ys, label=label, marker=marker, color=colour, s=22)
    cold_count = sum(r.round == "cold" for r in ordered)
    ax.axvline(cold_count - 0.5, color="grey", linestyle=":", linewidth=1)
    ax.set_xlabel("request, in sending order")
    ax.set_ylabel("TTFT (s)")
    ax.set_ylim(bottom=0)
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    return save(plt, fig, path)


# -------------------------------------------------------------------------------------- CLI
def hit_miss_ratio(text: str) -> tuple[int, int]:
    """argparse type: ``HIT:MISS``, whole numbers, not both 0 (``4:1``: one new document
    after every four repeated ones)."""
    hit, sep, miss = text.partition(":")
    if sep and hit.strip().isdigit() and miss.strip().isdigit() and int(hit) + int(miss) > 0:
        return int(hit), int(miss)
    raise argparse.ArgumentTypeError(
        f"pass HIT:MISS as two whole numbers, e.g. 4:1 (after every 4 repeated documents "
        f"1 new one), got {text!r}"
    )


def _cmd(args: argparse.Namespace) -> int:
    api_key = Path(args.api_key_file).read_text().strip() if args.api_key_file else None
    endpoint = Endpoint(args.base_url, args.model, api_key, args.timeout)
    cold, warm = longdoc_plan(
        args.documents,
        args.document_length,
        args.repeat_count,
        args.repeat_mode,
        args.hit_miss_ratio,
        args.seed,
    )
    try:
        warm_up(endpoint.complete)
    except REQUEST_ERRORS as exc:
        print(f"the server did not answer the warm-up request: {exc}", file=sys.stderr)
        return 1
    records: list[Record] = []
    for name, requests in (("cold", cold), ("warm", warm)):
        records += run_requests(
            endpoint.complete,
            requests,
            output_len=args.output_len,
            inflight=args.max_inflight_requests,
            label=f"{name} round",
            total=len(requests),
        )
    settings = {k: v for k, v in vars(args).items() if k != "func" and not k.endswith("command")}
    settings["hit_miss_ratio"] = ":".join(map(str, args.hit_miss_ratio or ())) or None
    report = longdoc_report(settings, records)
    print(format_table(report))
    csv_path = args.csv or (str(Path(args.json).with_suffix(".csv")) if args.json else None)
    if csv_path:
        write_csv(csv_path, csv_rows(records))
        print(f"CSV: {csv_path}")
    if args.json:
        write_json(args.json, report)
        print(f"JSON: {args.json}")
    png_path = args.plot or (str(Path(csv_path).with_suffix(".png")) if csv_path else None)
    if png_path is None:
        print("plot: none written (pass --plot, --csv or --json)")
    else:
        title = (
            f"long-document QA: {args.documents} docs x {args.document_length} tokens, "
            f"repeat {args.repeat_count} ({args.repeat_mode}), hit:miss "
            f"{settings['hit_miss_ratio'] or 'none'}, {args.max_inflight_requests} in flight"
        )
        png = plot_requests(records, png_path, title)
        print(f"plot: {png}" if png else NO_MATPLOTLIB)
    failed = [r for r in records if r.error]
    if failed:
        print(f"{len(failed)} of {len(records)} requests failed; first: {failed[0].error}")
        return 1
    return 0


def register(subparsers: Any) -> None:
    """Add `longdoc` to `kvtier bench`."""
    summary = "LMCache's long_doc_qa against a running server: cold round, then repeats"
    p = add_command(subparsers, "longdoc", summary, __doc__)
    p.add_argument("--base-url", required=True, help="e.g. http://127.0.0.1:8000")
    p.add_argument("--model", required=True, help="the served model name")
    p.add_argument("--api-key-file", help="file holding the API key (sent as a bearer token)")
    p.add_argument("--documents", "--num-documents", type=positive_int, default=8)
    p.add_argument("--document-length", type=positive_int, default=4096, help="tokens")
    p.add_argument("--output-len", type=positive_int, default=32, help="tokens per answer")
    p.add_argument(
        "--repeat-count", type=positive_int, default=2, help="sends per document, warm round"
    )
    p.add_argument("--repeat-mode", choices=MODES, default="random")
    p.add_argument("--seed", "--shuffle-seed", type=int, default=0, help="documents and shuffle")
    p.add_argument("--max-inflight-requests", type=positive_int, default=2)
    p.add_argument(
        "--hit-miss-ratio",
        type=hit_miss_ratio,
        help="HIT:MISS, e.g. 4:1: in the warm round, 1 new document after every 4 repeated",
    )
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per request")
    p.add_argument("--csv", help="one row per request (default: the --json path, .csv)")
    p.add_argument("--json", help="summary and every request as JSON")
    p.add_argument("--plot", help="PNG of TTFT per request (default: the CSV path, .png)")
    p.set_defaults(func=_cmd)
