"""What the serving user sees of the host roles on the converged site: the disk tier mounted
(xfs, noatime) on a re-attachable loop device and writable by the user, and the gateway profile
(private files, settings.json mirroring config.toml, an active pointer `kvtier gateway status`
follows, a key the server and the tools share)."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[3]
LOCAL_VARS = REPO / "inventories" / "local" / "group_vars" / "all"


def _vars() -> dict[str, Any]:
    values: dict[str, Any] = {}
    for defaults in ("nvme_cache", "gateway_profile"):
        values.update(
            yaml.safe_load((REPO / "roles" / defaults / "defaults" / "main.yml").read_text())
        )
    for name in ("kvtier.yml", "nvme_cache.yml", "gateway.yml"):
        values.update(yaml.safe_load((LOCAL_VARS / name).read_text()))
    return values


VARS = _vars()
USER = VARS["kvtier_user_name"]
MOUNT = VARS["nvme_cache_mount_path"]
LOOP_FILE = VARS["nvme_cache_loop_file"]
PROFILE = VARS["gateway_profile_name"]
KEY_FILE = VARS["gateway_profile_api_key_file"].replace("{{ gateway_profile_name }}", PROFILE)


def _home(host: Any) -> str:
    return str(host.user(USER).home)


def _profiles_dir(host: Any) -> str:
    return f"{_home(host)}/.config/kvtier/gateways"


def _as_user(host: Any, command: str) -> Any:
    return host.run(f"runuser -u {USER} -- {command}")


def test_disk_tier_is_an_xfs_mount_with_noatime(host: Any) -> None:
    mount = host.mount_point(MOUNT)
    assert mount.exists
    assert mount.filesystem == VARS["nvme_cache_fstype"] == "xfs"
    assert "noatime" in mount.options
    # Backed by a partition of the loop device over the configured sparse file.
    attached = host.check_output(f"losetup --noheadings --output NAME --associated {LOOP_FILE}")
    assert mount.device == f"{attached.splitlines()[0]}p1"
    label = host.check_output(f"blkid -p -o value -s LABEL {mount.device}")
    assert label == VARS["nvme_cache_label"]


def test_loop_backing_has_no_fstab_entry_and_a_root_only_image(host: Any) -> None:
    assert MOUNT not in host.file("/etc/fstab").content_string
    image_dir = host.file(str(Path(LOOP_FILE).parent))
    assert (image_dir.user, image_dir.mode) == ("root", 0o700)
    # Sparse: the 1 GiB image takes only what the filesystem wrote.
    image = host.file(LOOP_FILE)
    assert image.size == VARS["nvme_cache_loop_size_mb"] * 1024 * 1024
    allocated = int(host.check_output(f"du --block-size=1 {LOOP_FILE}").split()[0])
    assert allocated < image.size // 4


def test_serving_user_owns_and_can_write_the_disk_tier(host: Any) -> None:
    directory = host.file(MOUNT)
    assert (directory.user, directory.group, directory.mode) == (USER, USER, 0o750)
    probe = f"{MOUNT}/.testinfra-probe"
    assert _as_user(host, f"touch {probe}").rc == 0
    assert host.file(probe).user == USER
    host.run(f"rm -f {probe}")


def test_profile_files_are_private_to_the_user(host: Any) -> None:
    profile_dir = f"{_profiles_dir(host)}/{PROFILE}"
    for path in (_profiles_dir(host), profile_dir):
        assert (host.file(path).user, host.file(path).mode) == (USER, 0o700)
    group = host.user(USER).group
    for name in ("config.toml", "settings.json"):
        file = host.file(f"{profile_dir}/{name}")
        assert (file.user, file.group, file.mode) == (USER, group, 0o600), name
    # The key file the server reads (VLLM_API_KEY) and its directory, which others may list.
    key = host.file(KEY_FILE)
    assert (key.user, key.group, key.mode) == (USER, group, 0o600)
    assert host.file(str(Path(KEY_FILE).parent)).user == "root"


def test_settings_json_mirrors_config_toml(host: Any) -> None:
    profile_dir = f"{_profiles_dir(host)}/{PROFILE}"
    config = tomllib.loads(host.file(f"{profile_dir}/config.toml").content_string)
    settings = json.loads(host.file(f"{profile_dir}/settings.json").content_string)
    assert set(config) == {"api", "models", "proxy", "logging"}
    gateway = settings[PROFILE]
    assert gateway["baseUrl"] == config["api"]["base_url"] == VARS["gateway_profile_base_url"]
    assert gateway["apiKey"] == config["api"]["api_key"]
    assert gateway["defaultModel"] == config["models"]["default"]
    assert gateway["codingModel"] == config["models"]["coding"]
    assert gateway["timeout"] == config["api"]["timeout_secs"]
    assert gateway["retries"] == config["api"]["max_retries"]
    assert settings["editor"]["provider"] == PROFILE


def test_generated_key_is_shared_by_key_file_and_profile(host: Any) -> None:
    key = host.file(KEY_FILE).content_string.strip()
    prefix = "sk-kvtier-"
    assert key.startswith(prefix)
    assert len(key) == len(prefix) + 40
    assert key.removeprefix(prefix).isalnum()
    config = host.file(f"{_profiles_dir(host)}/{PROFILE}/config.toml").content_string
    assert tomllib.loads(config)["api"]["api_key"] == key


def test_status_as_the_user_shows_the_active_profile(host: Any) -> None:
    link = host.file(f"{_profiles_dir(host)}/active")
    assert link.is_symlink
    assert link.linked_to == f"{_profiles_dir(host)}/{PROFILE}"
    # `kvtier gateway status` with the user's HOME finds the role's files in its default
    # location (run as root: the checkout's venv is not readable by the serving user).
    status = host.run(
        f"env -u XDG_CONFIG_HOME -u KVTIER_GATEWAY_DIR HOME={_home(host)} "
        f"{REPO}/.venv/bin/python -m kvtier_tools.gateway status"
    )
    assert status.rc == 0, status.stderr
    assert f"active profile: {PROFILE}" in status.stdout
    assert f"base_url: {VARS['gateway_profile_base_url']}" in status.stdout
