"""`kvtier verify`: cold → restart → warm → purge → cold against one running vLLM server.

The check operators run after every change (the ``kv_verify`` role runs it on each serving
host). It works in its own namespace: every request carries
``kv_transfer_params: {"kvtier_namespace": <namespace>}``, which the server's kvtier config must
list in ``request_namespaces``, so production chunks are never read, written or purged.

Steps (each a list of checks; the first failing step ends the run, the report says which check
failed, what was expected and what was measured):

1. channel: a minimal chat completion through the gateway profile (the active one unless
   ``--gateway-profile`` names another) answers with ``choices``; skipped only when asked.
2. cold: purge the namespace from the disk and S3 tiers, send N documents of random token ids
   (a new seed per run, so nothing anywhere can be cached); 0 tokens come from kvtier.
3. restart: restart vLLM (empties its prefix cache and CPU tier), purge the namespace from the
   host's disk tier, so the next round can only be served from Ceph; the bucket holds one object
   per chunk of the documents.
4. warm: the same requests; S3 served >= ``min_s3_share`` of the prompt tokens, median TTFT
   warm/cold <= ``max_warm_cold_ratio``, outputs token-identical to a second pass of the cold
   round served by vLLM's own prefix cache (same arithmetic as after a load: bit-exact KV
   gives the same tokens; a full prefill may flip a near-tie in bf16).
5. cold again: restart, purge the namespace from every tier, same requests: 0 tokens from
   kvtier, median TTFT back near the first cold round (above the geometric mean of the cold and
   warm medians), identical outputs.

The namespace is purged again at the end, whatever happened. One verification per namespace
runs on a host at a time (a lock file in /run/lock); a second one exits with an error.
Counters come from the server's ``/metrics`` (deltas around each round): traffic of other
clients during a round adds to them, so verify a host while it is drained of user traffic.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import math
import os
import random
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from kvtier.completions import Completion, CompletionError, stream_completion
from kvtier.config import ConfigError, KvtierConfig, load_config
from kvtier.tiers.base import TierError

#: Ordinary vocabulary range of token ids for the random documents (any model with >= 8000
#: tokens in its vocabulary; all common ones have far more).
_TOKEN_RANGE = (300, 8000)

#: Prometheus samples the report keeps (deltas per round); tier-labelled ones per tier.
_COUNTERS = (
    "vllm:prefix_cache_hits_total",
    "kvtier:lookup_tokens_total",
    "kvtier:hit_tokens_total",
    "kvtier:loaded_tokens_total",
    "kvtier:load_failed_tokens_total",
    "kvtier:saved_chunks_total",
    "kvtier:dropped_writes_total",
    "vllm:prompt_tokens_total",
    "vllm:external_prefix_cache_hits_total",
)
_TIER_COUNTERS = ("kvtier:hit_tokens_by_tier_total", "kvtier:tier_hits_total")
_TIERS = ("cpu", "disk", "s3")


class VerifyError(Exception):
    """A problem with the inputs or the environment (not a failed check)."""


@dataclass
class Check:
    what: str
    expected: str
    measured: str
    ok: bool


@dataclass
class Step:
    number: int
    name: str
    checks: list[Check] = field(default_factory=list)
    values: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.checks)

    def check(self, what: str, ok: bool, expected: str, measured: str) -> bool:
        self.checks.append(Check(what, expected, measured, ok))
        return ok


@dataclass
class Settings:
    server_url: str
    model: str
    api_key: str | None
    cfg: KvtierConfig
    namespace: str
    documents: int
    document_tokens: int
    output_tokens: int
    seed: int
    restart: Callable[[], None]
    health_timeout: float
    max_warm_cold_ratio: float
    min_s3_share: float
    channel: Callable[[], tuple[bool, str]] | None = None
    #: vLLM publishes counters with its stats interval: wait this long after a round.
    metrics_settle_secs: float = 1.5


def documents(count: int, tokens: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(*_TOKEN_RANGE) for _ in range(tokens)] for _ in range(count)]


# ------------------------------------------------------------------------------- server access
def scrape(server_url: str) -> dict[str, float]:
    """The counters of `_COUNTERS`/`_TIER_COUNTERS` summed over label sets (per tier)."""
    from kvtier.vllm.server import metric_sum, parse_metrics  # stdlib-only module

    try:
        with urllib.request.urlopen(server_url.rstrip("/") + "/metrics", timeout=10) as resp:
            samples = parse_metrics(resp.read().decode())
    except (urllib.error.URLError, OSError) as exc:
        raise VerifyError(f"cannot read {server_url}/metrics: {exc}") from exc
    out = {name: metric_sum(samples, name) for name in _COUNTERS}
    for name in _TIER_COUNTERS:
        for tier in _TIERS:
            out[f"{name}{{tier={tier}}}"] = metric_sum(samples, name, tier=tier)
    return out


def wait_healthy(server_url: str, timeout: float) -> float:
    """Seconds until ``/health`` answered 200; VerifyError after ``timeout``."""
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        try:
            with urllib.request.urlopen(server_url.rstrip("/") + "/health", timeout=5) as resp:
                if resp.status == 200:
                    return time.monotonic() - start
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(1.0)
    raise VerifyError(f"{server_url}/health did not answer 200 within {timeout:.0f} s")


def command_restart(command: str, server_url: str, timeout: float) -> Callable[[], None]:
    """A restart that runs ``command`` (e.g. ``supervisorctl restart kvtier-vllm``)."""

    def restart() -> None:
        try:
            done = subprocess.run(
                shlex.split(command), capture_output=True, text=True, timeout=timeout, check=False
            )
        except subprocess.TimeoutExpired as exc:
            raise VerifyError(f"restart command {command!r} took over {timeout:.0f} s") from exc
        except OSError as exc:
            raise VerifyError(f"restart command {command!r} cannot run: {exc}") from exc
        if done.returncode != 0:
            raise VerifyError(
                f"restart command {command!r} failed ({done.returncode}): "
                f"{(done.stderr or done.stdout).strip()[-500:]}"
            )
        # supervisorctl and systemctl restart return once the old process is gone and the
        # new one started; the new one answers /health only when its engine is up.
        wait_healthy(server_url, timeout)

    return restart


# ------------------------------------------------------------------------------------ rounds
@dataclass
class Round:
    completions: list[Completion]
    counters: dict[str, float]
    seconds: float

    @property
    def median_ttft(self) -> float:
        return statistics.median(c.ttft for c in self.completions)

    @property
    def prompt_tokens(self) -> int:
        return sum(c.prompt_tokens for c in self.completions)

    def summary(self) -> dict[str, Any]:
        return {
            "ttft_seconds": [round(c.ttft, 4) for c in self.completions],
            "median_ttft_seconds": round(self.median_ttft, 4),
            "prompt_tokens": self.prompt_tokens,
            "generated_tokens": [len(c.token_ids) for c in self.completions],
            "output_token_ids": [c.token_ids for c in self.completions],
            "seconds": round(self.seconds, 2),
            "counters": {k: v for k, v in self.counters.items() if v},
        }


def _request(s: Settings, doc: Sequence[int], max_tokens: int) -> Completion:
    return stream_completion(
        s.server_url,
        s.model,
        doc,
        max_tokens,
        api_key=s.api_key,
        extra_body={"kv_transfer_params": {"kvtier_namespace": s.namespace}},
    )


def warm_up(s: Settings) -> None:
    """One short request, so that a fresh server's first-request costs do not land in the first
    document's TTFT. Shorter than any KV block (vLLM's smallest is 16 tokens): nothing of it can
    be stored, even with ``save_unfull_chunk``, so the object count stays exact."""
    _request(s, documents(1, 8, s.seed + 1)[0], 4)


def max_model_len(s: Settings) -> int | None:
    """The served model's context limit from ``/v1/models`` (None if the server omits it)."""
    request = urllib.request.Request(s.server_url.rstrip("/") + "/v1/models")
    if s.api_key:
        request.add_header("Authorization", f"Bearer {s.api_key}")
    try:
        with urllib.request.urlopen(request, timeout=30) as resp:
            models = json.loads(resp.read())["data"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise VerifyError(f"cannot read {s.server_url}/v1/models: {exc!r}") from exc
    for model in models:
        if isinstance(model, dict) and model.get("id") == s.model:
            limit = model.get("max_model_len")
            return int(limit) if limit else None
    raise VerifyError(
        f"{s.server_url} does not serve model {s.model!r} "
        f"(it serves {[m.get('id') for m in models if isinstance(m, dict)]})"
    )


def run_round(s: Settings, docs: Sequence[Sequence[int]]) -> Round:
    before = scrape(s.server_url)
    start = time.monotonic()
    completions = [_request(s, doc, s.output_tokens) for doc in docs]
    seconds = time.monotonic() - start
    # Counters reach /metrics with the engine's next stats interval, after the last step.
    time.sleep(s.metrics_settle_secs)
    after = scrape(s.server_url)
    return Round(completions, {k: after[k] - before.get(k, 0.0) for k in after}, seconds)


def _same_tokens(step: Step, a: Round, b: Round, against: str) -> bool:
    differing = [
        i
        for i, (x, y) in enumerate(zip(a.completions, b.completions, strict=True))
        if x.token_ids != y.token_ids
    ]
    return step.check(
        f"outputs token-identical to the {against}",
        not differing,
        f"{len(a.completions)} of {len(a.completions)} documents identical",
        "all identical" if not differing else f"documents {differing} differ",
    )


# ------------------------------------------------------------------------------------ the run
def run(s: Settings, steps: list[Step]) -> None:
    """Steps 1-5 into ``steps``; stops after the first step with a failed check. Purges at the
    end. On VerifyError / CompletionError, the last step in ``steps`` is the one that broke off."""
    docs = documents(s.documents, s.document_tokens, s.seed)
    chunks_per_doc = s.document_tokens // s.cfg.chunk_size
    try:
        _run_steps(s, docs, chunks_per_doc, steps)
    finally:
        try:
            _purge(s, None)
        except VerifyError as exc:
            print(
                f"warning: final purge of namespace {s.namespace!r} failed: {exc}", file=sys.stderr
            )


def _purge(s: Settings, only: str | None) -> dict[str, int]:
    from kvtier.admin.chunks import purge_namespace

    try:
        return purge_namespace(s.cfg, s.namespace, only)
    except TierError as exc:
        raise VerifyError(f"purging namespace {s.namespace!r}: {exc.cause}: {exc}") from exc


def _count(s: Settings) -> dict[str, int]:
    from kvtier.admin.chunks import count_chunks

    try:
        return count_chunks(s.cfg, s.namespace)
    except TierError as exc:
        raise VerifyError(f"listing namespace {s.namespace!r}: {exc.cause}: {exc}") from exc


@contextmanager
def _step(steps: list[Step], number: int, name: str) -> Iterator[Step]:
    """A new step appended to ``steps``, timed even when it breaks off with an exception."""
    step = Step(number, name)
    steps.append(step)
    start = time.monotonic()
    try:
        yield step
    finally:
        step.seconds = time.monotonic() - start


def _cold_round(s: Settings, docs: list[list[int]], step: Step, purged_key: str) -> Round:
    """Purge the namespace everywhere, then a round that nothing may serve from kvtier."""
    step.values[purged_key] = _purge(s, None)
    warm_up(s)
    cold = run_round(s, docs)
    step.values.update(cold.summary())
    hits = cold.counters["kvtier:hit_tokens_total"]
    step.check("prompt tokens served by kvtier", hits == 0, "0", f"{hits:.0f}")
    return cold


def _run_steps(s: Settings, docs: list[list[int]], chunks_per_doc: int, steps: list[Step]) -> None:
    with _step(steps, 1, "channel test through the gateway profile") as step:
        if s.channel is not None:
            ok, message = s.channel()
            step.check("gateway answers a chat completion with choices", ok, "OK", message)
        else:
            step.values["skipped"] = "--skip-channel-test"
    if not step.ok:
        return

    with _step(steps, 2, "cold round") as step:
        limit = max_model_len(s)
        needed = s.document_tokens + s.output_tokens
        if limit is not None and not step.check(
            "document + output tokens fit the model's context (max_model_len)",
            needed <= limit,
            f"<= {limit}",
            f"{needed} ({s.document_tokens} + {s.output_tokens})"
            + ("" if needed <= limit else ": lower the document length"),
        ):
            return
        cold = _cold_round(s, docs, step, "purged_before")
        step.check(
            "generated tokens per document",
            all(len(c.token_ids) == s.output_tokens for c in cold.completions),
            str(s.output_tokens),
            str([len(c.token_ids) for c in cold.completions]),
        )
        # The reference for the warm round: the same documents again, now answered from vLLM's own
        # prefix cache, so the last block is computed over cached KV exactly as after a load. A
        # full prefill (the cold round) sums in another order: in bf16 a near-tie between two
        # tokens can then flip (seen with the tiny model at the 19th output token), with correct KV.
        reference = run_round(s, docs)
        step.values["reference"] = {
            "prefix_cache_hit_tokens": reference.counters.get("vllm:prefix_cache_hits_total", 0.0),
            "output_token_ids": [c.token_ids for c in reference.completions],
        }
    if not step.ok:
        return

    with _step(steps, 3, "restart vLLM, clear the host's local tiers") as step:
        s.restart()
        warm_up(s)
        step.values["purged_local"] = _purge(s, "disk") if s.cfg.local_disk else {}
        counts = _count(s)
        step.values["objects"] = counts
        expected = s.documents * chunks_per_doc
        stored = counts.get("s3")
        step.check(
            "chunk objects in the bucket (namespace)",
            stored == expected,
            f"{expected} ({s.documents} documents x {chunks_per_doc} chunks)",
            "no S3 tier configured" if stored is None else str(stored),
        )
        step.check(
            "chunks left on the host's disk tier",
            counts.get("disk", 0) == 0,
            "0",
            str(counts.get("disk", 0)),
        )
    if not step.ok:
        return

    with _step(steps, 4, "warm round (from Ceph only)") as step:
        warm = run_round(s, docs)
        step.values.update(warm.summary())
        s3_chunks = warm.counters["kvtier:tier_hits_total{tier=s3}"]
        loaded = warm.counters["kvtier:loaded_tokens_total"]
        s3_tokens = min(s3_chunks * s.cfg.chunk_size, loaded)
        share = s3_tokens / max(1, warm.prompt_tokens)
        ratio = warm.median_ttft / cold.median_ttft
        step.values.update(s3_served_tokens=int(s3_tokens), s3_share=round(share, 4))
        step.values["warm_cold_ttft_ratio"] = round(ratio, 4)
        step.check(
            "share of prompt tokens served by the S3 tier",
            share >= s.min_s3_share,
            f">= {s.min_s3_share:g}",
            f"{share:.3f} ({s3_tokens:.0f} of {warm.prompt_tokens} tokens)",
        )
        failed = warm.counters["kvtier:load_failed_tokens_total"]
        step.check("tokens whose load failed", failed == 0, "0", f"{failed:.0f}")
        step.check(
            "median TTFT warm / cold",
            ratio <= s.max_warm_cold_ratio,
            f"<= {s.max_warm_cold_ratio:g}",
            f"{ratio:.3f} ({warm.median_ttft:.3f} s / {cold.median_ttft:.3f} s)",
        )
        _same_tokens(step, reference, warm, "cold round's prefix-cache pass")
        step.values["documents_identical_to_full_prefill"] = sum(
            a.token_ids == b.token_ids
            for a, b in zip(cold.completions, warm.completions, strict=True)
        )
    if not step.ok:
        return

    with _step(steps, 5, "restart, purge, cold again") as step:
        # Restart first: the old server may still be writing the warm round's chunks to the
        # disk tier in the background, which could land after a purge and be hit below.
        s.restart()
        again = _cold_round(s, docs, step, "purged")
        # "Back to cold" on a noisy host: nearer the first cold round than the warm one on a log
        # scale, i.e. above their geometric mean (cold TTFT alone varies 2x between rounds on a
        # busy 2-core machine; a hit is 5-10x faster).
        bound = math.sqrt(cold.median_ttft * warm.median_ttft)
        step.values["cold_again_ttft_ratio"] = round(again.median_ttft / cold.median_ttft, 4)
        step.check(
            "median TTFT cold again, nearer the first cold round than the warm round",
            again.median_ttft >= bound,
            f">= {bound:.3f} s (geometric mean of warm {warm.median_ttft:.3f} s and first cold "
            f"{cold.median_ttft:.3f} s)",
            f"{again.median_ttft:.3f} s",
        )
        _same_tokens(step, cold, again, "first cold round")


# ------------------------------------------------------------------------------------ reports
def first_failure(steps: Sequence[Step]) -> str | None:
    """``step N (name): what: expected X, measured Y`` of the first failed check."""
    for step in steps:
        for c in step.checks:
            if not c.ok:
                return (
                    f"step {step.number} ({step.name}): {c.what}: expected {c.expected}, "
                    f"measured {c.measured}"
                )
    return None


def report(
    s: Settings, steps: Sequence[Step], error: str | None, host: str = "", started_at: str = ""
) -> dict[str, Any]:
    failure = error or first_failure(steps)
    if failure is None and len(steps) < 5:
        failure = f"stopped after step {len(steps)}"
    return {
        "ok": failure is None,
        "failure": failure,
        "host": host,
        "started_at": started_at,
        "server_url": s.server_url,
        "model": s.model,
        "namespace": s.namespace,
        "config": s.cfg.source,
        "documents": s.documents,
        "document_tokens": s.document_tokens,
        "output_tokens": s.output_tokens,
        "chunk_size": s.cfg.chunk_size,
        "seed": s.seed,
        "thresholds": {
            "max_warm_cold_ratio": s.max_warm_cold_ratio,
            "min_s3_share": s.min_s3_share,
        },
        "steps": [
            {**asdict(step), "ok": step.ok, "seconds": round(step.seconds, 2)} for step in steps
        ],
    }


def markdown(doc: dict[str, Any], host: str) -> str:
    verdict = "PASSED" if doc["ok"] else f"FAILED: {doc['failure']}"
    lines = [
        f"# kv_verify on {host}: {verdict}",
        "",
        f"Server {doc['server_url']} (model {doc['model']}), namespace `{doc['namespace']}`, "
        f"{doc['documents']} documents x {doc['document_tokens']} tokens, "
        f"{doc['output_tokens']} output tokens, chunk size {doc['chunk_size']}, "
        f"seed {doc['seed']}, started {doc['started_at']}.",
        "",
    ]
    for step in doc["steps"]:
        mark = "ok" if step["ok"] else "FAILED"
        lines += [f"## Step {step['number']}: {step['name']} ({mark}, {step['seconds']} s)", ""]
        if step["checks"]:
            lines += ["| check | expected | measured | |", "|---|---|---|---|"]
            for c in step["checks"]:
                lines.append(
                    f"| {c['what']} | {c['expected']} | {c['measured']} | "
                    f"{'ok' if c['ok'] else '**FAILED**'} |"
                )
            lines.append("")
        if "median_ttft_seconds" in step["values"]:
            v = step["values"]
            lines += [
                f"Median TTFT {v['median_ttft_seconds']} s (per document: "
                f"{', '.join(str(t) for t in v['ttft_seconds'])}), {v['prompt_tokens']} prompt "
                f"tokens, round {v['seconds']} s.",
                "",
            ]
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------------ lock
def default_lock_dir() -> Path:
    run_lock = Path("/run/lock")
    return run_lock if os.access(run_lock, os.W_OK) else Path(tempfile.gettempdir())


@contextmanager
def exclusive(namespace: str, lock_dir: Path) -> Iterator[None]:
    """Hold the host's lock for ``namespace``: a second verification of the same namespace
    would purge its chunks and restart the server under the first one."""
    path = lock_dir / f"kvtier-verify.{namespace}.lock"
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
    except OSError as exc:
        raise VerifyError(f"cannot open the lock file {path}: {exc}") from exc
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            raise VerifyError(
                f"another kvtier verify of namespace {namespace!r} is running on this host "
                f"(pid {holder}, lock {path}); run again when it has finished"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield
    finally:
        os.close(fd)  # releases the lock


# ------------------------------------------------------------------------------------ CLI
def _settings(args: argparse.Namespace) -> Settings:
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
    try:
        api_key = Path(args.api_key_file).read_text().strip() if args.api_key_file else None
    except OSError as exc:
        raise VerifyError(f"cannot read --api-key-file: {exc}") from exc
    channel: Callable[[], tuple[bool, str]] | None = None
    if not args.skip_channel_test:
        from kvtier.gateway.channel import check_profile
        from kvtier.gateway.profile import (
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
        channel=channel,
    )


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


def _ratio(value: str) -> float:
    x = float(value)
    if x <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {value}")
    return x


def _share(value: str) -> float:
    x = float(value)
    if not 0 < x <= 1:
        raise argparse.ArgumentTypeError(f"must be a share in (0, 1], got {value}")
    return x


def _at_least_32(value: str) -> int:
    n = int(value)
    if n < 32:
        raise argparse.ArgumentTypeError(
            f"must be >= 32 (a token-identity check over fewer tokens proves little), got {value}"
        )
    return n


def _positive(value: str) -> int:
    n = int(value)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return n


def register(subparsers: Any) -> None:
    """Add `verify` to the kvtier CLI."""
    p = subparsers.add_parser(
        "verify",
        help="cold -> restart -> warm (from S3) -> purge -> cold, with assertions and a report",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
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
    p.add_argument("--documents", type=_positive, default=4)
    p.add_argument("--document-tokens", type=_positive, default=8192)
    p.add_argument("--output-tokens", type=_at_least_32, default=32)
    p.add_argument("--seed", type=int, help="documents' seed (default: a new one per run)")
    p.add_argument("--max-warm-cold-ratio", type=_ratio, default=0.6)
    p.add_argument("--min-s3-share", type=_share, default=0.9, help="in (0, 1]")
    p.add_argument("--host", default="this host", help="name used in the Markdown report")
    p.add_argument(
        "--lock-dir",
        help="where the per-namespace lock file lives (default: /run/lock, else the temp dir)",
    )
    p.add_argument("--json", help="write the JSON report here")
    p.add_argument("--markdown", help="write the Markdown report here")
    p.set_defaults(func=_cmd)
