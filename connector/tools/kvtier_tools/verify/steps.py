"""The run loop of `kvtier verify`: steps 1-5 (see :mod:`kvtier_tools.verify`), one function
each, the first step with a failed check ending the run, and the namespace purged at the end."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

from kvtier.tiers.base import TierError
from kvtier_tools.verify import checks, rounds
from kvtier_tools.verify.checks import Step
from kvtier_tools.verify.rounds import Round, documents, max_model_len, run_round, warm_up
from kvtier_tools.verify.settings import Settings, VerifyError


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


def _run_steps(s: Settings, docs: list[list[int]], chunks_per_doc: int, steps: list[Step]) -> None:
    with timed_step(steps, 1, "channel test through the gateway profile") as step:
        _channel(s, step)
    if not step.ok:
        return
    with timed_step(steps, 2, "cold round") as step:
        measured = _cold(s, docs, step)
    if not step.ok or measured is None:
        return
    cold, reference = measured
    with timed_step(steps, 3, "restart vLLM, clear the host's local tiers") as step:
        ranks = _restart(s, chunks_per_doc, step)
    if not step.ok:
        return
    with timed_step(steps, 4, "warm round (from Ceph only)") as step:
        warm = _warm(s, docs, cold, reference, step, ranks)
    if not step.ok:
        return
    with timed_step(steps, 5, "restart, purge, cold again") as step:
        _cold_again(s, docs, cold, warm, step)


def _purge(s: Settings, only: str | None) -> dict[str, int]:
    from kvtier_tools.admin.chunks import purge_namespace

    try:
        return purge_namespace(s.cfg, s.namespace, only)
    except TierError as exc:
        raise VerifyError(f"purging namespace {s.namespace!r}: {exc.cause}: {exc}") from exc


def _count(s: Settings) -> dict[str, dict[str, int]]:
    """Chunks per tier and layout (one layout per tensor-parallel rank)."""
    from kvtier_tools.admin.chunks import count_chunks_by_layout

    try:
        return count_chunks_by_layout(s.cfg, s.namespace)
    except TierError as exc:
        raise VerifyError(f"listing namespace {s.namespace!r}: {exc.cause}: {exc}") from exc


@contextmanager
def timed_step(steps: list[Step], number: int, name: str) -> Iterator[Step]:
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
    checks.no_kvtier_hits(step, cold)
    return cold


def _channel(s: Settings, step: Step) -> None:
    if s.channel is not None:
        ok, message = s.channel()
        checks.channel_answers(step, ok, message)
    else:
        step.values["skipped"] = "--skip-channel-test"


def _cold(s: Settings, docs: list[list[int]], step: Step) -> tuple[Round, Round] | None:
    """The cold round and its reference; None when the documents do not fit the context."""
    limit = max_model_len(s)
    if limit is not None and not checks.fits_context(
        step, s.document_tokens, s.output_tokens, limit
    ):
        return None
    cold = _cold_round(s, docs, step, "purged_before")
    checks.generated_tokens(step, cold, s.output_tokens)
    # The reference for the warm round: the same documents again, now answered from vLLM's own
    # prefix cache, so the last block is computed over cached KV exactly as after a load. A
    # full prefill (the cold round) sums in another order: in bf16 a near-tie between two
    # tokens can then flip (seen with the tiny model at the 19th output token), with correct KV.
    reference = run_round(s, docs)
    step.values["reference"] = {
        "prefix_cache_hit_tokens": reference.counters.get("vllm:prefix_cache_hits_total", 0.0),
        "output_token_ids": [c.token_ids for c in reference.completions],
    }
    return cold, reference


def _restart(s: Settings, chunks_per_doc: int, step: Step) -> int:
    """Restart, clear the local tiers, count the bucket; the layouts in it (TP ranks)."""
    s.restart()
    warm_up(s)
    step.values["purged_local"] = _purge(s, "disk") if s.cfg.local_disk else {}
    counts = _count(s)
    step.values["objects"] = {tier: sum(by_layout.values()) for tier, by_layout in counts.items()}
    step.values["objects_by_layout"] = counts
    checks.bucket_chunks(step, counts.get("s3"), s.documents, chunks_per_doc)
    checks.disk_tier_empty(step, sum(counts.get("disk", {}).values()))
    return max(1, len(counts.get("s3", {})))


def _warm(
    s: Settings, docs: list[list[int]], cold: Round, reference: Round, step: Step, ranks: int
) -> Round:
    # Tenant isolation first, on the restarted server (vLLM's own cache is empty, the bucket
    # holds the first tenant's chunks): the first document under another cache_salt.
    other = run_round(s, docs[:1], rounds.OTHER_TENANT_SALT)
    step.values["other_tenant"] = {
        "cache_salt": rounds.OTHER_TENANT_SALT,
        "prompt_tokens": other.prompt_tokens,
        "counters": {k: v for k, v in other.counters.items() if v},
    }
    checks.tenant_isolated(step, other)
    warm = run_round(s, docs)
    step.values.update(warm.summary())
    s3_tokens = rounds.s3_tokens(warm, s.cfg.chunk_size, ranks)
    share = s3_tokens / max(1, warm.prompt_tokens)
    step.values.update(s3_served_tokens=int(s3_tokens), s3_share=round(share, 4))
    step.values["warm_cold_ttft_ratio"] = round(warm.median_ttft / cold.median_ttft, 4)
    checks.s3_share(step, s3_tokens, warm.prompt_tokens, s.min_s3_share)
    checks.no_failed_loads(step, warm)
    checks.warm_cold_ratio(step, warm, cold, s.max_warm_cold_ratio)
    checks.same_tokens(step, reference, warm, "cold round's prefix-cache pass")
    step.values["documents_identical_to_full_prefill"] = sum(
        a.token_ids == b.token_ids for a, b in zip(cold.completions, warm.completions, strict=True)
    )
    return warm


def _cold_again(s: Settings, docs: list[list[int]], cold: Round, warm: Round, step: Step) -> None:
    # Restart first: the old server may still be writing the warm round's chunks to the
    # disk tier in the background, which could land after a purge and be hit below.
    s.restart()
    again = _cold_round(s, docs, step, "purged")
    step.values["cold_again_ttft_ratio"] = round(again.median_ttft / cold.median_ttft, 4)
    checks.back_to_cold(step, again, cold, warm)
    checks.same_tokens(step, cold, again, "first cold round")
