"""A secret set from a vault (`x: "{{ vault_x }}"`) whose vault is not loaded stops `site.yml` in
its first plays, naming the setting and saying to load the vault, before any role's argument
check stops at the bare undefined vault variable. Unset secrets are generated on the first run,
and a loaded vault passes without its values reaching the output. Only preflight tags run."""

from __future__ import annotations

import pytest
from _ansible import assert_fails_in_preflight, run_playbook

LOAD_THE_VAULT = (
    r"refers to a variable that is not defined, most likely a vault variable \(such as "
    r"vault_{0}\) whose vault is not loaded\. Load the vault that defines it: give it to "
    r"ansible-playbook as -e @FILE or keep it in the inventory's group_vars/host_vars, and add "
    r"--ask-vault-pass or --vault-password-file FILE"
)
FROM_VAULT = {
    "rgw_bucket_access_key": "{{ vault_rgw_bucket_access_key }}",
    "rgw_bucket_secret_key": "{{ vault_rgw_bucket_secret_key }}",
    "gateway_profile_api_key": "{{ vault_gateway_profile_api_key }}",
}

CASES = {
    "RGW secret key": (
        {"rgw_bucket_access_key": "AKIAEXAMPLE",
         "rgw_bucket_secret_key": FROM_VAULT["rgw_bucket_secret_key"]},
        "rgw_bucket_secret_key",
        r"\. Or remove rgw_bucket_access_key and rgw_bucket_secret_key from the inventory: radosgw "
        r"then generates the keys once",
    ),
    "RGW access key": (
        {"rgw_bucket_access_key": FROM_VAULT["rgw_bucket_access_key"],
         "rgw_bucket_secret_key": "not-a-real-secret"},
        "rgw_bucket_access_key",
        r"",
    ),
    "gateway API key": (
        {"gateway_profile_api_key": FROM_VAULT["gateway_profile_api_key"]},
        "gateway_profile_api_key",
        r"\. Or remove gateway_profile_api_key from the inventory: a key is then generated once",
    ),
    "AWS profile secret key": (
        {"aws_profile_access_key": "AKIAEXAMPLE",
         "aws_profile_secret_key": "{{ vault_aws_profile_secret_key }}"},
        "aws_profile_secret_key",
        r"",
    ),
}  # fmt: skip


@pytest.mark.parametrize("extra_vars, variable, hint", CASES.values(), ids=CASES.keys())
def test_secret_from_a_vault_not_loaded_is_named(
    extra_vars: dict[str, object], variable: str, hint: str
) -> None:
    done = run_playbook(
        "site.yml", extra_vars, "--tags", "rgw_bucket_preflight,gateway_profile_preflight"
    )
    assert_fails_in_preflight(done, rf"{variable} " + LOAD_THE_VAULT.format(variable) + hint)


def test_gateway_playbook_alone_names_the_key_too() -> None:
    done = run_playbook(
        "playbooks/profiles.yml",
        {"gateway_profile_api_key": FROM_VAULT["gateway_profile_api_key"]},
        "--tags",
        "gateway_profile_preflight",
    )
    assert_fails_in_preflight(
        done, r"gateway_profile_api_key " + LOAD_THE_VAULT.format("gateway_profile_api_key")
    )


def test_loaded_vault_passes_and_its_values_stay_out_of_the_output() -> None:
    values = {
        "vault_rgw_bucket_access_key": "AKIAVAULTEXAMPLE7",
        "vault_rgw_bucket_secret_key": "vault-secret-Zq8Xk2",
    }
    done = run_playbook(
        "site.yml",
        {**FROM_VAULT, **values, "gateway_profile_api_key": ""},
        "--tags",
        "rgw_bucket_preflight",
        "-vvv",
    )
    assert done.returncode == 0, done.stdout[-3000:]
    assert values["vault_rgw_bucket_secret_key"] not in done.stdout + done.stderr
