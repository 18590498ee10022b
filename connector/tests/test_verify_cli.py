"""`kvtier verify` input errors: caught before anything is sent or restarted, with what to fix."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvtier_tools.cli import main
from kvtier_tools.verify.lock import exclusive

BASE = [
    "verify",
    "--server-url",
    "http://127.0.0.1:9",
    "--model",
    "m",
    "--restart-command",
    "true",
    "--skip-channel-test",
]


def _config(tmp_path: Path, text: str) -> str:
    path = tmp_path / "kvtier.yaml"
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize(
    ("text", "extra", "message"),
    [
        (
            "remote_url: s3://bkt/kv\n",
            [],
            "namespace 'kvtier-verify' is not in request_namespaces",
        ),
        (
            "remote_url: s3://bkt/kv\nnamespace: kvtier-verify\n"
            "request_namespaces: [kvtier-verify]\n",
            [],
            "is the production namespace",
        ),
        ("request_namespaces: [kvtier-verify]\n", [], "has no S3 tier"),
        (
            "remote_url: s3://bkt/kv\nrequest_namespaces: [kvtier-verify]\n",
            ["--document-tokens", "1000"],
            "must be a multiple of chunk_size 256",
        ),
        ("remote_url: s3://bkt/kv\nchunk_sise: 3\n", [], "did you mean 'chunk_size'"),
        (
            "remote_url: s3://bkt/kv\nrequest_namespaces: [kvtier-verify]\n",
            ["--api-key-file", "/nonexistent/key"],
            "cannot read --api-key-file: [Errno 2] No such file or directory",
        ),
    ],
)
def test_bad_input_exits_2_with_the_fix(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, extra: list[str], message: str
) -> None:
    assert main([*BASE, "--config", _config(tmp_path, text), *extra]) == 2
    assert message in capsys.readouterr().err


def test_unreachable_server_fails_naming_the_step(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = _config(
        tmp_path,
        f"remote_url: s3://bkt/kv\nrequest_namespaces: [kvtier-verify]\nlocal_disk: {tmp_path}/d\n"
        "max_local_disk_size: 1\nendpoint_url: http://127.0.0.1:9\nblocking_timeout_secs: 1\n",
    )
    out = tmp_path / "r.json"
    assert main([*BASE, "--config", config, "--json", str(out), "--documents", "1"]) == 1
    err = capsys.readouterr().err
    assert "kv_verify: FAILED: step 2 (cold round):" in err
    assert out.exists() and '"ok": false' in out.read_text()


def test_second_verification_of_a_namespace_is_refused_while_one_runs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = _config(tmp_path, "remote_url: s3://bkt/kv\nrequest_namespaces: [kvtier-verify]\n")
    report = tmp_path / "r.json"
    args = [*BASE, "--config", config, "--lock-dir", str(tmp_path), "--json", str(report)]
    with exclusive("kvtier-verify", tmp_path):  # the first verification, still running
        assert main(args) == 2
    err = capsys.readouterr().err
    assert (
        "another kvtier verify of namespace 'kvtier-verify' is running on this host "
        f"(pid {os.getpid()}, lock {tmp_path}/kvtier-verify.kvtier-verify.lock)"
    ) in err
    assert not report.exists()  # refused before anything was sent
    with exclusive("kvtier-verify", tmp_path):  # released when the first one ended
        pass


def test_channel_test_needs_a_profile_unless_skipped(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = _config(tmp_path, "remote_url: s3://bkt/kv\nrequest_namespaces: [kvtier-verify]\n")
    argv = [a for a in BASE if a != "--skip-channel-test"]
    assert main([*argv, "--config", config, "--gateway-dir", str(tmp_path)]) == 2
    assert (
        f"no active gateway profile in {tmp_path} for the channel test: name one with "
        "--gateway-profile (or --gateway-dir), or pass --skip-channel-test"
    ) in capsys.readouterr().err


@pytest.mark.parametrize(
    ("option", "value", "message"),
    [
        ("--output-tokens", "8", "must be >= 32"),
        ("--min-s3-share", "90", "must be a share in (0, 1], got 90"),
    ],
)
def test_values_the_checks_cannot_use_are_refused(
    capsys: pytest.CaptureFixture[str], option: str, value: str, message: str
) -> None:
    with pytest.raises(SystemExit) as exited:
        main([*BASE, option, value])
    assert exited.value.code == 2
    assert message in capsys.readouterr().err
