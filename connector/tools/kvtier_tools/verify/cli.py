"""`kvtier verify`: the arguments and their checks against the kvtier config, the lock, the run,
the JSON and Markdown reports and the exit status (0 passed, 1 a check failed, 2 bad input)."""

from __future__ import annotations

import argparse
import json
import random
import sys
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import kvtier_tools.verify
from kvtier.config import ConfigError, KvtierConfig, load_config
from kvtier_tools.cli import add_command
from kvtier_tools.completions import CompletionError
from kvtier_tools.verify.checks import Step
from kvtier_tools.verify.lock import default_lock_dir, exclusive
from kvtier_tools.verify.report import markdown, report
from kvtier_tools.verify.rounds import command_restart
from kvtier_tools.verify.settings import Settings, VerifyError
from kvtier_tools.verify.steps import run


def _settings(args: argparse.Namespace) -> Settings:
    cfg = _config(args)
    try:
        api_key = Path(args.api_key_file).read_text().strip() if args.api_key_file else None
    except OSError as exc:
        raise VerifyError(f"cannot read --api-key-file: {exc}") from exc
    return Settings(
        server_url=args.server_url,
        model=args.model,
        api_key=api_key,
        cfg=cfg,
        namespace=args.namespace,
        documents=args.documents,
        document_tokens=args.document_tokens,
        output_tokens=args.output_tokens,
        seed=args.seed if args.seed is not None else random.SystemRandom().randrange(1 << 31),
        restart=command_restart(args.restart_command, args.server_url, args.health_timeout),
        health_timeout=args.health_timeout,
        max_warm_cold_ratio=args.max_warm_cold_ratio,
        min_s3_share=args.min_s3_share,
        channel=None if args.skip_channel_test else _channel_test(args),
    )


def _config(args: argparse.Namespace) -> KvtierConfig:
    """The server's kvtier config, refused where it cannot verify what the arguments ask."""
    try:
        cfg = load_config(args.config)
    except ConfigError as exc:
        raise VerifyError(str(exc)) from exc
    if args.namespace == cfg.namespace:
        raise VerifyError(
            f"--namespace {args.namespace!r} is the production namespace of {cfg.source}: "
            "verification needs a namespace of its own"
        )
    if args.namespace not in cfg.request_namespaces:
        raise VerifyError(
            f"namespace {args.namespace!r} is not in request_namespaces of {cfg.source} "
            f"({list(cfg.request_namespaces)}): the server would serve the requests without "
            "kvtier. Add it there (vllm_server_kvtier_request_namespaces) and restart vLLM"
        )
    if not cfg.remote_url:
        raise VerifyError(f"{cfg.source} has no S3 tier (remote_url): nothing to verify in Ceph")
    if args.document_tokens % cfg.chunk_size:
        raise VerifyError(
            f"--document-tokens {args.document_tokens} must be a multiple of chunk_size "
            f"{cfg.chunk_size}, so that the expected number of objects is exact"
        )
    return cfg


def _channel_test(args: argparse.Namespace) -> Callable[[], tuple[bool, str]]:
    """Step 1: a chat completion through the gateway profile (loaded now, so that a missing
    profile is an input error before anything is purged or restarted)."""
    from kvtier_tools.gateway.channel import check_profile
    from kvtier_tools.gateway.profile import (
        GatewayError,
        active_profile_name,
        default_profiles_dir,
        load_profile,
    )

    profiles = Path(args.gateway_dir) if args.gateway_dir else default_profiles_dir()
    name = args.gateway_profile or active_profile_name(profiles)
    if name is None:
        raise VerifyError(
            f"no active gateway profile in {profiles} for the channel test: name one with "
            "--gateway-profile (or --gateway-dir), or pass --skip-channel-test"
        )
    try:
        profile = load_profile(profiles, name)
    except GatewayError as exc:
        raise VerifyError(str(exc)) from exc

    def channel() -> tuple[bool, str]:
        result = check_profile(profile)
        return result.ok, f"{result.outcome.value}: {result.message}"

    return channel


def _cmd(args: argparse.Namespace) -> int:
    try:
        s = _settings(args)
        with exclusive(s.namespace, Path(args.lock_dir) if args.lock_dir else default_lock_dir()):
            return _verify(s, args)
    except VerifyError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


def _verify(s: Settings, args: argparse.Namespace) -> int:
    steps: list[Step] = []
    error: str | None = None
    started_at = datetime.now(UTC).isoformat(timespec="seconds")
    try:
        run(s, steps)
    except (VerifyError, CompletionError) as exc:
        current = steps[-1] if steps else None
        where = f"step {current.number} ({current.name})" if current else "setup"
        error = f"{where}: {exc}"
    doc = report(s, steps, error, args.host, started_at)
    text = json.dumps(doc, indent=2) + "\n"
    if args.json:
        Path(args.json).write_text(text)
    if args.markdown:
        Path(args.markdown).write_text(markdown(doc, args.host))
    for step in doc["steps"]:
        print(f"step {step['number']} {step['name']}: {'ok' if step['ok'] else 'FAILED'}")
        for c in step["checks"]:
            print(
                f"  [{'ok' if c['ok'] else 'FAIL'}] {c['what']}: expected {c['expected']}, "
                f"measured {c['measured']}"
            )
    if doc["ok"]:
        print("kv_verify: PASSED")
        return 0
    print(f"kv_verify: FAILED: {doc['failure']}", file=sys.stderr)
    return 1


def ratio(value: str) -> float:
    x = float(value)
    if x <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {value}")
    return x


def share(value: str) -> float:
    x = float(value)
    if not 0 < x <= 1:
        raise argparse.ArgumentTypeError(f"must be a share in (0, 1], got {value}")
    return x


def at_least_32(value: str) -> int:
    n = int(value)
    if n < 32:
        raise argparse.ArgumentTypeError(
            f"must be >= 32 (a token-identity check over fewer tokens proves little), got {value}"
        )
    return n


def positive(value: str) -> int:
    n = int(value)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return n


def register(subparsers: Any) -> None:
    """Add `verify` to the kvtier CLI."""
    summary = "cold -> restart -> warm (from S3) -> purge -> cold, with assertions and a report"
    p = add_command(subparsers, "verify", summary, kvtier_tools.verify.__doc__)
    p.add_argument("--config", help="the server's kvtier YAML (default: $KVTIER_CONFIG)")
    p.add_argument(
        "--server-url", required=True, help="the vLLM server, e.g. http://127.0.0.1:8100"
    )
    p.add_argument("--model", required=True, help="served model name")
    p.add_argument("--api-key-file", help="file holding the server's API key")
    p.add_argument(
        "--restart-command",
        required=True,
        help="restarts the server, e.g. 'supervisorctl restart kvtier-vllm'",
    )
    p.add_argument(
        "--health-timeout",
        type=float,
        default=300.0,
        help="seconds a restarted server gets to answer /health",
    )
    p.add_argument(
        "--gateway-profile", help="profile for the channel test (default: the active one)"
    )
    p.add_argument(
        "--gateway-dir",
        default=None,
        help="gateway profiles directory (default: ~/.config/kvtier/gateways)",
    )
    p.add_argument(
        "--skip-channel-test", action="store_true", help="no gateway here: leave step 1 out"
    )
    p.add_argument("--namespace", default="kvtier-verify")
    p.add_argument("--documents", type=positive, default=4)
    p.add_argument("--document-tokens", type=positive, default=8192)
    p.add_argument("--output-tokens", type=at_least_32, default=32)
    p.add_argument("--seed", type=int, help="documents' seed (default: a new one per run)")
    p.add_argument("--max-warm-cold-ratio", type=ratio, default=0.6)
    p.add_argument("--min-s3-share", type=share, default=0.9, help="in (0, 1]")
    p.add_argument("--host", default="this host", help="name used in the Markdown report")
    p.add_argument(
        "--lock-dir",
        help="where the per-namespace lock file lives (default: /run/lock, else the temp dir)",
    )
    p.add_argument("--json", help="write the JSON report here")
    p.add_argument("--markdown", help="write the Markdown report here")
    p.set_defaults(func=_cmd)
