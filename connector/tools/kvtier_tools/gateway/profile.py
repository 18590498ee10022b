"""A gateway profile and its files: ``config.toml`` (the source of truth, validated on load),
``settings.json`` (the same values for editor and agent tools) and the ``active`` pointer."""

from __future__ import annotations

import difflib
import json
import os
import tempfile
import tomllib
import urllib.parse
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tomli_w

CONFIG_FILE = "config.toml"
SETTINGS_FILE = "settings.json"
ACTIVE_LINK = "active"
PROFILES_DIR_ENV = "KVTIER_GATEWAY_DIR"
LOG_LEVELS = ("debug", "info", "warning", "error")


class GatewayError(Exception):
    """A user-facing problem with a profile; the message says what to fix."""


def default_profiles_dir() -> Path:
    """$KVTIER_GATEWAY_DIR, else $XDG_CONFIG_HOME (default ~/.config)/kvtier/gateways."""
    explicit = os.environ.get(PROFILES_DIR_ENV)
    if explicit:
        return Path(explicit)
    config_home = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(config_home) / "kvtier" / "gateways"


@dataclass(frozen=True)
class Profile:
    """One gateway profile; field names follow config.toml's keys."""

    name: str
    base_url: str
    api_key: str
    timeout_secs: int = 60
    max_retries: int = 2
    default_model: str = ""
    coding_model: str = ""
    reasoning_model: str = ""
    proxy_url: str = ""
    no_proxy: str = "127.0.0.1,localhost"
    log_level: str = "info"
    log_file: str = ""


# config.toml schema: section -> key -> (Profile field, type). Anything else is rejected.
_SCHEMA: dict[str, dict[str, tuple[str, type]]] = {
    "api": {
        "base_url": ("base_url", str),
        "api_key": ("api_key", str),
        "timeout_secs": ("timeout_secs", int),
        "max_retries": ("max_retries", int),
    },
    "models": {
        "default": ("default_model", str),
        "coding": ("coding_model", str),
        "reasoning": ("reasoning_model", str),
    },
    "proxy": {"url": ("proxy_url", str), "no_proxy": ("no_proxy", str)},
    "logging": {"level": ("log_level", str), "file": ("log_file", str)},
}
_REQUIRED = (("api", "base_url"), ("api", "api_key"), ("models", "default"))


def _unknown(kind: str, name: str, known: Sequence[str], where: str) -> GatewayError:
    close = difflib.get_close_matches(name, known, n=1)
    hint = f"; did you mean '{close[0]}'?" if close else f" (known: {', '.join(known)})"
    return GatewayError(f"unknown {kind} '{name}' in {where}{hint}")


def profile_from_toml(name: str, doc: Mapping[str, Any], where: str) -> Profile:
    """Validate a parsed config.toml; unknown sections or keys and wrong types are errors."""
    values: dict[str, Any] = {}
    for section, table in doc.items():
        if section not in _SCHEMA:
            raise _unknown("section", f"[{section}]", [f"[{s}]" for s in _SCHEMA], where)
        if not isinstance(table, dict):
            raise GatewayError(f"'{section}' in {where} must be a table ([{section}])")
        for key, value in table.items():
            if key not in _SCHEMA[section]:
                raise _unknown(f"key in [{section}]", key, list(_SCHEMA[section]), where)
            field, expected = _SCHEMA[section][key]
            # bool is an int subclass: `timeout_secs = true` must not pass as 1.
            if not isinstance(value, expected) or isinstance(value, bool):
                raise GatewayError(
                    f"[{section}] {key} in {where} must be "
                    f"{'an integer' if expected is int else 'a string'}, got {value!r}"
                )
            values[field] = value
    for section, key in _REQUIRED:
        if _SCHEMA[section][key][0] not in values:
            raise GatewayError(f"[{section}] {key} is missing in {where}")
    profile = Profile(name=name, **values)
    problems = _check_values(profile)
    if problems:
        raise GatewayError(f"{where}: " + "; ".join(problems))
    return profile


def _check_values(profile: Profile) -> list[str]:
    problems = []
    url = urllib.parse.urlsplit(profile.base_url)
    if url.scheme not in ("http", "https") or not url.netloc:
        problems.append(
            f"base_url '{profile.base_url}' must be an http(s) URL such as http://127.0.0.1:8100/v1"
        )
    if profile.timeout_secs <= 0:
        problems.append("timeout_secs must be > 0")
    if profile.max_retries < 0:
        problems.append("max_retries must be >= 0")
    if profile.log_level not in LOG_LEVELS:
        problems.append(f"logging level must be one of {', '.join(LOG_LEVELS)}")
    if not profile.api_key:
        problems.append("api_key is empty")
    return problems


def base_url_warnings(base_url: str) -> list[str]:
    """Shapes of base_url that make tools build the wrong endpoint URL."""
    path = urllib.parse.urlsplit(base_url).path
    if path.endswith("/"):
        return [
            f"base_url '{base_url}' ends with '/': tools append '/chat/completions' and "
            "request '...//chat/completions'; remove the trailing slash"
        ]
    if path.rstrip("/").endswith(("/chat/completions", "/completions")):
        return [
            f"base_url '{base_url}' includes the endpoint path: it must be the API root "
            "(e.g. http://127.0.0.1:8100/v1); tools append '/chat/completions' themselves"
        ]
    if not path.rstrip("/").endswith("/v1"):
        return [
            f"base_url '{base_url}' does not end with '/v1': OpenAI-compatible servers "
            "(vLLM included) serve the API under /v1"
        ]
    return []


def profile_to_toml(profile: Profile) -> str:
    doc = {
        section: {key: getattr(profile, field) for key, (field, _type) in keys.items()}
        for section, keys in _SCHEMA.items()
    }
    header = f"# kvtier gateway profile '{profile.name}' (settings.json mirrors this file)\n\n"
    return header + tomli_w.dumps(doc)


def profile_to_settings(profile: Profile) -> dict[str, Any]:
    """settings.json for editor and agent tools: the gateway entry plus the editor's choice."""
    return {
        profile.name: {
            "baseUrl": profile.base_url,
            "apiKey": profile.api_key,
            "defaultModel": profile.default_model,
            "codingModel": profile.coding_model,
            "reasoningModel": profile.reasoning_model,
            "timeout": profile.timeout_secs,
            "retries": profile.max_retries,
            "proxy": profile.proxy_url,
        },
        "editor": {
            "provider": profile.name,
            "defaultModel": profile.default_model,
            "codingModel": profile.coding_model,
            "reasoningModel": profile.reasoning_model,
        },
    }


def _write_private(path: Path, text: str) -> None:
    """Write atomically with mode 0600 from the start (the key is never world-readable)."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
        os.chmod(tmp, 0o600)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _check_name(name: str) -> None:
    if not name or name in (ACTIVE_LINK, ".", "..") or "/" in name or name.startswith("."):
        raise GatewayError(
            f"profile name '{name}' is not usable: use letters, digits, '-' or '_' "
            f"(and not '{ACTIVE_LINK}')"
        )


def save_profile(profiles_dir: Path, profile: Profile, *, overwrite: bool) -> Path:
    _check_name(profile.name)
    problems = _check_values(profile)
    if problems:
        raise GatewayError("; ".join(problems))
    profile_dir = profiles_dir / profile.name
    if (profile_dir / CONFIG_FILE).exists() and not overwrite:
        raise GatewayError(
            f"profile '{profile.name}' already exists in {profiles_dir}; use --force to replace it"
        )
    profiles_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    profile_dir.mkdir(mode=0o700, exist_ok=True)
    _write_private(profile_dir / CONFIG_FILE, profile_to_toml(profile))
    settings = json.dumps(profile_to_settings(profile), indent=2) + "\n"
    _write_private(profile_dir / SETTINGS_FILE, settings)
    return profile_dir


def load_profile(profiles_dir: Path, name: str) -> Profile:
    _check_name(name)
    path = profiles_dir / name / CONFIG_FILE
    try:
        with path.open("rb") as handle:
            doc = tomllib.load(handle)
    except FileNotFoundError:
        known = list_profiles(profiles_dir)
        listing = ", ".join(known) if known else "none; create one with `kvtier gateway add`"
        raise GatewayError(f"no profile '{name}' in {profiles_dir} (profiles: {listing})") from None
    except tomllib.TOMLDecodeError as exc:
        raise GatewayError(f"{path} is not valid TOML: {exc}") from None
    return profile_from_toml(name, doc, str(path))


def list_profiles(profiles_dir: Path) -> list[str]:
    if not profiles_dir.is_dir():
        return []
    return sorted(
        entry.name
        for entry in profiles_dir.iterdir()
        if entry.name != ACTIVE_LINK and (entry / CONFIG_FILE).is_file()
    )


def active_profile_name(profiles_dir: Path) -> str | None:
    link = profiles_dir / ACTIVE_LINK
    if not link.is_symlink():
        return None
    return Path(os.readlink(link)).name


def set_active(profiles_dir: Path, name: str) -> None:
    load_profile(profiles_dir, name)  # refuse to point at a missing or broken profile
    tmp = profiles_dir / f".{ACTIVE_LINK}.{os.getpid()}"
    tmp.unlink(missing_ok=True)
    # Relative target, so the directory can be moved or mounted elsewhere; os.replace makes the
    # switch atomic for a tool reading the pointer at the same moment.
    os.symlink(name, tmp)
    os.replace(tmp, profiles_dir / ACTIVE_LINK)
