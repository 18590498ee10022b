"""`kvtier verify-fleet`: what one serving host computes, every other one loads from Ceph.

The cross-node check of a fleet that shares one bucket (the ``kv_verify`` role runs it from the
first serving host once every host verified itself):

1. prefill: purge the namespace from this host's disk tier and the bucket, send N documents of
   random token ids (a new seed per run, so no tier of any host holds them) to this host's
   server; 0 tokens come from kvtier. The same documents again give the reference outputs
   (answered by vLLM's prefix cache: the same arithmetic as after a load).
2. bucket: once the background writes landed, the bucket holds one object per chunk.
3. one step per peer: the same requests to the peer's server, whose CPU and disk tiers never
   saw these documents: its S3 tier serves >= ``min_s3_share`` of the prompt tokens, no load
   fails, the outputs are token-identical to the reference. The TTFT of the peer over this
   host's cold round is reported.

The namespace is purged from this host's tiers and the bucket at the end; what a peer loaded
also went into its own disk tier, which a purge on that peer removes (the role does it). Peers'
API keys come from ``$KVTIER_PEER_API_KEYS``, one per line in ``--peer`` order (never argv).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from kvtier.config import KvtierConfig
from kvtier.tiers.base import TierError
from kvtier_tools.verify import checks
from kvtier_tools.verify.checks import Step
from kvtier_tools.verify.report import document
from kvtier_tools.verify.rounds import Round, documents, run_round, s3_tokens, warm_up
from kvtier_tools.verify.settings import VerifyError
from kvtier_tools.verify.steps import timed_step

#: Seconds the bucket gets to show every chunk of the prefill (background writes).
_OBJECTS_TIMEOUT = 60.0


@dataclass(frozen=True)
class Peer:
    name: str
    url: str
    api_key: str | None


@dataclass(frozen=True)
class FleetSettings:
    """A `verify.rounds.Target` for this host's server; `at()` gives the one of a peer."""

    server_url: str
    model: str
    api_key: str | None
    cfg: KvtierConfig
    namespace: str
    documents: int
    document_tokens: int
    output_tokens: int
    seed: int
    min_s3_share: float
    host: str
    peers: tuple[Peer, ...] = field(default_factory=tuple)
    metrics_settle_secs: float = 1.5

    def at(self, peer: Peer) -> FleetSettings:
        return replace(self, server_url=peer.url, api_key=peer.api_key, host=peer.name)


def run(s: FleetSettings, steps: list[Step]) -> dict[str, dict[str, Any]]:
    """Steps 1, 2 and one per peer into ``steps``; stops at the first failed step. Returns the
    per-peer figures. The namespace is purged from this host's tiers at the end."""
    docs = documents(s.documents, s.document_tokens, s.seed)
    peers: dict[str, dict[str, Any]] = {}
    try:
        _run_steps(s, docs, steps, peers)
    finally:
        try:
            _purge(s)
        except VerifyError as exc:
            print(f"warning: final purge of {s.namespace!r} failed: {exc}", file=sys.stderr)
    return peers


def _run_steps(
    s: FleetSettings, docs: list[list[int]], steps: list[Step], peers: dict[str, dict[str, Any]]
) -> None:
    with timed_step(steps, 1, f"prefill on {s.host}") as step:
        step.values["purged_before"] = _purge(s)
        warm_up(s)
        cold = run_round(s, docs)
        step.values.update(cold.summary())
        checks.no_kvtier_hits(step, cold)
        reference = run_round(s, docs)
        step.values["reference"] = {
            "output_token_ids": [c.token_ids for c in reference.completions]
        }
    if not step.ok:
        return
    with timed_step(steps, 2, "chunks in the bucket") as step:
        chunks_per_doc = s.document_tokens // s.cfg.chunk_size
        stored = _wait_for_objects(s, s.documents * chunks_per_doc)
        checks.bucket_chunks(step, stored, s.documents, chunks_per_doc)
    if not step.ok:
        return
    for number, peer in enumerate(s.peers, start=3):
        with timed_step(
            steps, number, f"{peer.name} loads from Ceph what {s.host} computed"
        ) as step:
            peers[peer.name] = _peer(s.at(peer), docs, cold, reference, step, len(stored))
        if not step.ok:
            return


def _peer(
    s: FleetSettings,
    docs: list[list[int]],
    cold: Round,
    reference: Round,
    step: Step,
    ranks: int,
) -> dict[str, Any]:
    warm_up(s)
    warm = run_round(s, docs)
    step.values.update(warm.summary())
    from_s3 = s3_tokens(warm, s.cfg.chunk_size, ranks)
    ratio = warm.median_ttft / cold.median_ttft
    checks.s3_share(step, from_s3, warm.prompt_tokens, s.min_s3_share)
    checks.no_failed_loads(step, warm)
    identical = checks.same_tokens(step, reference, warm, "prefill host's prefix-cache pass")
    figures = {
        "url": s.server_url,
        "s3_share": round(from_s3 / max(1, warm.prompt_tokens), 4),
        "identical": identical,
        "median_ttft_seconds": round(warm.median_ttft, 4),
        "prefill_median_ttft_seconds": round(cold.median_ttft, 4),
        "ttft_ratio_to_prefill": round(ratio, 4),
    }
    step.values.update(figures)
    return figures


def _purge(s: FleetSettings) -> dict[str, int]:
    from kvtier_tools.admin.chunks import purge_namespace

    try:
        return purge_namespace(s.cfg, s.namespace)
    except TierError as exc:
        raise VerifyError(f"purging namespace {s.namespace!r}: {exc.cause}: {exc}") from exc


def _wait_for_objects(s: FleetSettings, wanted: int) -> dict[str, int]:
    """Chunks in the bucket per layout (one per TP rank), once each holds ``wanted``."""
    from kvtier_tools.admin.chunks import count_chunks_by_layout

    deadline = time.monotonic() + _OBJECTS_TIMEOUT
    while True:
        try:
            stored = count_chunks_by_layout(s.cfg, s.namespace, "s3").get("s3", {})
        except TierError as exc:
            raise VerifyError(f"listing namespace {s.namespace!r}: {exc.cause}: {exc}") from exc
        if (stored and min(stored.values()) >= wanted) or time.monotonic() > deadline:
            return stored
        time.sleep(0.5)  # the server's background writes: nothing to wait on but the listing


def report(
    s: FleetSettings,
    steps: Sequence[Step],
    peers: dict[str, dict[str, Any]],
    error: str | None,
    started_at: str,
) -> dict[str, Any]:
    doc = document(
        s, steps, 2 + len(s.peers), error, s.host, started_at, {"min_s3_share": s.min_s3_share}
    )
    doc["peers"] = peers
    return doc
