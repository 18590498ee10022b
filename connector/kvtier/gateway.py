"""`kvtier gateway`: profiles for OpenAI-compatible API gateways (add / use / status / test).

A profile is what users keep for their tools: where the API is, the key, which models to use.
The layout is the one the `gateway_profile` Ansible role writes, so both manage the same files::

    <profiles_dir>/<name>/config.toml     [api] [models] [proxy] [logging]  (the source of truth)
    <profiles_dir>/<name>/settings.json   the same values for editor and agent tools
    <profiles_dir>/active -> <name>       symlink; `use` switches it atomically

Files are 0600 and directories 0700: they hold API keys. Pure stdlib (tomllib, urllib) so the
command works wherever kvtier is installed, without extra dependencies.
"""

from __future__ import annotations

import argparse
import difflib
import enum
import json
import os
import socket
import sys
import tempfile
import time
import tomllib
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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


def _toml_string(value: str) -> str:
    """A TOML basic string: escape quote, backslash and the control characters TOML forbids."""
    out = ['"']
    for char in value:
        if char in ('"', "\\"):
            out.append("\\" + char)
        elif char == "\t" or (ord(char) >= 0x20 and ord(char) != 0x7F):
            out.append(char)
        else:
            out.append(f"\\u{ord(char):04X}")
    out.append('"')
    return "".join(out)


def _toml_value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, str):
        return _toml_string(value)
    raise TypeError(f"no TOML form for {type(value).__name__}")


def profile_to_toml(profile: Profile) -> str:
    lines = [f"# kvtier gateway profile '{profile.name}' (settings.json mirrors this file)"]
    for section, keys in _SCHEMA.items():
        lines.append("")
        lines.append(f"[{section}]")
        for key, (field, _type) in keys.items():
            lines.append(f"{key} = {_toml_value(getattr(profile, field))}")
    return "\n".join(lines) + "\n"


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


class Outcome(enum.Enum):
    """What `kvtier gateway test` found; each failure carries its own hint."""

    OK = "ok"
    KEY_WHITESPACE = "api key has whitespace"
    AUTH = "authentication failed"
    BAD_BASE_URL = "endpoint not found"
    MODEL_NOT_FOUND = "model not served"
    NO_CHAT_TEMPLATE = "model has no chat template"
    CONNECTION_REFUSED = "connection refused"
    UNKNOWN_HOST = "unknown host"
    TIMEOUT = "timeout"
    HTTP_ERROR = "HTTP error"
    BAD_RESPONSE = "not a chat completion"
    NETWORK_ERROR = "network error"


@dataclass(frozen=True)
class CheckResult:
    outcome: Outcome
    message: str
    elapsed_s: float = 0.0

    @property
    def ok(self) -> bool:
        return self.outcome is Outcome.OK


def _server_message(body: bytes) -> str:
    """The error text of an OpenAI-style error body, else the start of the raw body."""
    text = body.decode("utf-8", "replace").strip()
    try:
        doc = json.loads(text)
    except ValueError:
        return text[:300]
    if isinstance(doc, dict):
        error = doc.get("error")
        if isinstance(error, dict) and isinstance(error.get("message"), str):
            return str(error["message"])
        if isinstance(error, str):
            return error
        if isinstance(doc.get("message"), str):
            return str(doc["message"])
    return text[:300]


def _opener(profile: Profile) -> urllib.request.OpenerDirector:
    # The profile, not the environment, decides the proxy: a stray http_proxy in the shell
    # would otherwise send requests for 127.0.0.1 to a proxy and make the test lie.
    host = urllib.parse.urlsplit(profile.base_url).hostname or ""
    bypass = {h.strip() for h in profile.no_proxy.split(",") if h.strip()}
    if profile.proxy_url and host not in bypass:
        proxies = {"http": profile.proxy_url, "https": profile.proxy_url}
    else:
        proxies = {}
    return urllib.request.build_opener(urllib.request.ProxyHandler(proxies))


def check_profile(profile: Profile) -> CheckResult:
    """Send a minimal chat completion and diagnose what users typically get wrong."""
    if profile.api_key != profile.api_key.strip() or any(c.isspace() for c in profile.api_key):
        return CheckResult(
            Outcome.KEY_WHITESPACE,
            f"api_key of profile '{profile.name}' contains whitespace (often a newline pasted "
            "with it or read from a file): remove it from config.toml",
        )
    # Tools concatenate base_url and the endpoint; so does this test, to see what they see.
    url = profile.base_url + "/chat/completions"
    payload = {
        "model": profile.default_model,
        "messages": [{"role": "user", "content": "ping"}],
        "max_tokens": 1,
    }
    request = urllib.request.Request(
        url,
        data=json.dumps(payload).encode(),
        headers={
            "Authorization": f"Bearer {profile.api_key}",
            "Content-Type": "application/json",
        },
        method="POST",
    )
    start = time.monotonic()
    try:
        with _opener(profile).open(request, timeout=profile.timeout_secs) as response:
            body = response.read()
    except urllib.error.HTTPError as exc:
        return _classify_http(profile, url, exc.code, exc.read(), time.monotonic() - start)
    except (urllib.error.URLError, OSError) as exc:
        return _classify_network(profile, exc, time.monotonic() - start)
    elapsed = time.monotonic() - start
    try:
        doc = json.loads(body)
    except ValueError:
        doc = None
    if not isinstance(doc, dict) or not isinstance(doc.get("choices"), list) or not doc["choices"]:
        return CheckResult(
            Outcome.BAD_RESPONSE,
            f"{url} answered HTTP 200 but not with a chat completion (no 'choices'): "
            f"is base_url an OpenAI-compatible API? Body starts: {body[:200]!r}",
            elapsed,
        )
    return CheckResult(
        Outcome.OK,
        f"model '{doc.get('model', profile.default_model)}' answered at {profile.base_url} "
        f"in {elapsed * 1000:.0f} ms",
        elapsed,
    )


def _classify_http(
    profile: Profile, url: str, code: int, body: bytes, elapsed: float
) -> CheckResult:
    said = _server_message(body)
    if code in (401, 403):
        return CheckResult(
            Outcome.AUTH,
            f"HTTP {code} from {url} ({said}): the server rejected the api_key. Check the key "
            "for stray whitespace (a space or newline pasted with it) and that it is the key "
            "the server was started with (vLLM: VLLM_API_KEY / --api-key)",
            elapsed,
        )
    if code == 404 and "model" in said.lower():
        return CheckResult(
            Outcome.MODEL_NOT_FOUND,
            f"the server does not serve model '{profile.default_model}' ({said}): set "
            "[models] default to a served model name (GET <base_url>/models lists them)",
            elapsed,
        )
    if code in (404, 405):
        hints = base_url_warnings(profile.base_url) or [
            f"base_url '{profile.base_url}' does not lead to an OpenAI-compatible API"
        ]
        return CheckResult(Outcome.BAD_BASE_URL, f"HTTP {code} from {url}: {hints[0]}", elapsed)
    if code == 400 and "chat template" in said.lower():
        # vLLM refuses chat completions for a model whose tokenizer has no chat template.
        return CheckResult(
            Outcome.NO_CHAT_TEMPLATE,
            f"HTTP 400 from {url}: the served model has no chat template ({said}). Start the "
            "server with --chat-template FILE, or serve an instruct model that ships one",
            elapsed,
        )
    return CheckResult(Outcome.HTTP_ERROR, f"HTTP {code} from {url}: {said}", elapsed)


def _classify_network(profile: Profile, exc: BaseException, elapsed: float) -> CheckResult:
    reason: object = exc.reason if isinstance(exc, urllib.error.URLError) else exc
    where = urllib.parse.urlsplit(profile.base_url).netloc
    if isinstance(reason, ConnectionRefusedError):
        return CheckResult(
            Outcome.CONNECTION_REFUSED,
            f"connection refused by {where}: nothing listens there. Is the server running, "
            "and are host and port in base_url right?",
            elapsed,
        )
    if isinstance(reason, socket.gaierror):
        return CheckResult(
            Outcome.UNKNOWN_HOST,
            f"cannot resolve the host of base_url ({where}): {reason}",
            elapsed,
        )
    if isinstance(reason, TimeoutError):
        return CheckResult(
            Outcome.TIMEOUT,
            f"no answer from {where} within timeout_secs={profile.timeout_secs}: the server is "
            "overloaded, still loading the model, or a firewall drops the packets",
            elapsed,
        )
    return CheckResult(Outcome.NETWORK_ERROR, f"cannot reach {where}: {reason}", elapsed)


# ---------------------------------------------------------------------------------------------
# Command line


def _read_key(args: argparse.Namespace) -> str:
    """The key from a file ('-': stdin) or an environment variable; never argv (ps shows it)."""
    if args.api_key_file:
        if args.api_key_file == "-":
            raw = sys.stdin.read()
        else:
            try:
                raw = Path(args.api_key_file).read_text(encoding="utf-8")
            except OSError as exc:
                raise GatewayError(f"cannot read --api-key-file: {exc}") from None
    else:
        raw = os.environ.get(args.api_key_env, "")
        if not raw:
            raise GatewayError(
                f"no API key: set --api-key-file PATH (or '-' for stdin), or the environment "
                f"variable {args.api_key_env}"
            )
    # A trailing newline from `echo key > file` is the classic source of 401s: never store it.
    return raw.strip()


def _cmd_add(args: argparse.Namespace) -> int:
    profile = Profile(
        name=args.name,
        base_url=args.base_url,
        api_key=_read_key(args),
        timeout_secs=args.timeout_secs,
        max_retries=args.max_retries,
        default_model=args.model,
        coding_model=args.coding_model or args.model,
        reasoning_model=args.reasoning_model or args.model,
        proxy_url=args.proxy_url,
        no_proxy=args.no_proxy,
        log_level=args.log_level,
        log_file=args.log_file,
    )
    for warning in base_url_warnings(profile.base_url):
        print(f"warning: {warning}", file=sys.stderr)
    path = save_profile(args.dir, profile, overwrite=args.force)
    print(f"saved profile '{profile.name}' in {path}")
    if args.use or active_profile_name(args.dir) is None:
        set_active(args.dir, profile.name)
        print(f"active profile: {profile.name}")
    return 0


def _cmd_use(args: argparse.Namespace) -> int:
    set_active(args.dir, args.name)
    profile = load_profile(args.dir, args.name)
    print(f"active profile: {profile.name} ({profile.base_url})")
    return 0


def _cmd_status(args: argparse.Namespace) -> int:
    active = active_profile_name(args.dir)
    if active is None:
        print(f"no active profile in {args.dir}; create one with `kvtier gateway add`")
        return 1
    profile = load_profile(args.dir, active)
    print(f"active profile: {profile.name}")
    print(f"  base_url: {profile.base_url}")
    print(
        f"  models:   default={profile.default_model} coding={profile.coding_model} "
        f"reasoning={profile.reasoning_model}"
    )
    print(f"  files:    {args.dir / profile.name}")
    others = [name for name in list_profiles(args.dir) if name != active]
    if others:
        print(f"other profiles: {', '.join(others)}")
    return 0


def _cmd_test(args: argparse.Namespace) -> int:
    name = args.name or active_profile_name(args.dir)
    if name is None:
        raise GatewayError(
            f"no active profile in {args.dir}: name one, or run `kvtier gateway use`"
        )
    result = check_profile(load_profile(args.dir, name))
    if result.ok:
        print(f"OK: {result.message}")
        return 0
    print(f"FAILED ({result.outcome.value}): {result.message}", file=sys.stderr)
    return 1


def register(subparsers: Any) -> None:
    """Add `gateway` to a CLI's subparsers (`kvtier.cli` calls this)."""
    parser = subparsers.add_parser(
        "gateway",
        help="manage OpenAI-compatible API gateway profiles",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _configure(parser)


def _configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--dir",
        type=Path,
        default=default_profiles_dir(),
        help=f"profiles directory (default: ${PROFILES_DIR_ENV} or ~/.config/kvtier/gateways)",
    )
    commands = parser.add_subparsers(dest="gateway_command", required=True)

    add = commands.add_parser("add", help="create or replace a profile")
    add.add_argument("name")
    add.add_argument("--base-url", required=True, help="API root, e.g. http://127.0.0.1:8100/v1")
    add.add_argument("--api-key-file", help="file holding the key ('-': read stdin)")
    add.add_argument(
        "--api-key-env",
        default="KVTIER_GATEWAY_API_KEY",
        help="environment variable holding the key (default: KVTIER_GATEWAY_API_KEY)",
    )
    add.add_argument("--model", required=True, help="default model name")
    add.add_argument("--coding-model", default="", help="default: --model")
    add.add_argument("--reasoning-model", default="", help="default: --model")
    add.add_argument("--timeout-secs", type=int, default=60)
    add.add_argument("--max-retries", type=int, default=2)
    add.add_argument("--proxy-url", default="")
    add.add_argument("--no-proxy", default="127.0.0.1,localhost")
    add.add_argument("--log-level", default="info", choices=LOG_LEVELS)
    add.add_argument("--log-file", default="")
    add.add_argument("--use", action="store_true", help="make it the active profile")
    add.add_argument("--force", action="store_true", help="replace an existing profile")
    add.set_defaults(gateway_func=_cmd_add)

    use = commands.add_parser("use", help="make a profile the active one")
    use.add_argument("name")
    use.set_defaults(gateway_func=_cmd_use)

    status = commands.add_parser("status", help="show the active profile and its base_url")
    status.set_defaults(gateway_func=_cmd_status)

    test = commands.add_parser("test", help="send a minimal chat completion through a profile")
    test.add_argument("name", nargs="?", help="profile (default: the active one)")
    test.set_defaults(gateway_func=_cmd_test)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Run a parsed `gateway` command; profile problems become a message and exit status 2."""
    try:
        status: int = args.gateway_func(args)
    except GatewayError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return status


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="kvtier gateway",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _configure(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
