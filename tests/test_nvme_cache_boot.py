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
from dataclasses import dataclass
from pathlib import Path

import pytest
from _ansible import run_playbook, systemd_verify_errors

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


def partition_node(dev: str) -> Path:
    """The node of ``dev``'s first partition, with the kernel's numbers: this host has no udev,
    so a node left by an earlier device of that name may name another device now."""
    sysfs = Path(f"/sys/class/block/{Path(dev).name}p1")
    if not sysfs.exists():
        sh("partx", "--add", dev)  # a kernel that does not parse the table on attach
    want = (sysfs / "dev").read_text().strip()
    node = Path(f"{dev}p1")
    if node.exists() and sh("stat", "--format", "%Hr:%Lr", str(node)).strip() != want:
        node.unlink()
    if not node.exists():
        sh("mknod", str(node), "b", *want.split(":"))
    return node


def detach(dev: str) -> None:
    """Detach a loop device and drop its partition's node, as udev would (this host has none:
    the node would stay, and a later test's attach could find it with other numbers)."""
    sh("losetup", "--detach", dev)
    Path(f"{dev}p1").unlink(missing_ok=True)


def make_disk_tier(image: Path, label: str = "kvtier-cache") -> str:
    """A sparse file with one GPT partition holding an xfs, as the role leaves it (detached);
    returns the file system's UUID."""
    with image.open("wb") as f:
        f.truncate(400 * 2**20)
    sh("parted", "--script", str(image), "mklabel", "gpt", "mkpart", label, "1MiB", "100%")
    dev = sh("losetup", "--find", "--show", "--partscan", str(image)).strip()
    try:
        partition_node(dev)
        sh("mkfs.xfs", "-q", "-L", label, f"{dev}p1")
        return sh(
            "blkid", "--probe", "--match-tag", "UUID", "--output", "value", f"{dev}p1"
        ).strip()
    finally:
        detach(dev)


def render(dest: Path, **variables: str) -> Path:
    done = run_playbook(
        "tests/playbooks/render_nvme_cache_boot.yml",
        {"nvme_cache_test_dest": str(dest), **variables},
        timeout=120,
    )
    assert done.returncode == 0, done.stdout[-3000:]
    return dest / "attach.sh"


@dataclass
class Disk:
    """A disk tier as the role leaves it (detached), and where the boot script mounts it."""

    image: Path
    mount_path: Path
    uuid: str
    scripts: Path

    def boot_script(self, uuid: str | None = None) -> Path:
        """The role's boot script for this disk tier, expecting ``uuid`` (default: its own)."""
        return render(
            self.scripts,
            nvme_cache_loop_file=str(self.image),
            nvme_cache_mount_path=str(self.mount_path),
            _nvme_cache_uuid=uuid or self.uuid,
        )


@pytest.fixture
def disk(tmp_path: Path) -> Iterator[Disk]:
    image = tmp_path / "cache.img"
    mount_path = tmp_path / "disk"
    mount_path.mkdir()
    yield Disk(image, mount_path, make_disk_tier(image), tmp_path)
    while mounted_source(mount_path):
        sh("umount", str(mount_path))
    for dev in attached(image):
        detach(dev)


def boot(script: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(script)], capture_output=True, text=True, timeout=60)


def test_a_boot_attaches_the_loop_file_and_mounts_its_partition(disk: Disk) -> None:
    image, mount_path, script = disk.image, disk.mount_path, disk.boot_script()
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


def test_a_partition_node_with_other_numbers_is_made_again(disk: Disk) -> None:
    """A host without udev keeps a detached device's partition node: if its numbers are not the
    kernel's for this partition now, the script makes it again (never mounts what it names)."""
    image, mount_path, script = disk.image, disk.mount_path, disk.boot_script()
    dev = sh("losetup", "--find", "--show", str(image)).strip()
    sh("partx", "--add", dev)
    want = Path(f"/sys/class/block/{Path(dev).name}p1/dev").read_text().strip()
    node = Path(f"{dev}p1")
    node.unlink(missing_ok=True)
    sh("mknod", str(node), "b", "7", "0")  # stale: another device's numbers (loop0)
    done = boot(script)
    assert done.returncode == 0, done.stderr
    assert mounted_source(mount_path) == str(node)
    assert sh("stat", "--format", "%Hr:%Lr", str(node)).strip() == want


def test_a_file_system_that_is_not_the_roles_is_never_mounted(disk: Disk) -> None:
    done = boot(disk.boot_script(uuid="00000000-0000-0000-0000-000000000000"))
    assert done.returncode == 1
    assert f"holds filesystem UUID '{disk.uuid}', not 00000000-" in done.stderr
    assert mounted_source(disk.mount_path) == ""


def test_another_mount_on_the_path_is_left_alone(disk: Disk) -> None:
    script = disk.boot_script()
    sh("mount", "--types", "tmpfs", "--options", "size=1m", "other", str(disk.mount_path))
    done = boot(script)
    assert done.returncode == 1
    assert f"{disk.mount_path} already has other mounted on it" in done.stderr
    assert mounted_source(disk.mount_path) == "other"


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
    assert systemd_verify_errors(unit) == ""
