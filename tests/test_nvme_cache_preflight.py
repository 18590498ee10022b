"""The nvme_cache role never formats a device that carries someone else's data.

Runs the real playbook (playbooks/cache_disks.yml) against a real block device: a loop device
over a small sparse file, with a foreign ext4 filesystem on it. Without `nvme_cache_force` the
run stops in preflight with a message that names the variable, and the filesystem is intact;
with it, the device is wiped, partitioned, formatted, mounted and put into fstab, a second run
changes nothing, and the teardown playbook removes all of it. Needs root (loop devices, mount).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from _ansible import run_playbook

FSTAB = Path("/etc/fstab")

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("losetup") is None, reason="needs root and losetup"
)


def _run(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, check=False, timeout=120)


def _playbook(
    playbook: str, extra_vars: dict[str, object], *args: str
) -> subprocess.CompletedProcess[str]:
    return run_playbook(playbook, extra_vars, *args, timeout=600)


def _blkid(device: str) -> dict[str, str]:
    probe = _run("blkid", "-p", "-o", "export", device)
    return dict(line.split("=", 1) for line in probe.stdout.splitlines() if "=" in line)


def _fstab_lines(mount_path: Path) -> list[str]:
    return [line for line in FSTAB.read_text().splitlines() if f" {mount_path} " in f"{line} "]


@pytest.fixture
def foreign_device(tmp_path: Path) -> Iterator[str]:
    """A 400 MiB loop device holding someone else's ext4 filesystem."""
    image = tmp_path / "foreign.img"
    _run("truncate", "--size", "400M", str(image))
    device = _run("losetup", "--find", "--show", "--partscan", str(image)).stdout.strip()
    assert device.startswith("/dev/loop"), "no free loop device"
    _run("mkfs.ext4", "-q", "-L", "foreign", device)
    yield device
    # Safety net when a test failed half-way; the teardown playbook normally did all of this.
    mount_path = tmp_path / "disk"
    _run("umount", str(mount_path))
    if _fstab_lines(mount_path):
        kept = [
            line for line in FSTAB.read_text().splitlines() if line not in _fstab_lines(mount_path)
        ]
        FSTAB.write_text("\n".join(kept) + "\n")
    _run("losetup", "--detach", device)


@pytest.fixture
def shared_disk(tmp_path: Path) -> Iterator[str]:
    """A 400 MiB disk: partition 1 holds someone's ext4, partition 2 is free for the cache."""
    image = tmp_path / "shared.img"
    _run("truncate", "--size", "400M", str(image))
    device = _run("losetup", "--find", "--show", "--partscan", str(image)).stdout.strip()
    assert device.startswith("/dev/loop"), "no free loop device"
    _run("parted", "-s", device, "mklabel", "gpt", "mkpart", "data", "1MiB", "40MiB")
    _run("parted", "-s", device, "mkpart", "spare", "40MiB", "100%")
    _run("mkfs.ext4", "-q", "-L", "userdata", f"{device}p1")
    yield device
    _run("umount", str(tmp_path / "disk"))
    _run("losetup", "--detach", device)


def _vars(device: str, tmp_path: Path, **extra: object) -> dict[str, object]:
    return {
        "nvme_cache_backing": "device",
        "nvme_cache_device": device,
        "nvme_cache_mount_path": str(tmp_path / "disk"),
        # Users that exist on every Debian host: the test does not depend on other roles.
        "nvme_cache_owner": "nobody",
        "nvme_cache_group": "nogroup",
        **extra,
    }


def test_device_with_a_filesystem_is_refused_in_preflight(
    foreign_device: str, tmp_path: Path
) -> None:
    run = _playbook("playbooks/cache_disks.yml", _vars(foreign_device, tmp_path))

    assert run.returncode != 0
    assert (
        f"nvme_cache_device {foreign_device} is not empty: {foreign_device} carries an ext4 "
        "signature labelled 'foreign'. kvtier refuses to overwrite it." in run.stdout
    )
    assert "set nvme_cache_force: true for one run to WIPE it" in run.stdout
    # Stopped before any change: nothing partitioned, formatted or mounted.
    assert "Device carries nothing foreign" in run.stdout
    assert "changed=0" in run.stdout
    assert _blkid(foreign_device).get("LABEL") == "foreign"
    assert not (tmp_path / "disk").is_mount()


def test_forced_device_is_formatted_mounted_and_torn_down(
    foreign_device: str, tmp_path: Path
) -> None:
    mount_path = tmp_path / "disk"
    forced = _playbook(
        "playbooks/cache_disks.yml", _vars(foreign_device, tmp_path, nvme_cache_force=True)
    )
    assert forced.returncode == 0, forced.stdout[-3000:]

    partition = f"{foreign_device}p1"
    fs = _blkid(partition)
    assert (fs.get("TYPE"), fs.get("LABEL"), fs.get("PART_ENTRY_NAME")) == (
        "xfs",
        "kvtier-cache",
        "kvtier-cache",
    )
    findmnt = _run("findmnt", "--noheadings", "--output", "SOURCE,FSTYPE,OPTIONS", str(mount_path))
    source, fstype, options = findmnt.stdout.split()
    assert (source, fstype) == (partition, "xfs")
    assert "noatime" in options.split(",")
    assert _fstab_lines(mount_path) == [f"UUID={fs['UUID']} {mount_path} xfs noatime,nofail 0 0"]
    stat = mount_path.stat()
    assert (stat.st_uid, oct(stat.st_mode & 0o777)) == (
        int(_run("id", "-u", "nobody").stdout),
        "0o750",
    )

    # Now ours: accepted without force, and nothing changes.
    again = _playbook("playbooks/cache_disks.yml", _vars(foreign_device, tmp_path))
    assert again.returncode == 0, again.stdout[-3000:]
    assert "changed=0" in again.stdout

    # Only the disk tier's teardown: the gateway profile of the deployed site stays.
    teardown = _playbook(
        "playbooks/teardown_host.yml", _vars(foreign_device, tmp_path), "--tags", "nvme_cache"
    )
    assert teardown.returncode == 0, teardown.stdout[-3000:]
    assert not mount_path.exists()
    assert _fstab_lines(mount_path) == []
    assert _blkid(foreign_device) == {}


def test_free_partition_next_to_foreign_one_is_used_and_neighbour_kept(
    shared_disk: str, tmp_path: Path
) -> None:
    mount_path = tmp_path / "disk"
    cache_partition = f"{shared_disk}p2"
    run = _playbook("playbooks/cache_disks.yml", _vars(cache_partition, tmp_path))
    assert run.returncode == 0, run.stdout[-3000:]
    assert _blkid(cache_partition)["LABEL"] == "kvtier-cache"
    assert mount_path.is_mount()

    teardown = _playbook(
        "playbooks/teardown_host.yml", _vars(cache_partition, tmp_path), "--tags", "nvme_cache"
    )
    assert teardown.returncode == 0, teardown.stdout[-3000:]
    assert not mount_path.exists()
    assert _fstab_lines(mount_path) == []
    assert "TYPE" not in _blkid(cache_partition)  # filesystem wiped, partition entry kept
    assert _blkid(f"{shared_disk}p1")["LABEL"] == "userdata"
