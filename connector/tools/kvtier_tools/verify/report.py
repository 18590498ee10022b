"""The report of a verification: the JSON document (settings, thresholds, every step with its
checks and values), its Markdown rendering, and the first failed check."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

from kvtier_tools.verify.checks import Step
from kvtier_tools.verify.settings import Settings


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
    thresholds = {"max_warm_cold_ratio": s.max_warm_cold_ratio, "min_s3_share": s.min_s3_share}
    return document(s, steps, 5, error, host, started_at, thresholds)


def document(
    s: Any,
    steps: Sequence[Step],
    expected_steps: int,
    error: str | None,
    host: str,
    started_at: str,
    thresholds: dict[str, float],
) -> dict[str, Any]:
    """The report of a run of ``expected_steps`` steps over settings ``s`` (`Settings` or
    `fleet.FleetSettings`: server, model, namespace, documents, config)."""
    failure = error or first_failure(steps)
    if failure is None and len(steps) < expected_steps:
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
        "thresholds": thresholds,
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
