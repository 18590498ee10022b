"""Running the repo's playbooks from tests, as a user would, with `-e` overrides."""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BIN = REPO / ".venv" / "bin"


def ansible_env() -> dict[str, str]:
    """The repo's ansible.cfg, no colours, and the JSON result format: it prints messages
    verbatim (the YAML format of ansible.cfg re-quotes and folds them)."""
    return {
        **os.environ,
        "ANSIBLE_CONFIG": str(REPO / "ansible.cfg"),
        "ANSIBLE_NOCOLOR": "1",
        "ANSIBLE_CALLBACK_RESULT_FORMAT": "json",
    }


def run_playbook(
    playbook: str, extra_vars: dict[str, object], *args: str, timeout: int = 300
) -> subprocess.CompletedProcess[str]:
    """`ansible-playbook PLAYBOOK -e JSON ARGS...` from the repo root, output captured."""
    return subprocess.run(
        [str(BIN / "ansible-playbook"), playbook, "-e", json.dumps(extra_vars), *args],
        cwd=REPO,
        env=ansible_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def assert_fails_in_preflight(done: subprocess.CompletedProcess[str], message: str) -> None:
    """The run failed, its output matches the regex ``message`` (whitespace runs count as one
    space), and nothing was changed: the failure came before any role ran."""
    output = re.sub(r"\s+", " ", done.stdout + done.stderr)
    assert done.returncode != 0, output[-2000:]
    assert re.search(message, output), output[-3000:]
    assert re.search(r"localhost\s*:\s*ok=\d+\s+changed=0\s", done.stdout), done.stdout[-2000:]


def systemd_verify_errors(unit: Path) -> str:
    """What `systemd-analyze verify` (this host's systemd, Debian 12's 252) says of ``unit``:
    empty when it accepts every directive."""
    done = subprocess.run(
        ["systemd-analyze", "verify", "--man=no", str(unit)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    said = (done.stdout + done.stderr).strip()
    return said or ("" if done.returncode == 0 else f"exit status {done.returncode}")
