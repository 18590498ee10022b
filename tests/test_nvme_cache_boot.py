"""The disk tier at boot on a systemd host with loop backing: the nvme_cache role writes a unit
whose script attaches the loop file and mounts the partition it formatted, checked by UUID.

This host has no systemd as PID 1, so the script (rendered by the role's own template) runs
here on real loop devices and a real xfs, in the states a boot can find: the file not attached
(a host reboot), attached but not mounted (a container's reboot: the host's loop device
survives it), already mounted (the role's own run, or a restart of the unit), and the wrong
file system or another mount in the way. The unit is judged by `systemd-analyze verify`."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from _ansible import run_playbook

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("mkfs.xfs") is None or shutil.which("parted") is None,
    reason="needs root (loop devices, mount), mkfs.xfs and parted",
)


def sh(*argv: str) -> str:
    return subprocess.run(argv, check=True, capture_output=True, text=True, timeout=60).stdout


def attached(image: Path) -> list[str]:
    return sh("losetup", "--noheadings", "--output", "NAME", "--associated", str(image)).split()


def mounted_source(path: Path) -> str:
    done = subprocess.run(
        ["findmnt", "--noheadings", "--output", "SOURCE", "--mountpoint", str(path)],
        capture_output=True,
        text=True,
        timeout=30,
    )
    return done.stdout.strip()


def make_disk_tier(image: Path, label: str = "kvtier-cache") -> str:
    """A sparse file with one GPT partition holding an xfs, as the role leaves it (detached);
    returns the file system's UUID."""
    with image.open("wb") as f:
        f.truncate(400 * 2**20)
    sh("parted", "--script", str(image), "mklabel", "gpt", "mkpart", label, "1MiB", "100%")
    dev = sh("losetup", "--find", "--show", "--partscan", str(image)).strip()
    try:
        if not Path(f"{dev}p1").exists():
            sh("partx", "--add", dev)  # a kernel that does not parse the table on attach
        sh("mkfs.xfs", "-q", "-L", label, f"{dev}p1")
        return sh(
            "blkid", "--probe", "--match-tag", "UUID", "--output", "value", f"{dev}p1"
        ).strip()
    finally:
        sh("losetup", "--detach", dev)


def render(dest: Path, **variables: str) -> Path:
    done = run_playbook(
        "tests/playbooks/render_nvme_cache_boot.yml",
        {"nvme_cache_test_dest": str(dest), **variables},
        timeout=120,
    )
    assert done.returncode == 0, done.stdout[-3000:]
    return dest / "attach.sh"


@pytest.fixture
def disk(tmp_path: Path) -> Iterator[dict[str, Path | str]]:
    image = tmp_path / "cache.img"
    mount_path = tmp_path / "disk"
    mount_path.mkdir()
    uuid = make_disk_tier(image)
    yield {"image": image, "mount_path": mount_path, "uuid": uuid}
    while mounted_source(mount_path):
        sh("umount", str(mount_path))
    for dev in attached(image):
        sh("losetup", "--detach", dev)


def boot(script: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(script)], capture_output=True, text=True, timeout=60)


def test_a_boot_attaches_the_loop_file_and_mounts_its_partition(
    disk: dict[str, Path | str], tmp_path: Path
) -> None:
    image, mount_path = Path(disk["image"]), Path(disk["mount_path"])
    script = render(
        tmp_path,
        nvme_cache_loop_file=str(image),
        nvme_cache_mount_path=str(mount_path),
        _nvme_cache_uuid=str(disk["uuid"]),
    )
    assert attached(image) == []  # as after a reboot of the host
    first = boot(script)
    assert first.returncode == 0, first.stderr
    [dev] = attached(image)
    assert mounted_source(mount_path) == f"{dev}p1", first.stdout
    (mount_path / "chunk").write_bytes(b"kv")
    # Mounted already (the role's own run, a restart of the unit): nothing more.
    again = boot(script)
    assert again.returncode == 0 and again.stdout == "", again.stderr
    assert attached(image) == [dev]
    # A container's reboot: the host's loop device stays attached, the mount is gone, and the
    # container's /dev has no node for the partition (no devtmpfs, no udev).
    sh("umount", str(mount_path))
    Path(f"{dev}p1").unlink()
    after = boot(script)
    assert after.returncode == 0, after.stderr
    assert attached(image) == [dev] and mounted_source(mount_path) == f"{dev}p1"
    assert Path(f"{dev}p1").is_block_device()
    assert (mount_path / "chunk").read_bytes() == b"kv"


def test_a_file_system_that_is_not_the_roles_is_never_mounted(
    disk: dict[str, Path | str], tmp_path: Path
) -> None:
    image, mount_path = Path(disk["image"]), Path(disk["mount_path"])
    script = render(
        tmp_path,
        nvme_cache_loop_file=str(image),
        nvme_cache_mount_path=str(mount_path),
        _nvme_cache_uuid="00000000-0000-0000-0000-000000000000",
    )
    done = boot(script)
    assert done.returncode == 1
    assert f"holds filesystem UUID '{disk['uuid']}', not 00000000-" in done.stderr
    assert mounted_source(mount_path) == ""


def test_another_mount_on_the_path_is_left_alone(
    disk: dict[str, Path | str], tmp_path: Path
) -> None:
    image, mount_path = Path(disk["image"]), Path(disk["mount_path"])
    script = render(
        tmp_path,
        nvme_cache_loop_file=str(image),
        nvme_cache_mount_path=str(mount_path),
        _nvme_cache_uuid=str(disk["uuid"]),
    )
    sh("mount", "--types", "tmpfs", "--options", "size=1m", "other", str(mount_path))
    done = boot(script)
    assert done.returncode == 1
    assert f"{mount_path} already has other mounted on it" in done.stderr
    assert mounted_source(mount_path) == "other"


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="needs systemd-analyze")
def test_the_unit_is_valid_for_systemd(tmp_path: Path) -> None:
    image = tmp_path / "cache.img"
    image.touch()
    render(
        tmp_path,
        nvme_cache_loop_file=str(image),
        nvme_cache_mount_path="/var/cache/kvtier/disk",
        _nvme_cache_uuid="00000000-0000-0000-0000-000000000000",
        _nvme_cache_boot_script=str(tmp_path / "attach.sh"),
    )
    unit = tmp_path / "kvtier-disk-tier.service"
    text = unit.read_text()
    assert f"ExecStart={tmp_path}/attach.sh" in text and "WantedBy=multi-user.target" in text
    done = subprocess.run(
        ["systemd-analyze", "verify", "--man=no", str(unit)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0 and not (done.stdout + done.stderr).strip(), done.stderr
