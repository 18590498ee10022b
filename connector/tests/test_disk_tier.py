"""Disk tier: LRU under a byte cap, restart-safe index, atomic writes, full filesystem."""

from __future__ import annotations

import logging
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvtier.tiers.base import TierError
from kvtier.tiers.disk import DiskTier

KEY = "default/" + "a" * 32 + "/{:032x}"


def _joined(tier: DiskTier, key: str) -> bytes | None:
    item = tier.get(key)
    return None if item is None else item[0] + item[1]


def test_lru_cap_and_restart(tmp_path: Path) -> None:
    tier = DiskTier(str(tmp_path), 3000)
    for i in range(3):
        tier.put(KEY.format(i), b"", bytes([i]) * 1000)
    assert _joined(tier, KEY.format(0)) == b"\0" * 1000  # 0 becomes most recent
    tier.put(KEY.format(3), b"", b"3" * 1000)  # evicts 1
    assert not tier.contains(KEY.format(1))
    assert tier.used_bytes == 3000 and tier.evictions() == 1
    files = sorted(p.name for p in tmp_path.rglob("*.kvt"))
    assert len(files) == 3
    # restart: the index comes back from the files, in LRU order (0 was touched after 2)
    again = DiskTier(str(tmp_path), 3000)
    assert len(again) == 3 and again.used_bytes == 3000
    again.put(KEY.format(4), b"", b"4" * 1000)
    assert not again.contains(KEY.format(2))
    assert again.contains(KEY.format(0))
    # restart with a smaller cap trims at once
    small = DiskTier(str(tmp_path), 1000)
    assert len(small) == 1 and len(list(tmp_path.rglob("*.kvt"))) == 1


def test_leftover_temp_files_are_removed_and_deletes_seen(tmp_path: Path) -> None:
    tier = DiskTier(str(tmp_path), 10_000)
    tier.put(KEY.format(1), b"", b"x" * 10)
    path = Path(tier._path(KEY.format(1)))
    tmp = path.with_name(path.name + ".123.456.tmp")
    tmp.write_bytes(b"partial")
    DiskTier(str(tmp_path), 10_000)
    assert not tmp.exists()
    path.unlink()  # deleted behind the tier's back: a miss, not a stale hit
    assert not tier.contains(KEY.format(1))
    assert tier.get(KEY.format(1)) is None
    assert tier.used_bytes == 0
    with pytest.raises(TierError):
        tier.put("../../etc/passwd", b"", b"x")


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    """A real 4 MiB tmpfs, mounted for the test and removed after it."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    res = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mnt)], capture_output=True, text=True
    )
    if res.returncode != 0:
        pytest.skip(f"cannot mount tmpfs here: {res.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


def test_full_filesystem_evicts_or_skips_never_raises_unexpected(
    small_fs: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # the cap (16 MiB) is larger than the filesystem (4 MiB): ENOSPC must be handled
    tier = DiskTier(str(small_fs), 16 << 20)
    blob = os.urandom(700 * 1024)
    stored = 0
    for i in range(20):
        try:
            tier.put(KEY.format(i), b"", blob)
            stored += 1
        except TierError as exc:  # the store counts this cause; nothing else may escape
            assert exc.cause == "no_space"
    assert stored >= 15  # room was made by evicting the oldest chunks
    assert _joined(tier, KEY.format(19)) == blob
    assert not list(small_fs.rglob("*.tmp"))
    st = os.statvfs(small_fs)
    assert tier.used_bytes <= st.f_blocks * st.f_frsize
    # an external writer fills the disk: the tier still stores by evicting its own files
    filler = small_fs / "filler"
    with open(filler, "wb") as f, pytest.raises(OSError):
        while True:
            f.write(b"\0" * 65536)
            f.flush()
    with caplog.at_level(logging.WARNING, logger="kvtier.tiers.disk"):
        tier.put(KEY.format(99), b"", blob)
    assert _joined(tier, KEY.format(99)) == blob
    # ...and says so, though the retry succeeded: the operator's cap is above what is free
    assert f"disk tier {small_fs} is full (No space left)" in caplog.text
    # a blob larger than the free space even after evicting everything: skipped, clear cause
    tier2 = DiskTier(str(small_fs / "other"), 64 << 20)
    with pytest.raises(TierError) as err:
        tier2.put(KEY.format(1), b"", os.urandom(8 << 20))
    assert err.value.cause == "no_space"
    assert not list(small_fs.rglob("*.tmp"))


def test_a_tool_opening_the_directory_changes_nothing(tmp_path: Path) -> None:
    """kvtier ls / purge open the disk tier beside a running server: its temp files (writes in
    progress) stay, and a cap below what is stored evicts nothing."""
    tier = DiskTier(str(tmp_path), 1 << 20)
    for i in range(4):
        tier.put(f"ns/{'ab' * 16}/{i:032x}", b"h" * 64, b"p" * 1000)
    tmp = tmp_path / "ns" / ("ab" * 16) / "00" / "x.kvt.1.2.tmp"
    tmp.write_bytes(b"half")
    view = DiskTier(str(tmp_path), 100, maintain=False)
    assert tmp.exists() and len(view) == 4
    DiskTier(str(tmp_path), 100)  # a server's start: cleans up and evicts down to its cap
    assert not tmp.exists() and len(list(tmp_path.rglob("*.kvt"))) == 0


def test_tensor_parallel_ranks_sharing_a_directory_keep_their_own_chunks(tmp_path: Path) -> None:
    """Each rank (its own layout fingerprint) indexes and evicts only its own chunks, and keeps
    them across restarts; a scheduler that only looks up evicts nothing. Before, every process
    evicted the whole directory down to its own cap at start: 96 files became 67 at a TP 2
    restart."""
    fp0, fp1, old = "0" * 32, "1" * 32, "f" * 32
    rank0 = DiskTier(str(tmp_path), 3000, peers=frozenset({fp1}))
    rank1 = DiskTier(str(tmp_path), 3000, peers=frozenset({fp0}))
    for i in range(3):
        rank0.put(f"default/{fp0}/{i:032x}", b"", b"0" * 1000)
        rank1.put(f"default/{fp1}/{i:032x}", b"", b"1" * 1000)
    assert len(list(tmp_path.rglob("*.kvt"))) == 6
    # A peer's file read by this rank is not adopted into its index (it would evict it).
    assert rank0.get(f"default/{fp1}/{0:032x}") is not None and len(rank0) == 3
    # Restart: the scheduler's look-up-only tier and both ranks again; nothing is lost.
    DiskTier(str(tmp_path), 1000, maintain=False)
    again0 = DiskTier(str(tmp_path), 3000, peers=frozenset({fp1}))
    again1 = DiskTier(str(tmp_path), 3000, peers=frozenset({fp0}))
    assert len(again0) == len(again1) == 3
    assert len(list(tmp_path.rglob("*.kvt"))) == 6
    # A layout of no live rank (an earlier configuration) is the ranks' to evict.
    DiskTier(str(tmp_path), 10_000).put(f"default/{old}/{0:032x}", b"", b"x" * 1000)
    (stale,) = tmp_path.rglob(f"{old}/*/*.kvt")
    os.utime(stale, (1, 1))  # least recently used
    assert len(DiskTier(str(tmp_path), 3000, peers=frozenset({fp1}))) == 3
    assert not stale.exists()
    assert len(list(tmp_path.rglob(f"{fp1}/*/*.kvt"))) == 3
