#!/usr/bin/python3
# Copyright: kvtier contributors. Apache-2.0.
"""Ansible module: wait until a (re)started vLLM server answers /health, or say why it never will."""

from __future__ import annotations

import subprocess
import time
import urllib.error
import urllib.request
from collections import deque
from typing import Any

from ansible.module_utils.basic import AnsibleModule

DOCUMENTATION = r"""
---
module: vllm_server_health
short_description: Wait for vLLM's /health, failing fast when the server process dies
description:
  - Polls I(url) until it answers 200. Meanwhile it asks the service manager for the server's
    main pid; when the process that was starting is gone (it exited and the service manager
    restarted it, gave up, or failed the unit), waiting longer cannot help, so the module fails
    at once with the last lines of the server's log.
  - Read-only; never changes anything (always reports unchanged).
options:
  url:
    description: The server's health URL, e.g. http://127.0.0.1:8000/health.
    type: str
    required: true
  timeout:
    description: Seconds to wait for a 200 before failing.
    type: int
    required: true
  pid_command:
    description:
      - Command (argv) printing the service's main pid, 0 or nothing when it is not running
        (C(supervisorctl -c CONF pid NAME) or C(systemctl show --property MainPID --value NAME)).
    type: list
    elements: str
    required: true
  log_file:
    description: The server's log, whose last lines are returned on failure.
    type: path
    required: true
  log_lines:
    description: How many log lines to return on failure.
    type: int
    default: 40
"""

RETURN = r"""
seconds:
  description: Seconds until /health answered 200.
  type: float
log_tail:
  description: The last log lines (on failure).
  type: list
  elements: str
"""


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return bool(resp.status == 200)
    except (urllib.error.URLError, OSError, ValueError):
        return False


def _pid(argv: list[str]) -> int:
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=30, check=False).stdout
    except (OSError, subprocess.TimeoutExpired):
        return 0
    token = out.strip().split()[-1] if out.strip() else "0"
    return int(token) if token.isdigit() else 0


def _tail(path: str, lines: int) -> list[str]:
    try:
        with open(path, errors="replace") as f:
            return [line.rstrip("\n") for line in deque(f, maxlen=lines)]
    except OSError as exc:
        return [f"<cannot read {path}: {exc.strerror}>"]


def main() -> None:
    module = AnsibleModule(
        argument_spec={
            "url": {"type": "str", "required": True},
            "timeout": {"type": "int", "required": True},
            "pid_command": {"type": "list", "elements": "str", "required": True},
            "log_file": {"type": "path", "required": True},
            "log_lines": {"type": "int", "default": 40},
        },
        supports_check_mode=True,
    )
    p: dict[str, Any] = module.params
    start = time.monotonic()
    first_pid = 0
    while time.monotonic() - start < p["timeout"]:
        if _healthy(p["url"]):
            module.exit_json(changed=False, seconds=round(time.monotonic() - start, 1))
        pid = _pid(p["pid_command"])
        if first_pid == 0:
            first_pid = pid
        elif pid != first_pid:
            # The process we were waiting for is gone: a crash during start (bad model, bad
            # argument, out of memory). A restarted one would most likely crash the same way.
            module.fail_json(
                msg=(
                    f"the server exited while starting (pid {first_pid} gone"
                    f"{', restarted as ' + str(pid) if pid else ''}) before {p['url']} answered;"
                    f" see the log tail, {p['log_file']}"
                ),
                log_tail=_tail(p["log_file"], p["log_lines"]),
            )
        time.sleep(1.0)
    module.fail_json(
        msg=f"{p['url']} did not answer 200 within {p['timeout']} s; see the log tail, {p['log_file']}",
        log_tail=_tail(p["log_file"], p["log_lines"]),
    )


if __name__ == "__main__":
    main()
