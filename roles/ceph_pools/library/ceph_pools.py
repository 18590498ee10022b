#!/usr/bin/python3
# Copyright: kvtier contributors. Apache-2.0.
"""Ansible module: make replicated Ceph pools match a declared list, touching only what differs."""

from __future__ import annotations

import json
from typing import Any

from ansible.module_utils.basic import AnsibleModule

DOCUMENTATION = r"""
---
module: ceph_pools
short_description: Create replicated Ceph pools and adjust only the settings that differ
description:
  - Reads all pools in one C(ceph osd pool ls detail) call, then creates missing pools and sets
    pg_autoscale_mode, size, min_size, pg_num and the application where they differ.
  - Pools that are not listed are never touched. Nothing is ever deleted.
  - Supports check mode (reports the commands it would run).
options:
  pools:
    description: Pools; each a dict with name, pg_num and optional size, min_size,
      pg_autoscale_mode, application.
    type: list
    elements: dict
    required: true
  defaults:
    description: size, min_size, pg_autoscale_mode and application for pools that omit them.
    type: dict
    required: true
  pg_overrides:
    description: pg_num per pool name, applied over I(pools).
    type: dict
    default: {}
  connect_timeout:
    description: Seconds the ceph CLI waits for the cluster.
    type: int
    default: 30
"""

RETURN = r"""
commands:
  description: The ceph commands run (or, in check mode, that would run).
  type: list
  elements: str
pg_num_total:
  description: Sum of pg_num over every pool of the cluster after the change (for waiting on PGs).
  type: int
"""

REPLICATED = 1  # pg_pool_t::TYPE_REPLICATED in `ceph osd pool ls detail -f json`


class CephPools:
    def __init__(self, module: AnsibleModule) -> None:
        self.module = module
        self.timeout = str(module.params["connect_timeout"])
        self.commands: list[str] = []

    def ceph(self, *args: str, read_only: bool = False) -> str:
        argv = ["ceph", "--connect-timeout", self.timeout, *args]
        if not read_only:
            self.commands.append(" ".join(args))
            if self.module.check_mode:
                return ""
        rc, out, err = self.module.run_command(argv)
        if rc != 0:
            self.module.fail_json(
                msg=f"`ceph {' '.join(args)}` failed (rc={rc}): {err.strip() or out.strip()}",
                commands=self.commands,
            )
        return str(out)

    def current(self) -> dict[str, dict[str, Any]]:
        out = self.ceph("osd", "pool", "ls", "detail", "--format", "json", read_only=True)
        pools = json.loads(out)
        return {p["pool_name"]: p for p in pools}

    def desired(self) -> list[dict[str, Any]]:
        defaults = self.module.params["defaults"]
        overrides = self.module.params["pg_overrides"]
        out = []
        for pool in self.module.params["pools"]:
            want = {
                k: pool.get(k, defaults.get(k))
                for k in ("size", "min_size", "pg_autoscale_mode", "application")
            }
            want["name"] = pool["name"]
            want["pg_num"] = int(overrides.get(pool["name"], pool["pg_num"]))
            out.append(want)
        return out

    def create(self, name: str, pg: str, autoscale_mode: str) -> None:
        argv = ["osd", "pool", "create", name, pg, pg, "replicated"]
        argv.append(f"--autoscale-mode={autoscale_mode}")
        self.ceph(*argv)
        if self.module.check_mode or name in self.current():
            return
        # Ceph 18 (Reef) refuses a name that starts with "." unless confirmed, yet exits 0 (it
        # only prints "pool names beginning with . are not allowed"): RGW's own .rgw.root is
        # one. Ceph 16 creates it at the first command.
        if name.startswith("."):
            self.ceph(*argv, "--yes-i-really-mean-it")
        if name not in self.current():
            self.module.fail_json(
                msg=f"`ceph osd pool create {name}` exited 0 but the cluster has no pool {name}",
                commands=self.commands,
            )

    def ensure(self, want: dict[str, Any], have: dict[str, Any] | None) -> None:
        name = want["name"]
        if have is None:
            self.create(name, str(want["pg_num"]), want["pg_autoscale_mode"])
            have = {
                "size": None,
                "min_size": None,
                "pg_autoscale_mode": want["pg_autoscale_mode"],
                "pg_num": want["pg_num"],
                "application_metadata": {},
                "type": REPLICATED,
            }
        if have.get("type") != REPLICATED:
            self.module.fail_json(
                msg=f"Pool {name} exists but is not replicated; ceph_pools manages replicated "
                "pools only. Remove it from ceph_pools_pools or recreate it as replicated."
            )
        # Autoscaler first, so it cannot undo the pg_num set below.
        if have.get("pg_autoscale_mode") != want["pg_autoscale_mode"]:
            self.ceph("osd", "pool", "set", name, "pg_autoscale_mode", want["pg_autoscale_mode"])
        # size before min_size: min_size may not exceed size.
        if have.get("size") != want["size"]:
            self.ceph(
                "osd", "pool", "set", name, "size", str(want["size"]), "--yes-i-really-mean-it"
            )
        if have.get("min_size") != want["min_size"]:
            self.ceph("osd", "pool", "set", name, "min_size", str(want["min_size"]))
        # pg_num moves towards pg_num_target in steps; the target is what was asked for.
        pg_now = have.get("pg_num_target", have.get("pg_num"))
        if pg_now != want["pg_num"]:
            self.ceph("osd", "pool", "set", name, "pg_num", str(want["pg_num"]))
        if want["application"] not in (have.get("application_metadata") or {}):
            self.ceph("osd", "pool", "application", "enable", name, want["application"])


def main() -> None:
    module = AnsibleModule(
        argument_spec={
            "pools": {"type": "list", "elements": "dict", "required": True},
            "defaults": {"type": "dict", "required": True},
            "pg_overrides": {"type": "dict", "default": {}},
            "connect_timeout": {"type": "int", "default": 30},
        },
        supports_check_mode=True,
    )
    pools = CephPools(module)
    have = pools.current()
    for want in pools.desired():
        pools.ensure(want, have.get(want["name"]))
    after = pools.current() if pools.commands and not module.check_mode else have
    module.exit_json(
        changed=bool(pools.commands),
        commands=pools.commands,
        pg_num_total=sum(int(p.get("pg_num_target", p["pg_num"])) for p in after.values()),
    )


if __name__ == "__main__":
    main()
