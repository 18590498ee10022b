"""Two servers (different ports, separate disk dirs, CPU+disk+S3 tiers) on one bucket: B hits what
A wrote (B has never seen the prompt, so its hits can only come from S3), and namespaces keep
tenants apart: B's requests in a namespace of their own never hit A's chunks of the same prompt,
and a request naming a namespace B does not allow is served without kvtier. After that traffic,
B's /metrics serves every series monitoring/'s dashboard and alert rules read (B has a cap on the
shared tier, so its fill and cap are among them)."""

from __future__ import annotations

import urllib.request
from pathlib import Path

from _e2e import CHUNK, OUTPUT_TOKENS, Counters, S3Target, Servers, assert_same_tokens, prompt
from _monitoring import SERIES_ON_FIRST_EVENT, monitored_selectors

from kvtier_tools.completions import Completion, stream_completion
from kvtier_tools.server import VllmServer, parse_metrics

SHARED = prompt(6_000, seed=21)
#: One token past a chunk boundary: vLLM's own prefix cache then hands back whole chunks (it
#: keeps the last token to compute), so a repeat it answers resumes at a step boundary (_e2e).
TENANT = prompt(11 * CHUNK + 1, seed=31)


def test_server_b_hits_what_server_a_wrote_and_tenants_stay_apart(
    servers: Servers, s3_target: S3Target, scratch: Path
) -> None:
    tiers = {"local_cpu": True, "max_local_cpu_size": 0.5, "max_local_disk_size": 1.0}
    a = servers.make(
        "shared-a", s3_target.kvtier(local_disk=str(scratch / "a"), **tiers), env=s3_target.env
    )
    cold = a.complete(SHARED, max_tokens=OUTPUT_TOKENS)
    tenant_cold = a.complete(TENANT, max_tokens=OUTPUT_TOKENS)
    n = len(SHARED) // CHUNK + len(TENANT) // CHUNK  # full chunks of each prompt
    assert s3_target.wait_for_chunks(n) == n
    b = servers.make(
        "shared-b",
        s3_target.kvtier(
            local_disk=str(scratch / "b"),
            request_namespaces=["tenant-b"],
            # A cap far above what this test writes: B then serves the shared tier's fill and
            # cap, which the over-cap alert reads; nothing is evicted.
            max_remote_size=8.0,
            **tiers,
        ),
        env=s3_target.env,
    )
    c = Counters(b)
    out = b.complete(SHARED, max_tokens=OUTPUT_TOKENS)
    assert c.delta("kvtier:tier_hits_total", tier="s3") >= len(SHARED) // CHUNK - 1, b.log_tail()
    assert c.delta("kvtier:tier_hits_total", tier="disk") == 0
    assert c.delta("vllm:external_prefix_cache_hits_total") >= 0.9 * len(SHARED)
    assert_same_tokens(out, cold, c)

    def ask(namespace: str) -> Completion:
        body = {"kv_transfer_params": {"kvtier_namespace": namespace}}
        return stream_completion(
            b.base_url, b.served_model_name, TENANT, OUTPUT_TOKENS, extra_body=body
        )

    # Tenant B, the same prompt A stored in the production namespace: no hit.
    c = Counters(b)
    assert_same_tokens(ask("tenant-b"), tenant_cold, c)
    assert c.delta("kvtier:hit_tokens_total") == 0
    # A namespace B does not allow: served without kvtier (nothing looked up), and said so;
    # from vLLM's own prefix cache of the request just before.
    c = Counters(b)
    assert_same_tokens(ask("tenant-a"), tenant_cold, c)
    assert c.delta("kvtier:lookup_tokens_total") == 0
    assert c.delta("vllm:prefix_cache_hits_total") == len(TENANT) - 1
    assert "asks for namespace 'tenant-a', which is not in request_namespaces" in b.log_text()
    _every_series_monitoring_reads_is_served(b)
    a.stop()
    b.stop()


def _every_series_monitoring_reads_is_served(server: VllmServer) -> None:
    """Each series the dashboard and the alerts select (with their ``label="value"`` matchers)
    has a sample on a server with CPU, disk and S3 tiers after traffic; a series that exists
    only from its first event on (tier errors, by cause) is at least declared."""
    with urllib.request.urlopen(server.base_url + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    samples = parse_metrics(text)
    missing = []
    for where, selector in monitored_selectors():
        if selector.metric in SERIES_ON_FIRST_EVENT:
            present = f"# HELP {selector.metric} " in text
        else:
            present = any(
                s.name == selector.metric and all(s.labels.get(k) == v for k, v in selector.equal)
                for s in samples
            )
        if not present:
            missing.append(f"{where}: {selector.metric}{dict(selector.equal)}")
    assert not missing, f"not on {server.base_url}/metrics: {missing}"
