"""The S3 endpoint fails under load; vLLM serves as it would without a cache, and picks the cache
up again by itself. Real vLLM, RGW and haproxy; S3 tier only, vLLM's prefix cache off.

- a black hole (a private haproxy in front of the site's endpoint, its worker frozen: the
  connections are accepted, no answer ever comes), sequential and 4 at a time: no request
  fails, none is slower than the healthy ones by more than a bound far below what the
  unprotected connector took (10-41 s: docs/reliability.md), the breaker opens (/metrics),
  the log gets a handful of lines, not one per chunk; thawed, hits resume without a restart;
- packets dropped (a listener that never accepts) from the start: the server starts, serves;
- the site's radosgw and then its haproxy stopped in the middle of a request stream: no
  request fails; once both are back, hits resume.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pytest
from _e2e import CHUNK, OUTPUT_TOKENS, Counters, S3Target, Servers, prompt
from _faults import (
    Haproxy,
    StreamResult,
    endpoint_answer,
    set_programs,
    silent_listener,
    site_programs,
    stream,
)

from kvtier_tools.completions import Completion
from kvtier_tools.server import VllmServer, metric_sum

# Stops the site's radosgw and haproxy programs, and bounds TTFTs: CI runs it alone.
pytestmark = pytest.mark.alone

#: Fast reactions for a test: the breaker opens after 3 failures, probes again after 1 s.
OUTAGE = {
    "lookup_timeout_secs": 0.1,
    "remote_failure_threshold": 3,
    "remote_retry_secs": 1.0,
    "blocking_timeout_secs": 5.0,
}
#: The negative control, by hand (docs/reliability.md): KVTIER_TEST_UNPROTECTED=1 takes the
#: protections away (the scheduler waits for every lookup, the breaker never opens), and the
#: black-hole test must then fail.
if os.environ.get("KVTIER_TEST_UNPROTECTED"):
    OUTAGE |= {"lookup_timeout_secs": 60.0, "remote_failure_threshold": 1_000_000}
DOC = 2048
#: Slower than healthy by at most this (s). Without the protections a black hole cost 10-41 s.
BOUND = 2.0


@pytest.fixture(scope="module")
def proxy(e2e_root: Path, s3_target: S3Target) -> Iterator[Haproxy]:
    p = Haproxy(e2e_root, s3_target.endpoint_url).start()
    yield p
    p.stop()


#: Seconds each server of the module took to start (until /health answered).
STARTED_IN: dict[str, float] = {}


@pytest.fixture(scope="module")
def server(servers: Servers, s3_target: S3Target, proxy: Haproxy) -> VllmServer:
    cfg = s3_target.kvtier(endpoint_url=proxy.url, **OUTAGE)
    start = time.monotonic()
    srv = servers.make("s3-outage", cfg, prefix_caching=False, env=s3_target.env)
    STARTED_IN["healthy"] = time.monotonic() - start
    srv.complete(prompt(64, seed=1), max_tokens=4)
    return srv


def _send(server: VllmServer) -> Callable[[Sequence[int]], Completion]:
    def send(tokens: Sequence[int]) -> Completion:
        return server.complete(tokens, max_tokens=8)

    return send


def _docs(seed: int, n: int) -> list[list[int]]:
    return [prompt(DOC, seed=seed + i) for i in range(n)]


def _wait_for_s3_hit(server: VllmServer, stored: list[int], timeout: float) -> float:
    """Seconds until a request for ``stored`` (its chunks are in the bucket) loads from S3."""
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        c = Counters(server)
        server.complete(stored, max_tokens=4)
        time.sleep(1.5)  # vLLM publishes counters with its stats interval
        if c.delta("kvtier:hit_tokens_by_tier_total", tier="s3") > 0:
            return time.monotonic() - start
    return float("inf")


def _wait_for_open_breaker(server: VllmServer, timeout: float) -> float:
    """kvtier:tier_circuit_open{tier="s3"} once it is > 0 (the lookups that time out in the
    background open it a few seconds into the fault; short requests make the engine report)."""
    deadline = time.monotonic() + timeout
    value = 0.0
    while value < 1 and time.monotonic() < deadline:
        server.complete(prompt(64, seed=int(time.monotonic())), max_tokens=2)
        time.sleep(1.0)
        value = metric_sum(server.metrics(), "kvtier:tier_circuit_open", tier="s3")
    return value


def test_a_black_holed_endpoint_delays_no_request(
    server: VllmServer, proxy: Haproxy, s3_target: S3Target
) -> None:
    send = _send(server)
    healthy_seq = stream(send, _docs(1000, 4))
    healthy_par = stream(send, _docs(1100, 8), concurrency=4)
    stored = _docs(1000, 1)[0]
    s3_target.wait_for_chunks(DOC // CHUNK)
    offset = len(server.log_path.read_text(errors="replace"))
    proxy.freeze()
    try:
        black_seq = stream(send, _docs(2000, 6))
        black_par = stream(send, _docs(2100, 8), concurrency=4)
        open_now = _wait_for_open_breaker(server, timeout=20)
    finally:
        proxy.thaw()
    recovered = _wait_for_s3_hit(server, stored, timeout=60)
    log = server.log_path.read_text(errors="replace")[offset:]
    s3_warnings = [ln for ln in log.splitlines() if "WARNING" in ln and "s3" in ln]
    print(
        f"black hole: healthy p99 {healthy_seq.p(0.99):.3f}/{healthy_par.p(0.99):.3f} s, "
        f"black-holed p99 {black_seq.p(0.99):.3f}/{black_par.p(0.99):.3f} s "
        f"(sequential/4 at a time); {len(s3_warnings)} warnings; hits back {recovered:.1f} s "
        "after the thaw"
    )
    assert black_seq.failures == [] and black_par.failures == []
    assert max(black_seq.ttfts) <= max(healthy_seq.ttfts) + BOUND, black_seq.ttfts
    assert max(black_par.ttfts) <= max(healthy_par.ttfts) + BOUND, black_par.ttfts
    assert open_now >= 1  # the breaker is open while the endpoint hangs
    assert len(s3_warnings) <= 8, s3_warnings  # one per change and cause, not per chunk
    assert recovered <= 30  # probes every 1-8 s here: hits come back without a restart
    assert "Traceback" not in log


def test_dropped_packets_from_the_start_cost_the_server_nothing(
    servers: Servers, s3_target: S3Target, server: VllmServer
) -> None:
    """A server whose S3 endpoint drops every packet from the start: it starts no later than a
    healthy one (the module's) plus the start-up probe of each connector side (scheduler,
    worker) timing out (blocking_timeout_secs each), says that it serves without S3, and
    serves as fast as the healthy server does."""
    healthy = stream(_send(server), _docs(3100, 4))
    with silent_listener() as url:
        start = time.monotonic()
        srv = servers.make(
            "s3-dropped", s3_target.kvtier(endpoint_url=url, **OUTAGE), env=s3_target.env
        )
        STARTED_IN["dropped"] = time.monotonic() - start
        result = stream(_send(srv), _docs(3000, 4))
        log = srv.log_text()
        srv.stop()
    print(
        f"dropped packets: started in {STARTED_IN} s; TTFTs {result.ttfts}, healthy {healthy.ttfts}"
    )
    assert result.failures == []
    assert STARTED_IN["dropped"] <= (
        STARTED_IN["healthy"] + 2 * OUTAGE["blocking_timeout_secs"] + BOUND
    ), STARTED_IN
    assert max(result.ttfts) <= max(healthy.ttfts) + BOUND, (result.ttfts, healthy.ttfts)
    assert "cannot be used (timeout)" in log and "Serving without it" in log


@pytest.mark.skipif(
    bool(os.environ.get("KVTIER_TEST_S3_CONFIG")), reason="stops the local site's RGW"
)
def test_rgw_then_haproxy_killed_mid_stream_fail_no_request(
    servers: Servers, s3_target: S3Target
) -> None:
    """Each fault is checked to have happened (the programs stopped, the endpoint answering 503,
    then refusing connections), with requests sent during each (at least two), the S3 tier's
    errors counted; none of those requests fails or waits longer than the healthy ones by more
    than BOUND; once both are back, hits from S3 resume."""
    rgw, proxies = site_programs("rgw-"), site_programs("haproxy-rgw-")
    assert rgw and proxies, "the local site's radosgw/haproxy programs are not running"
    srv = servers.make(
        "s3-killed", s3_target.kvtier(**OUTAGE), prefix_caching=False, env=s3_target.env
    )
    stored = prompt(DOC, seed=4000)
    srv.complete(stored, max_tokens=OUTPUT_TOKENS)
    s3_target.wait_for_chunks(DOC // CHUNK)
    sent: list[tuple[float, StreamResult]] = []  # (when sent, its result)
    done = threading.Event()

    def load() -> None:
        i = 0
        while not done.is_set():  # a stored prompt (a hit) and a new one, turn about
            tokens = stored if i % 2 == 0 else prompt(DOC, seed=5000 + i)
            sent.append((time.monotonic(), stream(_send(srv), [tokens])))
            i += 1

    c = Counters(srv)
    thread = threading.Thread(target=load)
    thread.start()
    phases: dict[str, float] = {}
    answers: dict[str, str] = {}
    try:
        time.sleep(3)
        phases["rgw stopped"] = time.monotonic()
        set_programs("STOPPED", rgw)
        answers["rgw stopped"] = endpoint_answer(s3_target.endpoint_url)
        time.sleep(4)
        phases["haproxy stopped"] = time.monotonic()
        set_programs("STOPPED", proxies)
        answers["haproxy stopped"] = endpoint_answer(s3_target.endpoint_url)
        time.sleep(4)
    finally:
        phases["back"] = time.monotonic()
        set_programs("RUNNING", [*proxies, *rgw])
        time.sleep(3)
        done.set()
        thread.join()
    failures = [f for _, r in sent for f in r.failures]
    healthy = [t for at, r in sent if at < phases["rgw stopped"] for t in r.ttfts]
    during = {
        name: [t for at, r in sent if start <= at < end for t in r.ttfts]
        for (name, start), end in zip(phases.items(), list(phases.values())[1:], strict=False)
    }
    s3_errors = c.delta("kvtier:tier_errors_total", tier="s3")
    recovered = _wait_for_s3_hit(srv, stored, timeout=60)
    srv.stop()
    print(
        f"RGW and haproxy stopped: endpoint answered {answers}; {len(healthy)} healthy requests "
        f"(max TTFT {max(healthy, default=0):.2f} s), during the faults "
        f"{ {k: len(v) for k, v in during.items()} } (max TTFT "
        f"{ {k: round(max(v, default=0), 2) for k, v in during.items()} } s); {s3_errors:.0f} "
        f"S3 errors counted; hits back {recovered:.1f} s after both returned"
    )
    assert answers == {"rgw stopped": "503", "haproxy stopped": "refused"}
    assert failures == []
    assert len(healthy) >= 2 and all(len(v) >= 2 for v in during.values()), during
    assert s3_errors > 0  # the connector met the faults
    assert max(t for v in during.values() for t in v) <= max(healthy) + BOUND, during
    assert recovered <= 30
