"""Bad gateway_profile inventory values stop the play in preflight, before any file is written,
with a message that names the variable. Runs the real playbook with `-e` overrides and only the
preflight tag, so a deployed profile is never touched."""

from __future__ import annotations

import pytest
from _ansible import run_playbook

CASES = {
    "trailing slash": (
        {"gateway_profile_base_url": "http://127.0.0.1:8100/v1/"},
        "gateway_profile_base_url 'http://127.0.0.1:8100/v1/' must be the API root",
    ),
    "endpoint in base_url": (
        {"gateway_profile_base_url": "http://127.0.0.1:8100/v1/chat/completions"},
        "no /chat/completions (tools append it)",
    ),
    "no model": (
        {"gateway_profile_default_model": ""},
        "Set gateway_profile_default_model to the served model name",
    ),
    "key with a newline": (
        {"gateway_profile_api_key": "sk-from-vault\n"},
        "gateway_profile_api_key contains whitespace",
    ),
    "unknown owner": (
        {"gateway_profile_owner": "no-such-user-kvtier"},
        "gateway_profile_owner 'no-such-user-kvtier' is not a user",
    ),
}


@pytest.mark.parametrize("extra_vars, message", CASES.values(), ids=CASES.keys())
def test_bad_value_fails_in_preflight(extra_vars: dict[str, object], message: str) -> None:
    run = run_playbook("playbooks/profiles.yml", extra_vars, "--tags", "gateway_profile_preflight")
    assert run.returncode != 0
    assert message in run.stdout
    assert "changed=0" in run.stdout
    # The key's value never reaches the output, even when its check fails.
    assert "sk-from-vault" not in run.stdout
