#!/usr/bin/python3
# Copyright: kvtier contributors. Apache-2.0.
"""Ansible module: tell whether a block device is empty, already ours, or someone else's."""

from __future__ import annotations

import os
import shlex
import stat
from typing import Any

from ansible.module_utils.basic import AnsibleModule

DOCUMENTATION = r"""
---
module: nvme_cache_device_info
short_description: Classify a block device for the kvtier disk tier (empty, ours, foreign)
description:
  - Read-only. Probes signatures with C(blkid -p) and partition tables with C(partx --pairs), both
    in user space (no udev needed), and the kernel's partitions and mounts with C(lsblk).
  - A whole device (disk, loop, md) is I(ours) when it holds a GPT with exactly one partition
    named I(label). A partition given directly is I(ours) when its filesystem label is I(label).
  - Anything else with a signature (a filesystem, a partition table, a RAID or LVM member) is
    I(foreign); the reason names what was found.
options:
  device:
    description: Whole device or partition, e.g. /dev/nvme1n1, /dev/nvme1n1p3, /dev/loop3.
    type: path
    required: true
  label:
    description: GPT partition name and filesystem label that mark the device as ours.
    type: str
    required: true
  mount_path:
    description: Where the disk tier is mounted; being mounted there is not "in use".
    type: path
    required: true
"""

RETURN = r"""
state:
  description: empty, ours or foreign.
  type: str
reason:
  description: What makes the device foreign (empty otherwise).
  type: str
whole_device:
  description: True when the role partitions the device itself; false for a partition.
  type: bool
partition:
  description: Path of the partition that holds (or will hold) the filesystem, if it exists yet.
  type: str
fstype:
  description: Filesystem type found on that partition ('' if none).
  type: str
uuid:
  description: Filesystem UUID on that partition ('' if none).
  type: str
partitions:
  description: Partitions of a whole device as the kernel lists them (wiped by force or teardown).
  type: list
  elements: str
unscanned_partitions:
  description: The table lists partitions the kernel does not (C(partx --add) fixes that).
  type: bool
mounted_elsewhere:
  description: Mount points of the device or its partitions other than mount_path.
  type: list
  elements: str
"""


def _blkid(module: AnsibleModule, path: str) -> dict[str, str]:
    """Low-level probe of one device (-p bypasses the blkid cache); {} when it carries nothing."""
    rc, out, err = module.run_command(["blkid", "-p", "-o", "export", path])
    if rc == 2:  # nothing found
        return {}
    if rc != 0:
        module.fail_json(msg=f"blkid -p {path} failed (rc {rc}): {err.strip()}")
    found = dict(line.split("=", 1) for line in out.splitlines() if "=" in line)
    # A partition always reports its own table entry (PART_ENTRY_*): that is not content.
    return {
        key: value
        for key, value in found.items()
        if key != "DEVNAME" and not key.startswith("PART_ENTRY_")
    }


def _lsblk(module: AnsibleModule, device: str) -> list[dict[str, str]]:
    """The device and its partitions, as the kernel sees them, with their mount points."""
    rc, out, err = module.run_command(
        ["lsblk", "--list", "--noheadings", "--paths", "--output", "NAME,TYPE,MOUNTPOINT", device]
    )
    if rc != 0:
        module.fail_json(msg=f"lsblk {device} failed (rc {rc}): {err.strip()}")
    rows = []
    for line in out.splitlines():
        fields = line.split(None, 2)
        if len(fields) >= 2:
            rows.append(
                {"name": fields[0], "type": fields[1], "mountpoint": "".join(fields[2:]).strip()}
            )
    return rows


def _table(module: AnsibleModule, device: str) -> list[dict[str, str]]:
    """Partitions as written in the table, read in user space (independent of the kernel)."""
    rc, out, _err = module.run_command(["partx", "--pairs", "--output", "NR,NAME", device])
    if rc != 0:
        return []
    return [dict(item.split("=", 1) for item in shlex.split(line)) for line in out.splitlines()]


def _describe(signature: dict[str, str]) -> str:
    if "PTTYPE" in signature:
        return f"a {signature['PTTYPE']} partition table"
    kind = signature.get("TYPE", "unknown")
    label = f" labelled '{signature['LABEL']}'" if signature.get("LABEL") else ""
    return f"a{'n' if kind[:1] in 'aeiou' else ''} {kind} signature{label}"


def classify(module: AnsibleModule, device: str, label: str, mount_path: str) -> dict[str, Any]:
    rows = _lsblk(module, device)
    if not rows:
        module.fail_json(msg=f"lsblk does not list {device}")
    whole_device = rows[0]["type"] != "part"
    children = [row for row in rows[1:] if row["type"] == "part"]
    mounted_elsewhere = sorted(
        row["mountpoint"]
        for row in rows
        if row["mountpoint"] and os.path.realpath(row["mountpoint"]) != os.path.realpath(mount_path)
    )
    signature = _blkid(module, device)
    result: dict[str, Any] = {
        "state": "empty",
        "reason": "",
        "whole_device": whole_device,
        "partition": "",
        "fstype": "",
        "uuid": "",
        "partitions": [row["name"] for row in children],
        "unscanned_partitions": False,
        "mounted_elsewhere": mounted_elsewhere,
    }

    if not whole_device:
        if not signature:
            result["partition"] = device
        elif signature.get("TYPE") and signature.get("LABEL") == label:
            result.update(partition=device, state="ours", fstype=signature["TYPE"])
            result["uuid"] = signature.get("UUID", "")
        else:
            result.update(state="foreign", reason=f"{device} carries {_describe(signature)}")
        return result

    if not signature and not children:
        return result
    table = _table(module, device) if "PTTYPE" in signature else []
    # Kernels built without partition table parsers (Firecracker VMs, some CI machines) list no
    # partitions after `losetup -P` or a reboot: the role then adds them with `partx --add`.
    result["unscanned_partitions"] = len(table) > len(children)
    child_signatures = {row["name"]: _blkid(module, row["name"]) for row in children}
    if signature.get("PTTYPE") == "gpt" and len(table) == 1 and table[0].get("NAME") == label:
        result["state"] = "ours"
        if children:
            part, part_signature = next(iter(child_signatures.items()))
            result.update(partition=part, fstype=part_signature.get("TYPE", ""))
            result["uuid"] = part_signature.get("UUID", "")
        return result
    found = [f"{device} carries {_describe(signature)}"] if signature else []
    found += [
        f"partition {entry.get('NR', '?')} named '{entry.get('NAME', '')}'"
        for entry in table
        if not children
    ]
    found += [
        f"partition {part} ({_describe(sig) if sig.get('TYPE') else 'no filesystem'})"
        for part, sig in child_signatures.items()
    ]
    result.update(state="foreign", reason="; ".join(found))
    return result


def main() -> None:
    module = AnsibleModule(
        argument_spec={
            "device": {"type": "path", "required": True},
            "label": {"type": "str", "required": True},
            "mount_path": {"type": "path", "required": True},
        },
        supports_check_mode=True,
    )
    device = module.params["device"]
    try:
        mode = os.stat(device).st_mode
    except OSError as exc:
        module.fail_json(msg=f"nvme_cache_device {device} does not exist: {exc.strerror}")
    if not stat.S_ISBLK(mode):
        module.fail_json(msg=f"nvme_cache_device {device} is not a block device")
    result = classify(module, device, module.params["label"], module.params["mount_path"])
    module.exit_json(changed=False, **result)


if __name__ == "__main__":
    main()
