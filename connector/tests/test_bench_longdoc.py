"""`kvtier bench longdoc` and the workloads of `kvtier bench compare`, without vLLM: the request
plans, the load generator against a fake completion function or a fake streaming server, the
files written, the tables and plots. The runs against real vLLM servers are the e2e smoke test
(e2e/test_bench_longdoc_smoke.py) and docs/benchmarks.md."""

from __future__ import annotations

import csv
import http.server
import itertools
import json
import math
import socket
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any, ClassVar

import pytest
from _helpers import send_completion_stream

from kvtier_tools.bench import compare_report, longdoc
from kvtier_tools.bench import load as load_module
from kvtier_tools.bench.compare_sweep import kv_bytes_per_token, working_set_chunks
from kvtier_tools.bench.load import (
    CSV_FIELDS,
    Record,
    Request,
    csv_rows,
    percentile,
    run_requests,
    summarize,
    write_csv,
    write_json,
)
from kvtier_tools.bench.longdoc import longdoc_plan, repeat_order
from kvtier_tools.bench.presets import (
    SMOKE,
    Conversation,
    MixedLoad,
    Sizes,
    make_presets,
    next_turn,
)
from kvtier_tools.bench.rounds import cache_counters
from kvtier_tools.cli import main as cli_main
from kvtier_tools.completions import Completion, CompletionError, stream_completion
from kvtier_tools.server import ServerError, VllmServer, parse_metrics

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _fake_complete(answer_len: int = 4) -> tuple[list[list[int]], Any]:
    """A completion function that records the prompts it got and answers ``answer_len`` token
    ids derived from the prompt's length (so each answer is known to the test)."""
    seen: list[list[int]] = []

    def complete(prompt: Sequence[int], max_tokens: int) -> Completion:
        seen.append(list(prompt))
        ids = [len(prompt) % 1000 + i for i in range(min(answer_len, max_tokens))]
        return Completion(ids, "x" * len(ids), 0.01, 0.02, len(prompt))

    return seen, complete


# ------------------------------------------------------------------------- request plans
def test_repeat_modes_give_lmcache_orders() -> None:
    assert repeat_order(3, 2, "tile", seed=0) == [0, 1, 2, 0, 1, 2]
    assert repeat_order(3, 2, "interleave", seed=0) == [0, 0, 1, 1, 2, 2]
    shuffled = repeat_order(10, 3, "random", seed=1)
    assert sorted(shuffled) == sorted(repeat_order(10, 3, "tile", seed=1))
    assert shuffled != repeat_order(10, 3, "tile", seed=1)
    assert shuffled == repeat_order(10, 3, "random", seed=1)  # the seed fixes the order
    assert shuffled != repeat_order(10, 3, "random", seed=2)
    with pytest.raises(ValueError, match="random, tile, interleave"):
        repeat_order(3, 2, "zigzag", seed=0)


def test_plan_cold_round_sends_each_document_once_and_warm_repeats_them() -> None:
    cold, warm = longdoc_plan(3, 300, 2, "interleave", seed=0)
    assert [(r.round, r.doc, r.kind) for r in cold] == [
        ("cold", "doc-0", "first"),
        ("cold", "doc-1", "first"),
        ("cold", "doc-2", "first"),
    ]
    assert [r.doc for r in warm] == ["doc-0", "doc-0", "doc-1", "doc-1", "doc-2", "doc-2"]
    by_doc = {r.doc: r.prompt for r in cold}
    assert all(r.kind == "repeat" and r.prompt == by_doc[r.doc] for r in warm)
    assert all(len(r.prompt) == 300 for r in cold + warm)
    firsts = {tuple(p[:8]) for p in by_doc.values()}
    assert len(firsts) == 3  # no two documents share a prefix


def test_hit_miss_ratio_replaces_the_right_share_with_new_documents() -> None:
    cold, warm = longdoc_plan(5, 256, 2, "tile", hit_miss=(4, 1), seed=0)
    assert [r.kind for r in warm] == ["repeat"] * 4 + ["new"] + ["repeat"] * 4 + ["new"]
    new = [r for r in warm if r.kind == "new"]
    assert [r.doc for r in new] == ["new-0", "new-1"]
    starts = {tuple(r.prompt[:8]) for r in cold} | {tuple(r.prompt[:8]) for r in new}
    assert len(starts) == 7  # the new documents share no prefix with any other
    _, warm = longdoc_plan(4, 64, 3, "random", hit_miss=(3, 1), seed=3)
    assert sum(r.kind == "new" for r in warm) == len(warm) // 4
    _, warm = longdoc_plan(2, 64, 2, "tile", hit_miss=(0, 1), seed=0)
    assert all(r.kind == "new" for r in warm)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--documents", "0"],
            "argument --documents/--num-documents: pass a whole number >= 1 (e.g. 4), got '0'",
        ),
        (["--document-length", "many"], "argument --document-length: pass a whole number >= 1"),
        (["--hit-miss-ratio", "4-1"], "argument --hit-miss-ratio: pass HIT:MISS as two whole"),
        (["--hit-miss-ratio", "0:0"], "e.g. 4:1 (after every 4 repeated documents 1 new one)"),
        (["--repeat-mode", "zigzag"], "argument --repeat-mode: invalid choice: 'zigzag' (choose"),
        (["--max-inflight-requests", "-2"], "argument --max-inflight-requests: pass a whole"),
    ],
)
def test_bad_arguments_say_what_to_pass(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        cli_main(["bench", "longdoc", "--base-url", "http://x", "--model", "m", *args])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_conversation_turns_extend_the_previous_prompt_with_answer_and_user_tokens() -> None:
    sizes = Sizes(b_first_tokens=300, b_user_tokens=50, b_turns=4, b_output=4)
    seen, complete = _fake_complete()
    conversation = Conversation(sizes, seed=0)
    records = conversation.run("cold", complete)
    assert [r.doc for r in records] == ["turn-1", "turn-2", "turn-3", "turn-4"]
    assert seen == conversation.sent
    for turn, (before, after) in enumerate(itertools.pairwise(seen[:4]), start=1):
        answer = list(records[turn - 1].output_ids)
        assert after == next_turn(before, answer, conversation.user[turn])
        assert after[: len(before)] == before and len(after) == len(before) + 4 + 50
    replay = conversation.run("warm", complete)
    assert [r.kind for r in replay] == ["repeat"] * 4
    assert seen[4:] == seen[:4]  # the warm round replays the same prompts


def test_mixed_load_is_20_percent_new_prompts_and_continuations_that_extend_a_prompt() -> None:
    sizes = Sizes(c_new_tokens=512, c_turn_tokens=64, c_max_tokens=1024)
    stream = MixedLoad(sizes, seed=0).stream("warm")
    requests = [next(stream) for _ in range(2000)]
    new = [r for r in requests if r.kind == "first"]
    assert 0.17 < len(new) / len(requests) < 0.25  # 20 %, plus sessions that reached the cap
    last: dict[str, Sequence[int]] = {}
    for r in requests:
        assert len(r.prompt) <= sizes.c_max_tokens
        if r.kind == "continuation":
            previous = last[r.doc]
            assert list(r.prompt[: len(previous)]) == list(previous)
            assert len(r.prompt) == len(previous) + sizes.c_turn_tokens
        last[r.doc] = r.prompt
    again = MixedLoad(sizes, seed=0).stream("warm")
    assert all(next(again).prompt == r.prompt for r in requests[:50])  # reproducible


def test_presets_never_share_a_prefix() -> None:
    presets = make_presets(["A", "B", "C", "D"], SMOKE, seed=0)
    seen, complete = _fake_complete()
    for preset in presets.values():
        if preset.key != "C":
            preset.run("cold", complete)
    seen.append(list(next(MixedLoad(SMOKE, seed=0).stream("cold")).prompt))
    assert len({tuple(p[:16]) for p in seen}) == len(seen) - (SMOKE.b_turns - 1)


# ------------------------------------------------------------------------- load generator
def test_run_requests_keeps_the_inflight_limit_order_and_records_failures() -> None:
    lock, running, peak = threading.Lock(), [0], [0]

    def complete(prompt: Sequence[int], max_tokens: int) -> Completion:
        with lock:
            running[0] += 1
            peak[0] = max(peak[0], running[0])
        time.sleep(0.02)
        with lock:
            running[0] -= 1
        if prompt[0] == 3:
            raise CompletionError("completion failed: HTTP 500")
        return Completion([1] * max_tokens, "", 0.01, 0.02, len(prompt))

    requests = [Request("warm", f"doc-{i}", "repeat", [i, 0, 0]) for i in range(10)]
    records = run_requests(complete, requests, output_len=2, inflight=3, label="t", total=10)
    assert peak[0] == 3
    assert [r.doc for r in records] == [f"doc-{i}" for i in range(10)]
    failed = [r for r in records if r.error]
    assert [r.doc for r in failed] == ["doc-3"] and "HTTP 500" in failed[0].error
    assert math.isnan(failed[0].ttft)
    assert summarize(records)["failed"] == 1


def test_run_requests_with_a_duration_stops_an_endless_stream(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """On the loop's own clock (each request takes 0.05 s of it): requests are sent until the
    0.3 s are over, those in flight finish, and nothing is sent after."""
    clock = [0.0]
    lock = threading.Lock()
    monkeypatch.setattr(load_module, "time", SimpleNamespace(perf_counter=lambda: clock[0]))

    def slow(prompt: Sequence[int], max_tokens: int) -> Completion:
        with lock:
            clock[0] += 0.05
        return Completion([1], "", 0.01, 0.05, len(prompt))

    def endless() -> Iterator[Request]:
        while True:
            yield Request("warm", "d", "repeat", [1])

    records = run_requests(slow, endless(), output_len=1, inflight=2, duration=0.3, label="C")
    # 6 requests fill the 0.3 s; the other thread may have taken one more before the end.
    assert 6 <= len(records) <= 7
    assert "s, " in capsys.readouterr().err  # the progress bar shows seconds for timed rounds


def test_percentiles_and_summary() -> None:
    values = [float(v) for v in range(1, 101)]
    assert (percentile(values, 50), percentile(values, 99), percentile([2.0], 99)) == (
        50.0,
        99.0,
        2.0,
    )
    assert math.isnan(percentile([], 50))
    records = [
        Record(
            "cold",
            i,
            f"doc-{i}",
            "first",
            1000,
            start=i * 1.0,
            ttft=0.5,
            latency=1.0,
            output_tokens=10,
        )
        for i in range(4)
    ]
    s = summarize(records)
    assert s["time_s"] == 4.0 and s["ttft_p50_s"] == 0.5
    assert s["tokens_per_s"] == 4 * 1010 / 4.0 and s["output_tokens_per_s"] == 10.0


# ---------------------------------------------------------------------- files and plots
def _records() -> list[Record]:
    cold, warm = longdoc_plan(3, 64, 2, "tile", hit_miss=(2, 1), seed=0)
    out = []
    for i, r in enumerate(cold + warm):
        ttft = 0.8 if r.kind != "repeat" else 0.1
        out.append(Record(r.round, i, r.doc, r.kind, 64, i * 1.0, ttft, ttft + 0.5, 32))
    return out


def test_csv_and_json_hold_one_row_per_request_and_the_summary(tmp_path: Path) -> None:
    records = _records()
    write_csv(str(tmp_path / "r.csv"), csv_rows(records, scenario="s1"))
    with (tmp_path / "r.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0]) == ["scenario", *CSV_FIELDS]
    assert [(r["round"], r["doc"], r["kind"]) for r in rows[:4]] == [
        ("cold", "doc-0", "first"),
        ("cold", "doc-1", "first"),
        ("cold", "doc-2", "first"),
        ("warm", "doc-0", "repeat"),
    ]
    assert len(rows) == 9 and rows[5]["kind"] == "new" and float(rows[5]["ttft_s"]) == 0.8
    report = longdoc.longdoc_report({"documents": 3}, records)
    report["rounds"]["warm"]["ttft_p99_s"] = math.nan  # written as null, still valid JSON
    write_json(str(tmp_path / "r.json"), report)
    data = json.loads((tmp_path / "r.json").read_text())
    assert data["rounds"]["cold"]["requests"] == 3 and data["rounds"]["warm"]["requests"] == 6
    assert data["warm_by_kind"]["new"]["requests"] == 2
    assert data["rounds"]["warm"]["ttft_p99_s"] is None
    assert data["ttft_gain_cold_over_warm_repeat"] == pytest.approx(8.0)
    assert len(data["requests"]) == 9
    table = longdoc.format_table(report)
    assert "| warm, new docs | 2 | 0 |" in table and "8.00x" in table


def test_longdoc_plot_writes_a_png_or_nothing_without_matplotlib(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "ld.png"
    monkeypatch.setattr(longdoc, "pyplot", lambda: None)
    assert longdoc.plot_requests(_records(), str(path), "t") is None
    assert not path.exists()
    monkeypatch.undo()
    pytest.importorskip("matplotlib")
    assert longdoc.plot_requests(_records(), str(path), "t") == str(path)
    assert path.read_bytes()[:8] == PNG_MAGIC


def _compare_report() -> dict[str, Any]:
    def rnd(ttft: float, hit: float) -> dict[str, Any]:
        return {
            "requests": 3,
            "failed": 0,
            "ttft_p50_s": ttft,
            "ttft_p99_s": 2 * ttft,
            "latency_mean_s": ttft + 1,
            "requests_per_s": 2.0,
            "tokens_per_s": 5000.0,
            "hit_rate": hit,
            "ttft_per_request_s": [ttft, ttft / 2, ttft / 3],
        }

    scenario = {"presets": {k: {"cold": rnd(0.6, 0.0), "warm": rnd(0.06, 0.95)} for k in "ABCD"}}
    rows = [
        {
            "cpu_share": s,
            "cpu_mib": 90 * s,
            "disk": d,
            "loadavg_after": [1.5, 1.0, 1.0],
            **rnd(0.1 / s, s if not d else 0.97),
        }
        for d in (False, True)
        for s in (1.0, 0.5, 0.25, 0.1)
    ]
    return {
        "sizes": vars(Sizes()),
        "presets": ["A", "B", "C", "D"],
        "scenarios": {
            "vllm-prefix": {"label": "vLLM prefix cache", **scenario},
            "example": {"label": "ExampleConnector", "presets": {}, "error": "vLLM exited with 1"},
        },
        "sweep": {
            "requests": 150,
            "working_set_chunks": 360,
            "working_set_mib": 90.0,
            "rows": rows,
        },
    }


def test_compare_tables_name_every_preset_and_a_failed_scenario() -> None:
    text = compare_report.format_tables(_compare_report())
    for title in ("A: one long prompt", "B: conversation", "C: mixed load", "D: short prompt"):
        assert title in text
    assert "| vLLM prefix cache | 0.600 | 0.060 | 0.060 | 0.100 | 95% |" in text
    assert "| ExampleConnector | n/a | n/a | n/a | n/a | n/a |" in text
    assert "(example failed: vLLM exited with 1)" in text
    assert "| 25% (22 MiB) | off | 25% |" in text
    assert "| 25% (22 MiB) | 2x working set | 97% |" in text
    assert text.count("| 0 | 1.5 |") == 8  # failed, then the 1-minute load after each size


def test_compare_plots_one_png_per_preset(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    report = _compare_report()
    for key in "ABCD":
        path = tmp_path / f"bench-compare-{key}.png"
        assert compare_report.plot_preset(report, key, str(path)) == str(path)
        assert path.read_bytes()[:8] == PNG_MAGIC


# ----------------------------------------------------------------- compare's measurements
def test_working_set_counts_each_shared_full_chunk_once() -> None:
    base = list(range(512))
    assert working_set_chunks([base, [*base, *range(1000, 1256)], base[:300]], chunk=256) == 3
    assert working_set_chunks([list(range(9, 521))], chunk=256) == 2  # other tokens, other keys


def test_kv_bytes_per_token_of_the_tiny_model_shape(tmp_path: Path) -> None:
    config = {
        "num_hidden_layers": 2,
        "hidden_size": 256,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "torch_dtype": "bfloat16",
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert kv_bytes_per_token(str(tmp_path)) == 2 * 2 * 2 * 64 * 2
    assert kv_bytes_per_token(str(tmp_path / "missing")) is None


def test_hit_rate_counts_vllm_and_connector_hits_over_prompt_tokens() -> None:
    before = parse_metrics('vllm:prompt_tokens_total{engine="0"} 1000.0\n')
    after = parse_metrics(
        'vllm:prompt_tokens_total{engine="0"} 5000.0\n'
        'vllm:prefix_cache_hits_total{engine="0"} 1000.0\n'
        'vllm:external_prefix_cache_hits_total{engine="0"} 2000.0\n'
        'kvtier:tier_hits_total{engine="0",tier="disk"} 8.0\n'
    )
    counters = cache_counters(before, after)
    assert counters["hit_rate"] == 0.75 and counters["kvtier_disk_hit_chunks"] == 8.0
    assert math.isnan(cache_counters(after, after)["hit_rate"])


# ------------------------------------------------- the command against a streaming server
class _FakeServer(http.server.BaseHTTPRequestHandler):
    """Streams ``max_tokens`` tokens; a prompt it has seen before answers at once, a new one
    after 50 ms (a cache, as far as TTFT goes). Requires the bearer token ``secret``."""

    seen: ClassVar[set[tuple[int, ...]]] = set()

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.headers.get("Authorization") != "Bearer secret":
            self.send_response(401)
            self.end_headers()
            return
        prompt = tuple(body["prompt"])
        if prompt not in self.seen:
            time.sleep(0.05)
            self.seen.add(prompt)
        send_completion_stream(self, range(body["max_tokens"]), len(prompt), text="a")

    def log_message(self, *args: Any) -> None:
        pass  # keep pytest's output clean


def test_longdoc_command_against_a_streaming_server(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _FakeServer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    (tmp_path / "key").write_text("secret\n")
    try:
        status = cli_main(
            [
                "bench", "longdoc", "--base-url", f"http://127.0.0.1:{server.server_port}/v1",
                "--model", "m", "--api-key-file", str(tmp_path / "key"), "--documents", "3",
                "--document-length", "100", "--output-len", "4", "--repeat-count", "2",
                "--hit-miss-ratio", "2:1", "--max-inflight-requests", "2",
                "--json", str(tmp_path / "ld.json"),
            ]
        )  # fmt: skip
    finally:
        server.shutdown()
    out = capsys.readouterr()
    assert status == 0, out
    assert "[##############################] 6/6 warm round" in out.err
    rows = list(csv.DictReader((tmp_path / "ld.csv").open()))
    assert [r["round"] for r in rows] == ["cold"] * 3 + ["warm"] * 6
    assert {r["output_tokens"] for r in rows} == {"4"} and {r["prompt_tokens"] for r in rows} == {
        "100"
    }
    data = json.loads((tmp_path / "ld.json").read_text())
    assert data["settings"]["hit_miss_ratio"] == "2:1"
    assert data["warm_by_kind"]["repeat"]["ttft_mean_s"] < data["rounds"]["cold"]["ttft_mean_s"]
    assert f"CSV: {tmp_path / 'ld.csv'}" in out.out


def test_longdoc_command_says_when_the_server_does_not_answer(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with socket.socket() as s:  # a port nothing listens on: bound, never accepted
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}"
        assert cli_main(["bench", "longdoc", "--base-url", url, "--model", "m"]) == 1
    assert "the server did not answer the warm-up request" in capsys.readouterr().err


def test_compare_refuses_the_s3_scenario_without_its_config(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert cli_main(["bench", "compare", "--scenarios", "kvtier-s3"]) == 2
    assert "--scenarios kvtier-s3 needs --s3-config" in capsys.readouterr().err


def test_a_server_is_not_started_on_a_port_in_use(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        server = VllmServer(model="m", port=port, log_path=tmp_path / "log", python="false")
        with pytest.raises(ServerError, match=f"port {port} is already in use"):
            server.start()


@pytest.mark.parametrize(
    ("answer", "message"),
    [
        (b"NOT-HTTP\r\n\r\n", "unreachable"),  # http.client.BadStatusLine
        (
            b"HTTP/1.1 200 OK\r\nContent-Length: 40\r\n\r\ndata: {not json\n\n",
            "broke off|malformed",
        ),
    ],
)
def test_a_broken_server_is_one_completion_error(answer: bytes, message: str) -> None:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()

        def serve() -> None:
            conn, _ = listener.accept()
            with conn:
                conn.recv(65536)
                conn.sendall(answer)

        threading.Thread(target=serve, daemon=True).start()
        url = f"http://127.0.0.1:{listener.getsockname()[1]}"
        with pytest.raises(CompletionError, match=message):
            stream_completion(url, "m", [1, 2, 3], 4, timeout=5)
