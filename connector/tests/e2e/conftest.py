"""Fixtures of the end-to-end tests (helpers in _e2e.py). Every test here is marked `e2e`."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from _e2e import VLLM_PYTHON, Counters, S3Target, Servers, field_of

from kvtier.config import load_config
from kvtier_tools.server import VllmServer


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "/e2e/" in str(item.fspath):
            item.add_marker(pytest.mark.e2e)


@pytest.fixture(scope="session")
def e2e_root() -> Iterator[Path]:
    """Private scratch dir for the session (pytest's basetemp is rotated by concurrent runs)."""
    root = Path(tempfile.mkdtemp(prefix="kvtier-e2e-"))
    yield root
    if os.environ.get("KVTIER_E2E_KEEP"):  # keep server logs for debugging
        print(f"kvtier e2e: kept {root}")
    else:
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def scratch(e2e_root: Path, request: pytest.FixtureRequest) -> Path:
    path = e2e_root / "tests" / request.node.name
    path.mkdir(parents=True, exist_ok=True)
    return path


@pytest.fixture(scope="session")
def tiny_model(e2e_root: Path) -> str:
    """The tiny model, made by `kvtier model make-tiny` from the vLLM venv (as users do)."""
    if not os.path.exists(VLLM_PYTHON):
        pytest.fail(f"no vLLM venv at {VLLM_PYTHON}: run `make vllm-venv`")
    out = e2e_root / "tiny-model"
    done = subprocess.run(
        [VLLM_PYTHON, "-m", "kvtier_tools.cli", "model", "make-tiny", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, f"kvtier model make-tiny failed:\n{done.stderr[-3000:]}"
    return str(out)


@pytest.fixture(scope="module")
def s3_target(request: pytest.FixtureRequest) -> Iterator[S3Target]:
    """A fresh prefix in the bucket of ``ceph_s3`` (or of ``$KVTIER_TEST_S3_CONFIG``, a kvtier
    YAML with remote_url/endpoint_url/aws_profile, to run against another S3); emptied after."""
    prefix = f"kvtier-e2e/{uuid.uuid4().hex[:10]}"
    override = os.environ.get("KVTIER_TEST_S3_CONFIG")
    if override:
        cfg = load_config(override)
        target = S3Target(
            bucket=cfg.s3_bucket or "",
            prefix=prefix,
            endpoint_url=cfg.endpoint_url or "",
            region=cfg.extra_config.s3_region,
            profile=cfg.aws_profile or "default",
            env={
                k: os.environ[k]
                for k in ("AWS_SHARED_CREDENTIALS_FILE", "AWS_CONFIG_FILE")
                if k in os.environ
            },
        )
    else:
        fx = request.getfixturevalue("ceph_s3")
        target = S3Target(
            bucket=field_of(fx, "bucket"),
            prefix=prefix,
            endpoint_url=field_of(fx, "endpoint_url"),
            region=field_of(fx, "region"),
            profile=field_of(fx, "profile"),
            env={
                "AWS_SHARED_CREDENTIALS_FILE": str(field_of(fx, "credentials_file")),
                "AWS_CONFIG_FILE": str(field_of(fx, "config_file")),
            },
        )
    yield target
    target.clear()


@pytest.fixture(scope="module")
def servers(tiny_model: str, e2e_root: Path, request: pytest.FixtureRequest) -> Iterator[Servers]:
    s = Servers(tiny_model, e2e_root / "servers" / request.module.__name__)
    yield s
    s.stop_all()


@pytest.fixture
def counters() -> Callable[[VllmServer], Counters]:
    return Counters
