"""The checks of a verification: each one a small function that records, in its step, what was
checked, the expected and the measured value, and returns whether it passed."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from kvtier_tools.verify.rounds import Round


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


def channel_answers(step: Step, ok: bool, message: str) -> bool:
    return step.check("gateway answers a chat completion with choices", ok, "OK", message)


def fits_context(step: Step, document_tokens: int, output_tokens: int, limit: int) -> bool:
    needed = document_tokens + output_tokens
    return step.check(
        "document + output tokens fit the model's context (max_model_len)",
        needed <= limit,
        f"<= {limit}",
        f"{needed} ({document_tokens} + {output_tokens})"
        + ("" if needed <= limit else ": lower the document length"),
    )


def no_kvtier_hits(step: Step, cold: Round) -> bool:
    hits = cold.counters["kvtier:hit_tokens_total"]
    return step.check("prompt tokens served by kvtier", hits == 0, "0", f"{hits:.0f}")


def generated_tokens(step: Step, cold: Round, output_tokens: int) -> bool:
    return step.check(
        "generated tokens per document",
        all(len(c.token_ids) == output_tokens for c in cold.completions),
        str(output_tokens),
        str([len(c.token_ids) for c in cold.completions]),
    )


def bucket_chunks(
    step: Step, stored: dict[str, int] | None, documents: int, chunks_per_doc: int
) -> bool:
    """Every layout in the bucket (one per tensor-parallel rank) holds every chunk."""
    expected = documents * chunks_per_doc
    if stored is None:
        measured = "no S3 tier configured"
    elif len(stored) <= 1:
        measured = str(sum(stored.values()))
    else:
        measured = ", ".join(f"{n} (layout {fp[:8]})" for fp, n in sorted(stored.items()))
    return step.check(
        "chunks in the bucket (namespace), per layout (one per tensor-parallel rank)",
        bool(stored) and all(n == expected for n in (stored or {}).values()),
        f"{expected} ({documents} documents x {chunks_per_doc} chunks)",
        measured,
    )


def disk_tier_empty(step: Step, disk_chunks: int) -> bool:
    return step.check(
        "chunks left on the host's disk tier", disk_chunks == 0, "0", str(disk_chunks)
    )


def s3_share(step: Step, s3_tokens: float, prompt_tokens: int, min_share: float) -> bool:
    share = s3_tokens / max(1, prompt_tokens)
    return step.check(
        "share of prompt tokens served by the S3 tier",
        share >= min_share,
        f">= {min_share:g}",
        f"{share:.3f} ({s3_tokens:.0f} of {prompt_tokens} tokens)",
    )


def tenant_isolated(step: Step, other: Round) -> bool:
    """Another tenant's request (another cache_salt) for a stored document: kvtier looked it
    up, and served it nothing."""
    looked_up = other.counters["kvtier:lookup_tokens_total"]
    served = max(
        other.counters["kvtier:hit_tokens_total"],
        other.counters["vllm:external_prefix_cache_hits_total"],
    )
    return step.check(
        "another tenant's request (cache_salt) for a stored document: prompt tokens from kvtier",
        served == 0 and looked_up >= other.prompt_tokens,
        f"0 (of {other.prompt_tokens} looked up)",
        f"{served:.0f} (of {looked_up:.0f} looked up)",
    )


def no_failed_loads(step: Step, warm: Round) -> bool:
    failed = warm.counters["kvtier:load_failed_tokens_total"]
    return step.check("tokens whose load failed", failed == 0, "0", f"{failed:.0f}")


def warm_cold_ratio(step: Step, warm: Round, cold: Round, max_ratio: float) -> bool:
    ratio = warm.median_ttft / cold.median_ttft
    return step.check(
        "median TTFT warm / cold",
        ratio <= max_ratio,
        f"<= {max_ratio:g}",
        f"{ratio:.3f} ({warm.median_ttft:.3f} s / {cold.median_ttft:.3f} s)",
    )


def same_tokens(step: Step, a: Round, b: Round, against: str) -> bool:
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


def back_to_cold(step: Step, again: Round, cold: Round, warm: Round) -> bool:
    """ "Back to cold" on a noisy host: nearer the first cold round than the warm one on a log
    scale, i.e. above their geometric mean (cold TTFT alone varies 2x between rounds on a busy
    2-core machine; a hit is 5-10x faster)."""
    bound = math.sqrt(cold.median_ttft * warm.median_ttft)
    return step.check(
        "median TTFT cold again, nearer the first cold round than the warm round",
        again.median_ttft >= bound,
        f">= {bound:.3f} s (geometric mean of warm {warm.median_ttft:.3f} s and first cold "
        f"{cold.median_ttft:.3f} s)",
        f"{again.median_ttft:.3f} s",
    )
