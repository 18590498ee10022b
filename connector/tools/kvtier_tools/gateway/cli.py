"""`kvtier gateway add | use | status | test` (also ``python -m kvtier_tools.gateway``)."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import kvtier_tools.gateway
from kvtier_tools.cli import add_command
from kvtier_tools.gateway.channel import check_profile
from kvtier_tools.gateway.profile import (
    LOG_LEVELS,
    PROFILES_DIR_ENV,
    GatewayError,
    Profile,
    active_profile_name,
    base_url_warnings,
    default_profiles_dir,
    list_profiles,
    load_profile,
    save_profile,
    set_active,
)


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
    """Add `gateway` to a CLI's subparsers (`kvtier_tools.cli` calls this)."""
    summary = "manage OpenAI-compatible API gateway profiles"
    parser = add_command(subparsers, "gateway", summary, kvtier_tools.gateway.__doc__)
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
        description=kvtier_tools.gateway.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _configure(parser)
    return run(parser.parse_args(argv))
