"""`kvtier verify-fleet`: every check fails when what it checks goes wrong on a peer, naming the
step, the expected and the measured value; the peers' keys come from the environment.

As in test_verify_checks.py, small HTTP servers play vLLM (one prefill host, one peer) so that
faults can be injected, and the bucket listing is a stand-in; the passing path on real hosts,
RGW and vLLM is the fleet scenario (molecule/fleet)."""

from __future__ import annotations

import http.server
import json
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from _helpers import send_completion_stream

from kvtier.config import load_config
from kvtier_tools.cli import main
from kvtier_tools.verify.checks import Step
from kvtier_tools.verify.fleet import FleetSettings, Peer, run
from kvtier_tools.verify.report import first_failure

DOCS, DOC_TOKENS, CHUNK = 2, 512, 256


class _Server(http.server.BaseHTTPRequestHandler):
    """One vLLM stand-in; ``role`` (prefill or peer) and ``fault`` live on the server object."""

    def log_message(self, *args: Any) -> None:
        pass

    def do_GET(self) -> None:
        counters: dict[str, float] = self.server.counters  # type: ignore[attr-defined]
        text = "".join(f"{k} {v}\n" for k, v in counters.items()).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(text)))
        self.end_headers()
        self.wfile.write(text)

    def do_POST(self) -> None:
        srv: Any = self.server
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        srv.keys.append(self.headers.get("Authorization"))
        prompt: list[int] = body["prompt"]
        tokens = [t % 1000 for t in prompt[: body["max_tokens"]]]
        if len(prompt) > CHUNK and srv.role == "peer":
            loaded = len(prompt) - 16
            if srv.fault == "miss":
                loaded = 0
            for name, value in (
                ("kvtier:loaded_tokens_total", loaded),
                ('kvtier:tier_hits_total{tier="s3"}', -(-loaded // CHUNK)),
                ("kvtier:load_failed_tokens_total", CHUNK if srv.fault == "failed" else 0),
            ):
                srv.counters[name] = srv.counters.get(name, 0.0) + value
            if srv.fault == "tokens":
                tokens[3] += 1
        send_completion_stream(self, tokens, len(prompt))


@pytest.fixture
def servers() -> Iterator[dict[str, Any]]:
    out: dict[str, Any] = {}
    for role in ("prefill", "peer"):
        srv: Any = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Server)
        srv.role, srv.fault, srv.counters, srv.keys = role, "", {}, []
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        out[role] = srv
    yield out
    for srv in out.values():
        srv.shutdown()


def _url(srv: Any) -> str:
    return f"http://127.0.0.1:{srv.server_port}"


def _run(servers: dict[str, Any], fault: str, monkeypatch: pytest.MonkeyPatch) -> list[Step]:
    import kvtier_tools.admin.chunks

    servers["peer"].fault = fault
    stored = DOCS * DOC_TOKENS // CHUNK - (1 if fault == "lost" else 0)
    monkeypatch.setattr(kvtier_tools.admin.chunks, "purge_namespace", lambda *a: {"s3": 0})
    monkeypatch.setattr(
        kvtier_tools.admin.chunks, "count_chunks_by_layout", lambda *a: {"s3": {"f" * 32: stored}}
    )
    monkeypatch.setattr(kvtier_tools.verify.fleet, "_OBJECTS_TIMEOUT", 0.5)
    cfg = load_config({"remote_url": "s3://bkt/kv", "request_namespaces": ["kvtier-verify-fleet"]})
    s = FleetSettings(
        server_url=_url(servers["prefill"]),
        model="m",
        api_key=None,
        cfg=cfg,
        namespace="kvtier-verify-fleet",
        documents=DOCS,
        document_tokens=DOC_TOKENS,
        output_tokens=32,
        seed=3,
        min_s3_share=0.9,
        host="serve1",
        peers=(Peer("serve2", _url(servers["peer"]), "sk-peer"),),
        metrics_settle_secs=0.0,
    )
    steps: list[Step] = []
    run(s, steps)
    return steps


def test_a_peer_that_loads_everything_from_ceph_passes(
    servers: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    steps = _run(servers, "", monkeypatch)
    assert first_failure(steps) is None
    assert [s.name for s in steps] == [
        "prefill on serve1",
        "chunks in the bucket",
        "serve2 loads from Ceph what serve1 computed",
    ]
    assert steps[2].values["s3_share"] >= 0.9
    assert servers["peer"].keys[-1] == "Bearer sk-peer"


@pytest.mark.parametrize(
    ("fault", "failure"),
    [
        ("lost", "step 2 (chunks in the bucket): chunks in the bucket (namespace), per layout "
         "(one per tensor-parallel rank): expected 4 (2 documents x 2 chunks), measured 3"),
        ("miss", "step 3 (serve2 loads from Ceph what serve1 computed): share of prompt tokens "
         "served by the S3 tier: expected >= 0.9, measured 0.000 (0 of 1024 tokens)"),
        ("failed", "step 3 (serve2 loads from Ceph what serve1 computed): tokens whose load "
         "failed: expected 0, measured 512"),
        ("tokens", "step 3 (serve2 loads from Ceph what serve1 computed): outputs "
         "token-identical to the prefill host's prefix-cache pass: expected 2 of 2 documents "
         "identical, measured documents [0, 1] differ"),
    ],
)  # fmt: skip
def test_each_check_fails_naming_step_expected_and_measured(
    servers: dict[str, Any], monkeypatch: pytest.MonkeyPatch, fault: str, failure: str
) -> None:
    assert first_failure(_run(servers, fault, monkeypatch)) == failure


def test_peer_keys_must_match_the_peers(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "kvtier.yaml"
    config.write_text("remote_url: s3://bkt/kv\nrequest_namespaces: [kvtier-verify-fleet]\n")
    monkeypatch.setenv("KVTIER_PEER_API_KEYS", "k1\nk2")
    args = ["verify-fleet", "--config", str(config), "--server-url", "http://127.0.0.1:1"]
    args += ["--model", "m", "--peer", "serve2=http://127.0.0.1:2", "--lock-dir", str(tmp_path)]
    assert main(args) == 2
    assert "$KVTIER_PEER_API_KEYS holds 2 keys for 1 --peer servers" in capsys.readouterr().err


def test_a_peer_must_be_name_equals_url(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["verify-fleet", "--server-url", "http://x", "--model", "m", "--peer", "serve2"])
    assert "must be NAME=URL" in capsys.readouterr().err
