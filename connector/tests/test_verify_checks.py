"""Every check of `kvtier verify` fails when what it checks goes wrong, and says so with the
step, the expected and the measured value.

A real vLLM + Ceph stack cannot be made to misbehave on demand (hits in a cold round, a lost
object, a wrong token), so a small HTTP server plays vLLM here: it streams completions, serves
``/v1/models`` and a ``/metrics`` whose counters move the way a healthy kvtier server's do, and
one fault per case is injected. The tiers' purge and count are replaced by a stand-in for the
same reason (the passing path against real vLLM, RGW and disk is connector/tests/e2e/
test_e2e_verify.py)."""

from __future__ import annotations

import http.server
import json
import threading
import time
from collections.abc import Iterator
from typing import Any, ClassVar

import pytest
from _helpers import send_completion_stream

from kvtier.config import load_config
from kvtier_tools.verify.checks import Step
from kvtier_tools.verify.report import first_failure
from kvtier_tools.verify.rounds import OTHER_TENANT_SALT
from kvtier_tools.verify.settings import Settings
from kvtier_tools.verify.steps import run

DOCS, DOC_TOKENS, CHUNK = 2, 512, 256
COLD_TTFT, HIT_TTFT = 0.12, 0.01


class _FakeVllm(http.server.BaseHTTPRequestHandler):
    """Rounds are told apart by the number of long prompts seen: cold, the prefix-cache
    reference, warm (after a restart, from S3), cold again."""

    fault: ClassVar[str] = ""
    counters: ClassVar[dict[str, float]] = {}
    long_prompts: ClassVar[int] = 0
    lock = threading.Lock()

    def _send(self, body: bytes, content_type: str) -> None:
        self.send_response(200)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        if self.path == "/v1/models":
            limit = 500 if self.fault == "context" else 4096
            doc = {"data": [{"id": "m", "max_model_len": limit}]}
            self._send(json.dumps(doc).encode(), "application/json")
        elif self.path == "/metrics":
            text = "".join(f"{k} {v}\n" for k, v in self.counters.items())
            self._send(text.encode(), "text/plain")
        else:
            self._send(b"", "text/plain")

    def _count(self, name: str, n: float) -> None:
        self.counters[name] = self.counters.get(name, 0.0) + n

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        prompt: list[int] = body["prompt"]
        ttft = HIT_TTFT
        tokens = [t % 1000 for t in prompt[: body["max_tokens"]]]
        with self.lock:
            if body.get("cache_salt") == OTHER_TENANT_SALT:  # step 4's isolation probe
                self._count("kvtier:lookup_tokens_total", len(prompt))
                if self.fault == "tenant_leak":
                    self._count("kvtier:hit_tokens_total", len(prompt) - 16)
            elif len(prompt) > CHUNK:
                rnd = type(self).long_prompts // DOCS  # 0 cold, 1 reference, 2 warm, 3 again
                type(self).long_prompts += 1
                self._round(rnd, len(prompt), tokens)
                ttft = COLD_TTFT if rnd in (0, 3) and not self._fast(rnd) else HIT_TTFT
        time.sleep(ttft)
        send_completion_stream(self, tokens, len(prompt))

    def _fast(self, rnd: int) -> bool:
        return rnd == 3 and self.fault == "cold_again_fast"

    def _round(self, rnd: int, n: int, tokens: list[int]) -> None:
        self._count("vllm:prompt_tokens_total", n)
        if rnd == 0 and self.fault == "cold_hits":
            self._count("kvtier:hit_tokens_total", CHUNK)
        if rnd == 1:
            self._count("vllm:prefix_cache_hits_total", n - 16)
        if rnd == 2:
            loaded = n - CHUNK if self.fault == "s3_share" else n - 16
            self._count("kvtier:hit_tokens_total", loaded)
            self._count("kvtier:loaded_tokens_total", loaded)
            self._count('kvtier:tier_hits_total{tier="s3"}', -(-loaded // CHUNK))
            if self.fault == "failed_load":
                self._count("kvtier:load_failed_tokens_total", CHUNK)
            if self.fault == "wrong_tokens":
                tokens[5] += 1
        if rnd == 3 and self.fault == "cold_again_tokens":
            tokens[-1] += 1

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def fake_vllm() -> Iterator[str]:
    _FakeVllm.counters = {}
    _FakeVllm.long_prompts = 0
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _FakeVllm)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_port}"
    server.shutdown()


def _verify(url: str, fault: str, monkeypatch: pytest.MonkeyPatch) -> list[Step]:
    import kvtier_tools.admin.chunks

    _FakeVllm.fault = fault
    objects = DOCS * DOC_TOKENS // CHUNK - (1 if fault == "lost_object" else 0)
    monkeypatch.setattr(
        kvtier_tools.admin.chunks, "purge_namespace", lambda cfg, ns, only: {"s3": 0}
    )
    monkeypatch.setattr(
        kvtier_tools.admin.chunks,
        "count_chunks_by_layout",
        lambda cfg, ns: {"s3": {"f" * 32: objects}, "disk": {}},
    )
    cfg = load_config({"remote_url": "s3://bkt/kv", "request_namespaces": ["kvtier-verify"]})
    settings = Settings(
        server_url=url,
        model="m",
        api_key=None,
        cfg=cfg,
        namespace="kvtier-verify",
        documents=DOCS,
        document_tokens=DOC_TOKENS,
        output_tokens=32,
        seed=1,
        restart=lambda: None,
        health_timeout=5.0,
        max_warm_cold_ratio=0.6,
        min_s3_share=0.9,
        channel=lambda: (fault != "channel", "ok" if fault != "channel" else "no choices"),
        metrics_settle_secs=0.0,
    )
    steps: list[Step] = []
    run(settings, steps)
    return steps


def test_a_healthy_server_passes_every_step(
    fake_vllm: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    steps = _verify(fake_vllm, "", monkeypatch)
    assert first_failure(steps) is None
    assert [s.number for s in steps if s.ok] == [1, 2, 3, 4, 5]


@pytest.mark.parametrize(
    ("fault", "failure"),
    [
        ("channel", "step 1 (channel test through the gateway profile): gateway answers a chat "
         "completion with choices: expected OK, measured no choices"),
        ("context", "step 2 (cold round): document + output tokens fit the model's context "
         "(max_model_len): expected <= 500, measured 544 (512 + 32)"),
        ("cold_hits", "step 2 (cold round): prompt tokens served by kvtier: expected 0, "
         "measured 512"),
        ("lost_object", "step 3 (restart vLLM, clear the host's local tiers): chunks in "
         "the bucket (namespace), per layout (one per tensor-parallel rank): expected 4 "
         "(2 documents x 2 chunks), measured 3"),
        ("s3_share", "step 4 (warm round (from Ceph only)): share of prompt tokens served by the "
         "S3 tier: expected >= 0.9, measured 0.500 (512 of 1024 tokens)"),
        ("tenant_leak", "step 4 (warm round (from Ceph only)): another tenant's request "
         "(cache_salt) for a stored document: prompt tokens from kvtier: expected 0 (of 512 "
         "looked up), measured 496 (of 512 looked up)"),
        ("failed_load", "step 4 (warm round (from Ceph only)): tokens whose load failed: "
         "expected 0, measured 512"),
        ("wrong_tokens", "step 4 (warm round (from Ceph only)): outputs token-identical to the "
         "cold round's prefix-cache pass: expected 2 of 2 documents identical, measured "
         "documents [0, 1] differ"),
        ("cold_again_fast", "step 5 (restart, purge, cold again): median TTFT cold again, "
         "nearer the first cold round than the warm round: expected >= 0."),
        ("cold_again_tokens", "step 5 (restart, purge, cold again): outputs token-identical to "
         "the first cold round: expected 2 of 2 documents identical, measured documents [0, 1] "
         "differ"),
    ],
)  # fmt: skip
def test_each_check_fails_naming_step_expected_and_measured(
    fake_vllm: str, monkeypatch: pytest.MonkeyPatch, fault: str, failure: str
) -> None:
    steps = _verify(fake_vllm, fault, monkeypatch)
    found = first_failure(steps)
    assert found is not None and found.startswith(failure), found
    assert not steps[-1].ok  # the run stopped at the failed step
