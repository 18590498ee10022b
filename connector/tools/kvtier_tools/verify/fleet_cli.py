"""`kvtier verify-fleet`: the arguments, the peers and their keys, the lock, the run, the reports
and the exit status (0 passed, 1 a check failed, 2 bad input)."""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import kvtier_tools.verify.fleet
from kvtier.config import ConfigError, load_config
from kvtier_tools.cli import add_command
from kvtier_tools.completions import CompletionError
from kvtier_tools.verify.checks import Step
from kvtier_tools.verify.cli import at_least_32, positive, share
from kvtier_tools.verify.fleet import FleetSettings, Peer, report, run
from kvtier_tools.verify.lock import default_lock_dir, exclusive
from kvtier_tools.verify.report import markdown
from kvtier_tools.verify.settings import VerifyError

#: One API key per line, in --peer order (an empty line: that peer takes none).
PEER_KEYS_ENV = "KVTIER_PEER_API_KEYS"


def _peer(value: str) -> tuple[str, str]:
    name, sep, url = value.partition("=")
    if not sep or not name or not url.startswith(("http://", "https://")):
        raise argparse.ArgumentTypeError(
            f"must be NAME=URL, e.g. serve2=http://10.0.0.22:8000, got {value!r}"
        )
    return name, url.rstrip("/")


def _peers(args: argparse.Namespace) -> tuple[Peer, ...]:
    raw = os.environ.get(PEER_KEYS_ENV)
    keys: list[str | None] = [None] * len(args.peer)
    if raw is not None:
        lines = raw.split("\n")
        if len(lines) != len(args.peer):
            raise VerifyError(
                f"${PEER_KEYS_ENV} holds {len(lines)} keys for {len(args.peer)} --peer "
                "servers: give one line per peer, in --peer order (an empty line for none)"
            )
        keys = [line.strip() or None for line in lines]
    return tuple(Peer(n, u, k) for (n, u), k in zip(args.peer, keys, strict=True))


def _settings(args: argparse.Namespace) -> FleetSettings:
    try:
        cfg = load_config(args.config)
    except ConfigError as exc:
        raise VerifyError(str(exc)) from exc
    if args.namespace == cfg.namespace or args.namespace not in cfg.request_namespaces:
        raise VerifyError(
            f"namespace {args.namespace!r} must be one of request_namespaces of {cfg.source} "
            f"({list(cfg.request_namespaces)}), not the production namespace: add it there "
            "(vllm_server_kvtier_request_namespaces) on every serving host and restart vLLM"
        )
    if not cfg.remote_url:
        raise VerifyError(f"{cfg.source} has no S3 tier (remote_url): hosts share nothing")
    if args.document_tokens % cfg.chunk_size:
        raise VerifyError(
            f"--document-tokens {args.document_tokens} must be a multiple of chunk_size "
            f"{cfg.chunk_size}, so that the expected number of objects is exact"
        )
    try:
        api_key = Path(args.api_key_file).read_text().strip() if args.api_key_file else None
    except OSError as exc:
        raise VerifyError(f"cannot read --api-key-file: {exc}") from exc
    return FleetSettings(
        server_url=args.server_url.rstrip("/"),
        model=args.model,
        api_key=api_key,
        cfg=cfg,
        namespace=args.namespace,
        documents=args.documents,
        document_tokens=args.document_tokens,
        output_tokens=args.output_tokens,
        seed=args.seed if args.seed is not None else random.SystemRandom().randrange(1 << 31),
        min_s3_share=args.min_s3_share,
        host=args.host,
        peers=_peers(args),
    )


def _cmd(args: argparse.Namespace) -> int:
    try:
        s = _settings(args)
        with exclusive(s.namespace, Path(args.lock_dir) if args.lock_dir else default_lock_dir()):
            return _verify(s, args)
    except VerifyError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


def _verify(s: FleetSettings, args: argparse.Namespace) -> int:
    steps: list[Step] = []
    peers: dict[str, dict[str, Any]] = {}
    error: str | None = None
    started_at = datetime.now(UTC).isoformat(timespec="seconds")
    try:
        peers = run(s, steps)
    except (VerifyError, CompletionError) as exc:
        current = steps[-1] if steps else None
        where = f"step {current.number} ({current.name})" if current else "setup"
        error = f"{where}: {exc}"
    doc = report(s, steps, peers, error, started_at)
    if args.json:
        Path(args.json).write_text(json.dumps(doc, indent=2) + "\n")
    title = f"{s.host} -> {', '.join(p.name for p in s.peers)} (cross-node)"
    if args.markdown:
        Path(args.markdown).write_text(markdown(doc, title))
    for step in doc["steps"]:
        print(f"step {step['number']} {step['name']}: {'ok' if step['ok'] else 'FAILED'}")
        for c in step["checks"]:
            print(
                f"  [{'ok' if c['ok'] else 'FAIL'}] {c['what']}: expected {c['expected']}, "
                f"measured {c['measured']}"
            )
    for name, figures in peers.items():
        print(
            f"{name}: TTFT {figures['median_ttft_seconds']} s from Ceph vs "
            f"{figures['prefill_median_ttft_seconds']} s prefill on {s.host} "
            f"({figures['ttft_ratio_to_prefill']}x), S3 share {figures['s3_share']}"
        )
    if doc["ok"]:
        print("kv_verify: PASSED")
        return 0
    print(f"kv_verify: FAILED: {doc['failure']}", file=sys.stderr)
    return 1


def register(subparsers: Any) -> None:
    """Add `verify-fleet` to the kvtier CLI."""
    summary = "prefill on this server, then every peer must load the documents from Ceph"
    p = add_command(subparsers, "verify-fleet", summary, kvtier_tools.verify.fleet.__doc__)
    p.add_argument("--config", help="this server's kvtier YAML (default: $KVTIER_CONFIG)")
    p.add_argument("--server-url", required=True, help="this host's vLLM server")
    p.add_argument("--model", required=True, help="served model name (the same on every host)")
    p.add_argument("--api-key-file", help="file holding this server's API key")
    p.add_argument(
        "--peer",
        type=_peer,
        action="append",
        required=True,
        metavar="NAME=URL",
        help=f"another serving host's server (repeat); keys in ${PEER_KEYS_ENV}",
    )
    p.add_argument("--namespace", default="kvtier-verify-fleet")
    p.add_argument("--documents", type=positive, default=2)
    p.add_argument("--document-tokens", type=positive, default=8192)
    p.add_argument("--output-tokens", type=at_least_32, default=32)
    p.add_argument("--seed", type=int, help="documents' seed (default: a new one per run)")
    p.add_argument("--min-s3-share", type=share, default=0.9, help="in (0, 1]")
    p.add_argument("--host", default="this host", help="this host's name in the report")
    p.add_argument(
        "--lock-dir",
        help="where the per-namespace lock file lives (default: /run/lock, else the temp dir)",
    )
    p.add_argument("--json", help="write the JSON report here")
    p.add_argument("--markdown", help="write the Markdown report here")
    p.set_defaults(func=_cmd)
