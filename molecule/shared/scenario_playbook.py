"""`ansible-playbook` runs of the bundle against a molecule scenario's inventory, from the
scenarios' tests, as an operator runs them (the tests' conftest.py puts this directory on the
import path)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def run_playbook(
    inventory: Path, *args: str, timeout: float = 1500
) -> subprocess.CompletedProcess[str]:
    """`ansible-playbook -i INVENTORY ARGS` from the bundle's root, with its venv and config."""
    env = {
        **os.environ,
        # molecule's own settings are relative to the scenario: the bundle's, absolute.
        "ANSIBLE_CONFIG": str(REPO / "ansible.cfg"),
        "ANSIBLE_ROLES_PATH": str(REPO / "roles"),
        "ANSIBLE_COLLECTIONS_PATH": str(REPO / "collections"),
        "ANSIBLE_NOCOLOR": "1",
        "ANSIBLE_FORCE_COLOR": "0",
    }
    return subprocess.run(
        [str(REPO / ".venv" / "bin" / "ansible-playbook"), "-i", str(inventory), *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def recap(run: subprocess.CompletedProcess[str]) -> str:
    """The PLAY RECAP of a run, or the end of its output when it has none."""
    out = run.stdout
    return out[out.rfind("PLAY RECAP") :] if "PLAY RECAP" in out else out[-3000:]
