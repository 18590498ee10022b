"""Rolling changes on the live fleet, as an operator runs them (`ansible-playbook -i ... site.yml`):

1. a new chunk size for serve2 only while serve1 keeps answering a request loop (0 failed;
   `--tags serving`: the rollout's /health gate, kv_verify's gate is the converge's);
2. the two hosts now differ in layout: serve2 never reads serve1's chunks (0 hits, no errors,
   the tokens a full prefill gives);
3. the same change rolled out to the whole fleet, with serve2 broken on purpose (a model
   directory vLLM cannot load): serve1, first in the rollout, restarts while serve2 keeps
   answering a request loop (0 failed), then serve2 fails its /health gate and the rollout
   stops with a summary that names the host, the step and what it measured, while serve1 keeps
   serving. (One rollout for both: each costs minutes on two cores.)

The tests run in this order and build on each other (the last one leaves serve2 broken; the
scenario's destroy follows)."""

from __future__ import annotations

import json
import time

from _fleet import (
    Stream,
    chunks_in_bucket,
    chunks_of,
    host,
    playbook,
    prompt,
    server,
)
from scenario_playbook import recap

NEW_CHUNK = 512
CHANGE = ("-e", f"vllm_server_kvtier_chunk_size={NEW_CHUNK}")


def _roll_out_while_the_other_serves(target: str, other: str) -> None:
    serving = server(other)
    loop = Stream(lambda i: serving.complete(prompt(1024, seed=9000 + i), max_tokens=8))
    with loop:
        # The serving play only (its /health gate): kv_verify of a host is converge's test.
        run = playbook("site.yml", "--limit", target, "--tags", "serving", *CHANGE)
    assert run.returncode == 0, recap(run) + run.stdout[-4000:]
    assert loop.failures == [], loop.failures[:3]
    # The loop ran through the whole rollout of the other host (restarts included).
    assert len(loop.completions) >= 20, len(loop.completions)
    fact = server(target).fact
    assert int(fact["chunk_size"]) == NEW_CHUNK
    print(f"{target} rolled out while {other} answered {len(loop.completions)} requests, 0 failed")


def test_chunk_size_change_on_serve2_while_serve1_serves() -> None:
    _roll_out_while_the_other_serves("serve2", "serve1")


def test_a_host_with_another_layout_never_reads_the_others_chunks() -> None:
    s1, s2 = server("serve1"), server("serve2")
    assert int(s1.fact["chunk_size"]) != int(s2.fact["chunk_size"])
    doc = prompt(8192, seed=4242)
    ns = "kvtier-verify-fleet"
    cold_1 = s1.complete(doc, namespace=ns)
    wanted = chunks_of(doc, int(s1.fact["chunk_size"]))
    for _ in range(60):  # serve1's background writes: nothing to wait on but the listing
        if wanted <= chunks_in_bucket(ns):
            break
        time.sleep(0.5)
    assert wanted <= chunks_in_bucket(ns), "serve1's chunks never reached the bucket"
    offset = s2.log_size()
    before = {
        k: s2.metric(k) for k in ("kvtier:hit_tokens_total", "kvtier:load_failed_tokens_total")
    }
    got = s2.complete(doc, namespace=ns)
    time.sleep(1.5)
    after = {k: s2.metric(k) for k in before}
    assert after["kvtier:hit_tokens_total"] - before["kvtier:hit_tokens_total"] == 0
    assert after["kvtier:load_failed_tokens_total"] == before["kvtier:load_failed_tokens_total"]
    log = s2.log_since(offset)
    assert "Traceback" not in log and " ERROR " not in log, log[-2000:]
    # Both are full prefills of the same prompt: the same tokens.
    assert got.token_ids == cold_1.token_ids


def test_rollout_restarts_one_host_at_a_time_and_stops_at_a_broken_one() -> None:
    s1, s2 = server("serve1"), server("serve2")
    broken = "/var/lib/kvtier-fleet/hosts/serve2/broken-model"
    h = host("serve2")
    h.check_output(
        f'mkdir -p {broken} && echo \'{{"model_type": "no-such-arch"}}\' > {broken}/config.json'
    )
    h.check_output(f"chmod -R a+rX {broken}")
    model = json.dumps(
        {"vllm_model": f"{{{{ '{broken}' if inventory_hostname == 'serve2' else '' }}}}"}
    )
    first_start = s1.started_at()
    assert first_start is not None

    def serve1_is_back() -> bool:
        """serve1 answers again from a new process: its part of the rollout is done, and
        serve2's (which stops serve2 for good) comes next."""
        started = s1.started_at()
        return started is not None and started != first_start

    loop = Stream(
        lambda i: s2.complete(prompt(1024, seed=9500 + i), max_tokens=8), until=serve1_is_back
    )
    with loop:
        run = playbook("site.yml", "--tags", "serving", *CHANGE, "-e", model)
    assert serve1_is_back(), "serve1 was not restarted by the rollout"
    assert loop.failures == [], loop.failures[:3]
    # The loop ran through serve1's whole restart.
    assert len(loop.completions) >= 20, len(loop.completions)
    print(f"serve1 rolled out while serve2 answered {len(loop.completions)} requests, 0 failed")
    assert int(server("serve1").fact["chunk_size"]) == NEW_CHUNK

    assert run.returncode != 0, recap(run)
    out = " ".join(run.stdout.split())
    assert "Rollout stopped at serve2, in 'Server answers /health'" in out, out[-4000:]
    assert "the server exited while starting" in out
    assert "Rolled out and serving: serve1. Not touched: none." in out
    # The log tail in the output shows vLLM's own reason.
    assert "OSError: Repo id must be in the form" in out and f"{broken}" in out
    # serve1, rolled out before, keeps serving.
    assert s1.complete(prompt(512, seed=1), max_tokens=4).token_ids
