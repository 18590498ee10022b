"""What users see of the vLLM server on the converged site: a supervisor (or systemd) service
run by the serving user, healthy, guarding /v1 with the gateway profile's key (which never shows
in the process's argv), answering `kvtier gateway test`, with kvtier's tiers reachable, and a
prompt sent again after a service restart served from kvtier's cache with the same output."""

from __future__ import annotations

import json
import random
import re
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvtier_tools.model import sample_text
from kvtier_tools.server import Sample, metric_sum, parse_metrics

REPO = Path(__file__).resolve().parents[3]
LOCAL_VARS = REPO / "inventories" / "local" / "group_vars" / "all"


def _vars() -> dict[str, Any]:
    values: dict[str, Any] = {}
    for role in ("gateway_profile", "nvme_cache", "vllm_server"):
        values.update(yaml.safe_load((REPO / "roles" / role / "defaults" / "main.yml").read_text()))
    for name in ("kvtier.yml", "ceph.yml", "nvme_cache.yml", "gateway.yml", "vllm_server.yml"):
        values.update(yaml.safe_load((LOCAL_VARS / name).read_text()))
    return values


VARS = _vars()
USER = VARS["kvtier_user_name"]
SERVICE = VARS["vllm_server_service_name"]
VENV = VARS["vllm_server_venv"].replace("{{ vllm_server_version }}", VARS["vllm_server_version"])
#: The operator tools' venv (the `kvtier` command); the serving venv holds the runtime only.
TOOLS = VARS["vllm_server_tools_venv"].replace("{{ vllm_server_venv }}", VENV)
BASE = f"http://{VARS['vllm_server_host']}:{VARS['vllm_server_port']}"
MODEL = VARS["vllm_server_served_model_name"]
KEY_FILE = VARS["gateway_profile_api_key_file"].replace(
    "{{ gateway_profile_name }}", VARS["gateway_profile_name"]
)
CONFIG_FILE = VARS["vllm_server_kvtier_config_file"]
CHUNK = VARS["vllm_server_kvtier_chunk_size"]
#: Chunks per S3 object for the tiny model: its 256-token chunk is 256 KiB of KV, so 8 MiB
#: objects hold 32 (kvtier.format.chunks_per_object).
OBJECT_CHUNKS = 32


def _key(host: Any) -> str:
    return str(host.file(KEY_FILE).content_string.strip())


def _as_user(host: Any, command: str) -> Any:
    return host.run(f"runuser -u {USER} -- {command}")


def _systemd(host: Any) -> bool:
    return bool(host.file("/run/systemd/system").is_directory)


def _server_pid(host: Any) -> int:
    if _systemd(host):
        return int(host.check_output(f"systemctl show --property MainPID --value {SERVICE}"))
    return int(host.check_output(f"supervisorctl pid {SERVICE}"))


def _request(
    path: str, key: str | None = None, body: dict[str, Any] | None = None, timeout: float = 300
) -> tuple[int, bytes]:
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(BASE + path, data, headers)
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return int(response.status), response.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()


def _metrics() -> list[Sample]:
    status, body = _request("/metrics")
    assert status == 200
    return parse_metrics(body.decode())


def _wait_healthy(timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if _request("/health", timeout=5)[0] == 200:
                return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(1)
    pytest.fail(f"{BASE}/health did not answer 200 within {timeout} s")


def test_service_is_a_supervisor_program_run_by_the_serving_user(host: Any) -> None:
    if _systemd(host):
        assert host.service(SERVICE).is_enabled
        assert host.service(SERVICE).is_running
    else:
        status = host.check_output(f"supervisorctl status {SERVICE}")
        assert re.search(rf"^{SERVICE}\s+RUNNING", status), status
    pid = _server_pid(host)
    assert host.process.get(pid=pid).user == USER
    argv = host.file(f"/proc/{pid}/cmdline").content_string.split("\0")
    assert argv[:3] == [f"{VENV}/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
    transfer = json.loads(argv[argv.index("--kv-transfer-config") + 1])
    assert transfer["kv_connector"] == "KVTierConnector"
    assert transfer["kv_connector_extra_config"] == {"config_file": CONFIG_FILE}
    assert argv[argv.index("--shutdown-timeout") + 1] == "10"


def test_api_key_reaches_vllm_through_the_environment_only(host: Any) -> None:
    pid = _server_pid(host)
    key = _key(host)
    assert key not in host.file(f"/proc/{pid}/cmdline").content_string
    environ = host.file(f"/proc/{pid}/environ").content_string.split("\0")
    assert f"VLLM_API_KEY={key}" in environ
    for name in (
        "supervisor/conf.d/" + SERVICE + ".conf",
        "systemd/system/" + SERVICE + ".service",
    ):
        definition = host.file(f"/etc/{name}")
        if definition.exists:
            assert key not in definition.content_string


def test_serving_venv_holds_the_runtime_only_and_the_tools_venv_the_tools(host: Any) -> None:
    probe = (
        "import importlib.metadata as m, importlib.util as u; "
        "print(u.find_spec('kvtier') is not None, u.find_spec('kvtier_tools') is not None, "
        "[r for r in m.requires('kvtier') or [] if 'extra' not in r])"
    )
    serving = host.run(f'{VENV}/bin/python -c "{probe}"')
    assert serving.rc == 0, serving.stderr
    runtime, tools, requires = serving.stdout.split(" ", 2)
    assert (runtime, tools) == ("True", "False"), serving.stdout
    assert "tomli" not in requires, f"the runtime requires a tool's dependency: {requires}"
    assert not host.file(f"{VENV}/bin/kvtier").exists
    assert host.run(f"{TOOLS}/bin/kvtier --help").rc == 0


def test_health_answers(host: Any) -> None:
    assert _request("/health")[0] == 200


def test_models_needs_the_api_key(host: Any) -> None:
    assert _request("/v1/models")[0] == 401
    assert _request("/v1/models", key="sk-wrong")[0] == 401
    status, body = _request("/v1/models", key=_key(host))
    assert status == 200
    assert [model["id"] for model in json.loads(body)["data"]] == [MODEL]


def test_kvtier_config_comes_from_the_inventory(host: Any) -> None:
    config = yaml.safe_load(host.file(CONFIG_FILE).content_string)
    assert config["local_disk"] == VARS["nvme_cache_mount_path"]
    assert config["remote_url"] == f"s3://{VARS['rgw_bucket_name']}/kv"
    assert config["aws_profile"] == VARS["aws_profile_name"]
    assert config["chunk_size"] == CHUNK
    assert config["namespace"] == VARS["vllm_server_kvtier_namespace"]
    assert config["enable_async_loading"] is True  # the role's default: S3 loads off the step


def test_gateway_test_passes_as_the_serving_user(host: Any) -> None:
    result = _as_user(host, f"{TOOLS}/bin/kvtier gateway test")
    assert result.rc == 0, result.stdout + result.stderr
    assert f"model '{MODEL}' answered" in result.stdout


def test_kvtier_doctor_passes_as_the_serving_user(host: Any) -> None:
    result = _as_user(host, f"{TOOLS}/bin/kvtier doctor --config {CONFIG_FILE}")
    assert result.rc == 0, result.stdout + result.stderr
    assert " 0 failed" in result.stdout


def _new_prompt(seed: int) -> list[int]:
    """Token ids no earlier run has sent, as many as two 2,048-token prefill steps plus one
    (see test_prompt_after_a_restart_is_served_from_the_cache)."""
    rng = random.Random(seed)
    return [rng.randrange(300, 8000) for _ in range(2 * 2048 + 1)]


def _complete(key: str, prompt: str | list[int]) -> tuple[str, int]:
    status, body = _request(
        "/v1/completions",
        key=key,
        body={"model": MODEL, "prompt": prompt, "max_tokens": 16, "temperature": 0.0},
    )
    assert status == 200, body[:500]
    answer = json.loads(body)
    return answer["choices"][0]["text"], int(answer["usage"]["prompt_tokens"])


def _chunks(host: Any) -> dict[str, int]:
    """Chunks on the disk tier and objects on S3 (each a run of up to OBJECT_CHUNKS chunks)."""
    listing = _as_user(host, f"{TOOLS}/bin/kvtier ls --config {CONFIG_FILE}")
    assert listing.rc == 0, listing.stderr
    return {
        m[0]: int(m[1])
        for m in re.findall(r"^(disk|s3) \(.*\): (\d+) (?:chunks|objects)", listing.stdout, re.M)
    }


def test_prompt_after_a_restart_is_served_from_the_cache(host: Any) -> None:
    key = _key(host)
    # A prompt no earlier run has sent, so the first answer is computed and the second can only
    # come from what the first one stored. 4,097 token ids: two 2,048-token prefill steps (vLLM's
    # CPU default) and one token. The second answer loads 16 whole chunks (4,096 tokens) and
    # computes the last token: the same steps as the first, so the same arithmetic and the same
    # text on every CPU (on CPUs with AMX another split can flip a near-tie; _e2e.py says why).
    prompt = _new_prompt(time.time_ns())
    before = _chunks(host)
    first_text, prompt_tokens = _complete(key, prompt)
    assert prompt_tokens == len(prompt)
    assert metric_sum(_metrics(), "kvtier:saved_chunks_total") >= prompt_tokens // CHUNK

    # supervisorctl stops the server with SIGTERM: the connector flushes disk/S3 writes.
    if _systemd(host):
        host.check_output(f"systemctl restart {SERVICE}")
    else:
        host.check_output(f"supervisorctl restart {SERVICE}")
    _wait_healthy()
    after_restart = _metrics()
    assert metric_sum(after_restart, "kvtier:hit_tokens_total") == 0

    stored = _chunks(host)
    assert stored["disk"] - before["disk"] >= prompt_tokens // CHUNK
    assert stored["s3"] - before["s3"] >= -(-(prompt_tokens // CHUNK) // OBJECT_CHUNKS)

    second_text, _ = _complete(key, prompt)
    samples = _metrics()
    hit = metric_sum(samples, "kvtier:hit_tokens_total")
    # All full chunks but the last block, which vLLM always computes.
    assert hit >= (prompt_tokens // CHUNK - 1) * CHUNK, samples
    assert metric_sum(samples, "vllm:external_prefix_cache_hits_total") == hit
    assert metric_sum(samples, "kvtier:loaded_tokens_total") == hit
    assert metric_sum(samples, "kvtier:load_failed_tokens_total") == 0
    assert second_text == first_text


def test_kv_verify_reported_every_step_passed() -> None:
    """The last play of site.yml (kv_verify) left its report on the control node (this host)."""
    doc = json.loads((REPO / "reports" / "kv_verify" / "localhost.json").read_text())
    assert doc["ok"], doc["failure"]
    assert [s["number"] for s in doc["steps"] if s["ok"]] == [1, 2, 3, 4, 5]
    assert doc["host"] == "localhost" and doc["started_at"]
    channel = doc["steps"][0]
    assert "skipped" not in channel["values"] and channel["checks"][0]["ok"]  # really sent
    warm = next(s for s in doc["steps"] if s["number"] == 4)["values"]
    assert warm["s3_share"] >= 0.9
    assert (
        (REPO / "reports" / "kv_verify" / "localhost.md")
        .read_text()
        .startswith("# kv_verify on localhost: PASSED")
    )


def test_local_fact_describes_the_server(host: Any) -> None:
    fact = json.loads(host.file("/etc/ansible/facts.d/kvtier_vllm.fact").content_string)
    assert fact["server_url"] == BASE and fact["model"] == MODEL
    # One per host, and the fleet-wide one of the cross-node step.
    assert fact["request_namespaces"] == ["kvtier-verify-localhost", "kvtier-verify-fleet"]


def _wait_stored(host: Any, before: dict[str, int], chunks: int, timeout: float = 120) -> None:
    """kill -9 gives the connector no chance to flush: wait until its writes have landed."""
    deadline = time.monotonic() + timeout
    stored = _chunks(host)
    wanted = {"disk": chunks, "s3": -(-chunks // OBJECT_CHUNKS)}  # a new prompt's runs
    while any(stored[t] - before[t] < wanted[t] for t in ("disk", "s3")):
        if time.monotonic() > deadline:
            pytest.fail(f"{chunks} new chunks per tier not stored within {timeout} s: {stored}")
        time.sleep(1)
        stored = _chunks(host)


def test_kill_9_under_load_the_server_comes_back_and_its_chunks_still_hit(host: Any) -> None:
    """vLLM killed outright while it serves: the service manager restarts it, nothing of the
    dead server is left running, and what it stored is served again, from the disk tier for
    one prompt and from S3 for the other, with the same output."""
    key = _key(host)
    seed = time.time_ns() % 1_000_000_007
    # Token ids that load whole prefill steps: the same text on every CPU (see the test above).
    only_s3, on_disk = _new_prompt(seed), _new_prompt(seed + 1)

    before = _chunks(host)
    s3_text, tokens = _complete(key, only_s3)
    _wait_stored(host, before, tokens // CHUNK)
    # Leave this prompt's chunks in S3 only: the restarted server's disk tier rescans its files.
    purge = _as_user(host, f"{TOOLS}/bin/kvtier purge --config {CONFIG_FILE} --tier disk --yes")
    assert purge.rc == 0, purge.stdout + purge.stderr
    before = _chunks(host)
    disk_text, disk_tokens = _complete(key, on_disk)
    _wait_stored(host, before, disk_tokens // CHUNK)

    # Load: another client's long prompts, one in flight when the server dies.
    outcomes: list[str] = []

    def load() -> None:
        for n in range(4):
            try:
                status, _ = _request(
                    "/v1/completions",
                    key=key,
                    body={"model": MODEL, "prompt": sample_text(2600, seed=seed + 10 + n)},
                    timeout=60,
                )
                outcomes.append(str(status))
            except OSError as err:  # the connection dies with the server: expected here
                outcomes.append(type(err).__name__)

    loader = threading.Thread(target=load)
    loader.start()
    time.sleep(0.5)
    old = _server_pid(host)
    children = host.check_output(f"pgrep -P {old} || true").split()
    host.check_output(f"kill -9 {old}")
    killed = time.monotonic()
    loader.join()
    _wait_healthy()
    print(f"kill -9: healthy again {time.monotonic() - killed:.1f} s later; load: {outcomes}")
    assert _server_pid(host) != old
    for child in children:  # the killed server's engine core does not linger
        assert not host.file(f"/proc/{child}").exists, f"pid {child} of the killed server runs"
    assert any(o != "200" for o in outcomes), outcomes  # requests did meet the dead server

    assert _complete(key, on_disk)[0] == disk_text
    assert _complete(key, only_s3)[0] == s3_text
    samples = _metrics()
    for tier, prompt_tokens in (("disk", disk_tokens), ("s3", tokens)):
        hit = metric_sum(samples, "kvtier:hit_tokens_by_tier_total", tier=tier)
        assert hit >= (prompt_tokens // CHUNK - 1) * CHUNK, (tier, samples)
    assert metric_sum(samples, "kvtier:load_failed_tokens_total") == 0
