"""Talking to the server under verification: the documents, one round of requests with the
counter deltas around it, ``/health``, ``/v1/models`` and the restart command."""

from __future__ import annotations

import json
import random
import shlex
import statistics
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from kvtier_tools.completions import Completion, stream_completion
from kvtier_tools.verify.settings import VerifyError

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
#: The cache_salt of every verification request (its tenant), and another tenant's, whose
#: request for the same document must get nothing of it (step 4's isolation check).
TENANT_SALT = "kvtier-verify-tenant-a"
OTHER_TENANT_SALT = "kvtier-verify-tenant-b"


class Target(Protocol):
    """What a round needs of the server it talks to (Settings, and each host of verify-fleet)."""

    @property
    def server_url(self) -> str: ...
    @property
    def model(self) -> str: ...
    @property
    def api_key(self) -> str | None: ...
    @property
    def namespace(self) -> str: ...
    @property
    def output_tokens(self) -> int: ...
    @property
    def seed(self) -> int: ...
    @property
    def metrics_settle_secs(self) -> float: ...


def documents(count: int, tokens: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(*_TOKEN_RANGE) for _ in range(tokens)] for _ in range(count)]


# ------------------------------------------------------------------------------- server access
def scrape(server_url: str) -> dict[str, float]:
    """The counters of `_COUNTERS`/`_TIER_COUNTERS` summed over label sets (per tier)."""
    from kvtier_tools.server import metric_sum, parse_metrics

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


def s3_tokens(r: Round, chunk_size: int, ranks: int = 1) -> float:
    """Prompt tokens of a round that the S3 tier served (its verified chunks, at most what was
    loaded: a chunk's last block may be one vLLM computes). Each of a server's ``ranks``
    (tensor parallelism: one layout per rank in the bucket) loads and counts its own share of
    every token: the counters are divided by them."""
    s3_chunks = r.counters["kvtier:tier_hits_total{tier=s3}"]
    return min(s3_chunks * chunk_size, r.counters["kvtier:loaded_tokens_total"]) / max(1, ranks)


def _request(s: Target, doc: Sequence[int], max_tokens: int, salt: str = TENANT_SALT) -> Completion:
    return stream_completion(
        s.server_url,
        s.model,
        doc,
        max_tokens,
        api_key=s.api_key,
        extra_body={"kv_transfer_params": {"kvtier_namespace": s.namespace}, "cache_salt": salt},
    )


def warm_up(s: Target) -> None:
    """One short request, so that a fresh server's first-request costs do not land in the first
    document's TTFT. Shorter than any KV block (vLLM's smallest is 16 tokens): nothing of it can
    be stored, even with ``save_unfull_chunk``, so the object count stays exact."""
    _request(s, documents(1, 8, s.seed + 1)[0], 4)


def max_model_len(s: Target) -> int | None:
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


def run_round(s: Target, docs: Sequence[Sequence[int]], salt: str = TENANT_SALT) -> Round:
    before = scrape(s.server_url)
    start = time.monotonic()
    completions = [_request(s, doc, s.output_tokens, salt) for doc in docs]
    seconds = time.monotonic() - start
    # Counters reach /metrics with the engine's next stats interval, after the last step.
    time.sleep(s.metrics_settle_secs)
    after = scrape(s.server_url)
    return Round(completions, {k: after[k] - before.get(k, 0.0) for k in after}, seconds)
