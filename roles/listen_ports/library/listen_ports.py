#!/usr/bin/python3
# Copyright: kvtier contributors. Apache-2.0.
"""Ansible module: which processes other than a role's own listen on the TCP ports it binds."""

from __future__ import annotations

import ipaddress
import os
import pwd
import re
import socket
from typing import Any

from ansible.module_utils.basic import AnsibleModule

DOCUMENTATION = r"""
---
module: listen_ports
short_description: Find the processes that hold TCP ports a role is about to bind
description:
  - Reads the listening TCP sockets with C(ss -Hltnp) (iproute2) and, for each endpoint, returns
    the processes listening on its port at an address that overlaps it (the same address, or a
    wildcard on either side), except the role's own ones (I(own_args), I(own_user)).
  - Each process is named by pid, command name, user and command line (/proc/PID/cmdline).
  - Read only; runs in check mode as well.
options:
  endpoints:
    description: What the role binds, as {label, address, port}; label is returned as given.
    type: list
    elements: dict
    required: true
  own_args:
    description:
      - Regex searched in the command line (arguments joined by spaces) of the role's own
        processes, which may hold the ports.
    type: str
    default: ""
  own_user:
    description: User the role's own processes run as; empty accepts any.
    type: str
    default: ""
"""

RETURN = r"""
taken:
  description:
    - One entry per endpoint and foreign listener
      {label, address, port, listen, pid, name, user, args, process}; process describes
      the holder for a message (pid, name, user, command line).
  type: list
  elements: dict
"""

SS_LINE = re.compile(r"^\S+\s+\d+\s+\d+\s+(?P<local>\S+)\s+\S+\s*(?P<procs>.*)$")
SS_PROC = re.compile(r'\("(?P<name>[^"]*)",pid=(?P<pid>\d+),')
WILDCARDS = {"*", "0.0.0.0", "::"}


def normalize(address: str) -> str:
    """ss prints [v6]:port, v6%iface, ::ffff:v4 for mapped addresses."""
    address = address.strip("[]").split("%", 1)[0]
    return address.removeprefix("::ffff:") if "." in address else address


def resolve(address: str) -> set[str]:
    if address in WILDCARDS or address == "":
        return {address or "0.0.0.0"}
    try:
        return {str(ipaddress.ip_address(address))}
    except ValueError:
        infos = socket.getaddrinfo(address, None, proto=socket.IPPROTO_TCP)
        return {normalize(str(info[4][0])) for info in infos}


def overlaps(wanted: str, listening: str) -> bool:
    """Binding `wanted` fails while `listening` holds the same port ('*' is a dual-stack
    wildcard, '::' a v6-only one as a listener; a wanted '::' is dual-stack, Linux's default)."""
    if wanted == listening or "*" in (wanted, listening) or wanted == "::":
        return True
    if (":" in wanted) != (":" in listening):
        return False
    return wanted in WILDCARDS or listening in WILDCARDS


def process(pid: int, name: str) -> dict[str, Any]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            args = f.read().rstrip(b"\0").replace(b"\0", b" ").decode(errors="replace")
        uid = os.stat(f"/proc/{pid}").st_uid
        try:
            user = pwd.getpwuid(uid).pw_name
        except KeyError:
            user = str(uid)
    except OSError:  # gone since ss listed it, or in another PID namespace
        args, user = "", ""
    return {"pid": pid, "name": name, "user": user, "args": args}


def describe(holder: dict[str, Any]) -> str:
    """What a message says of the holder: pid, name, user, command line (shortened)."""
    if not holder["pid"]:
        return "a process ss cannot name (another PID namespace?)"
    args = " ".join(holder["args"].split())
    args = args if len(args) <= 160 else args[:157] + "..."
    return f"pid {holder['pid']} ({holder['name']}, user {holder['user'] or '?'}: {args})"


def listeners(text: str) -> list[dict[str, Any]]:
    found = []
    for line in text.splitlines():
        m = SS_LINE.match(line.strip())
        if not m:
            continue
        address, _, port = m["local"].rpartition(":")
        procs = [process(int(p["pid"]), p["name"]) for p in SS_PROC.finditer(m["procs"])]
        # No users:(...) column: ss cannot see the holder (another PID namespace).
        for proc in procs or [{"pid": 0, "name": "", "user": "", "args": ""}]:
            found.append({"address": normalize(address), "port": int(port), **proc})
    return found


def main() -> None:
    module = AnsibleModule(
        argument_spec={
            "endpoints": {"type": "list", "elements": "dict", "required": True},
            "own_args": {"type": "str", "default": ""},
            "own_user": {"type": "str", "default": ""},
        },
        supports_check_mode=True,
    )
    ss = module.get_bin_path("ss")
    if ss is None:
        module.fail_json(
            msg="ss (package iproute2) is needed to check the ports: apt install iproute2"
        )
    rc, out, err = module.run_command([ss, "-Hltnp"])
    if rc != 0:
        module.fail_json(msg=f"ss -Hltnp failed: {err.strip()}")
    own_args, own_user = module.params["own_args"], module.params["own_user"]

    def own(holder: dict[str, Any]) -> bool:
        return (
            bool(holder["pid"])
            and (not own_user or holder["user"] == own_user)
            and (not own_args or re.search(own_args, holder["args"]) is not None)
        )

    taken = []
    found = listeners(out)
    for endpoint in module.params["endpoints"]:
        try:
            wanted = resolve(str(endpoint["address"]))
        except OSError as error:
            module.fail_json(
                msg=f"{endpoint.get('label')}: cannot resolve {endpoint['address']}: {error}"
            )
        for holder in found:
            if holder["port"] != int(endpoint["port"]) or own(holder):
                continue
            seen = {(t["label"], t["port"], t["pid"]) for t in taken}
            if (endpoint.get("label", ""), int(endpoint["port"]), holder["pid"]) in seen:
                continue  # the same process on another address (0.0.0.0 and [::])
            if any(overlaps(w, holder["address"]) for w in wanted):
                taken.append(
                    {
                        "label": endpoint.get("label", ""),
                        "address": str(endpoint["address"]),
                        "port": int(endpoint["port"]),
                        "listen": f"{holder['address']}:{holder['port']}",
                        **{k: holder[k] for k in ("pid", "name", "user", "args")},
                    }
                )
    for entry in taken:
        entry["process"] = describe(entry)
    module.exit_json(changed=False, taken=taken)


if __name__ == "__main__":
    main()
