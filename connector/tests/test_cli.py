"""`kvtier doctor | ls | stats | purge` on a disk-only store (no service needed)."""

from __future__ import annotations

from pathlib import Path

import pytest
from _helpers import FINGERPRINT, chunks

from kvtier.config import load_config
from kvtier.store import TieredStore
from kvtier_tools.admin.cli import cmd_purge
from kvtier_tools.cli import build_parser, main


@pytest.fixture
def disk_config(tmp_path: Path) -> Path:
    path = tmp_path / "kvtier.yaml"
    path.write_text(f"local_disk: {tmp_path / 'disk'}\nmax_local_disk_size: 0.1\nnamespace: t1\n")
    with TieredStore.from_config(load_config(path), FINGERPRINT) as store:
        for h, p in chunks(3, size=1000):
            store.put(h, p, 256)
        store.get(chunks(1, size=10)[0][0])  # a hit (same hash: seed 0)
        store.get("f" * 32)  # a miss
    return path


def test_doctor_disk_only_and_config_error(
    disk_config: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["doctor", "--config", str(disk_config)]) == 0
    out = capsys.readouterr().out
    assert "[ok  ] disk:" in out and "2 ok, 0 failed" in out
    bad = tmp_path / "bad.yaml"
    bad.write_text("chunk_sise: 1\n")
    assert main(["doctor", "--config", str(bad)]) == 1
    assert (
        f"unknown key 'chunk_sise' in {bad}; did you mean 'chunk_size'?" in capsys.readouterr().out
    )


def test_ls_and_stats(disk_config: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["ls", "--config", str(disk_config)]) == 0
    out = capsys.readouterr().out
    assert f"t1/{FINGERPRINT}\t3 chunks" in out
    assert main(["ls", "--config", str(disk_config), "-l"]) == 0
    assert len(capsys.readouterr().out.splitlines()) == 3
    assert main(["stats", "--config", str(disk_config)]) == 0
    out = capsys.readouterr().out
    assert "gets 2: 1 served; puts 3" in out
    assert main(["stats", "--config", str(disk_config), "--json"]) == 0
    assert '"puts": 3' in capsys.readouterr().out


def test_purge_asks_unless_yes(disk_config: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = build_parser().parse_args(["purge", "--config", str(disk_config)])
    assert cmd_purge(args, confirm=lambda _q: "n") == 1
    assert "aborted" in capsys.readouterr().out
    # no terminal and no --yes: refuse rather than delete
    assert main(["purge", "--config", str(disk_config)]) == 2
    assert "without --yes" in capsys.readouterr().err
    assert main(["purge", "--config", str(disk_config), "--namespace", "other", "--yes"]) == 0
    assert "nothing to purge" in capsys.readouterr().out
    assert cmd_purge(args, confirm=lambda _q: "y") == 0
    assert "disk: deleted 3 chunks" in capsys.readouterr().out
    assert not list((disk_config.parent / "disk").rglob("*.kvt"))
