"""`kvtier explain`: why prompts miss the cache. For two or more prompts (text files, or JSONL
of OpenAI completions / chat requests), rendered with the served model's tokenizer and chat
template, it prints for each: the leading chunks it shares with the prompt closest to it, the
token where they first differ and the text around it, and (with --config) how many of its
leading chunks the disk and S3 tiers hold now, asked read-only.

The usual culprit is a prefix that changes where nobody looks: a timestamp or request id at the
top of the system prompt, few-shot examples in another order, another chat template.

Rendering: --server-url (the running vLLM's /tokenize: its own tokenizer, template and options;
the most faithful) or --model-dir (offline: transformers if installed, else tokenizers and
tokenizer.json for text prompts). Token ids given in a JSONL `prompt` are used as they are.

  kvtier explain --server-url http://127.0.0.1:8100 --api-key-file key --config \\
      /etc/kvtier/kvtier.yaml yesterday.jsonl today.jsonl
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from kvtier.config import ConfigError, load_config
from kvtier_tools.cli import add_command
from kvtier_tools.explain.compare import Divergence, Rendered, divergences
from kvtier_tools.explain.held import CacheView, leading
from kvtier_tools.explain.prompts import ExplainError, read_prompts
from kvtier_tools.explain.render import LocalRenderer, Renderer, ServerRenderer, render


def _renderer(args: argparse.Namespace) -> Renderer | None:
    if args.server_url:
        key = None
        if args.api_key_file:
            try:
                key = Path(args.api_key_file).read_text().strip()
            except OSError as exc:
                raise ExplainError(f"--api-key-file {args.api_key_file}: {exc}") from exc
        return ServerRenderer(args.server_url, args.model, key)
    if args.model_dir:
        return LocalRenderer(args.model_dir)
    return None


def _where(d: Divergence, p: Rendered, chunk: int) -> str:
    if d.other_identity:
        return f"chunk 0: another identity ({d.other_identity}), {d.shared_tokens:,} tokens equal"
    if d.position is None:
        return "none: identical" if d.kind == "identical" else f"none: it begins #{d.partner + 1}"
    k = d.position // chunk
    if k == len(p.hashes) and len(p.tokens) % chunk:
        return f"token {d.position:,}, chunk {k} (the partial last one)"
    return f"token {d.position:,}, chunk {k}" + (" (the last)" if k == len(p.hashes) - 1 else "")


def _context(
    d: Divergence, prompts: list[Rendered], renderer: Renderer | None, width: int
) -> dict[str, str] | None:
    if d.position is None:
        return None
    p, q, at = prompts[d.index], prompts[d.partner], d.position

    def text(ids: list[int]) -> str:
        return renderer.decode(ids) if renderer is not None else " ".join(map(str, ids))

    return {
        "before": text(p.tokens[max(0, at - width) : at]),
        "this": text(p.tokens[at : at + width]),
        "other": text(q.tokens[at : at + width]),
    }


def _held(view: CacheView | None, fps: list[str], p: Rendered) -> dict[str, Any] | None:
    """Leading and total chunks held per tier, under the layout holding the most of them."""
    if view is None:
        return None
    best: dict[str, Any] | None = None
    for fp in fps:
        present = view.held(fp, p.hashes)
        union = [any(t[i] for t in present.values() if t) for i in range(len(p.hashes))]
        row = {
            "fingerprint": fp,
            "leading": leading(union),
            "tiers": {
                t: None if v is None else {"leading": leading(v), "held": sum(v)}
                for t, v in present.items()
            },
        }
        if best is None or row["leading"] > best["leading"]:
            best = row
    return best


def explain(args: argparse.Namespace) -> dict[str, Any]:
    """The whole answer as plain data (``--json``)."""
    cfg = load_config(args.config) if args.config else None
    chunk = args.chunk_size or (cfg.chunk_size if cfg else 256)
    renderer = _renderer(args)
    prompts = [
        Rendered.of(p.label, render(renderer, p), chunk, p.identity)
        for p in read_prompts(args.prompts)
    ]
    view = CacheView(cfg, args.namespace or cfg.namespace) if cfg else None
    try:
        fps = view.fingerprints(args.fingerprint) if view else []
        rows = []
        for d in divergences(prompts):
            p = prompts[d.index]
            rows.append(
                {
                    "label": p.label,
                    "tokens": len(p.tokens),
                    "chunks": d.chunks,
                    "partner": d.partner,
                    "shared_chunks": d.shared_chunks,
                    "shared_tokens": d.shared_tokens,
                    "kind": d.kind,
                    "other_identity": d.other_identity,
                    "first_divergence": d.position,
                    "where": _where(d, p, chunk),
                    "context": _context(d, prompts, renderer, args.context),
                    "held": _held(view, fps, p),
                }
            )
    finally:
        if view is not None:
            view.close()
    return {
        "chunk_size": chunk,
        "rendered_by": renderer.description if renderer else "token ids as given",
        "cache": None
        if view is None
        else {
            "namespace": view.namespace,
            "tiers": view.tiers,
            "fingerprints": fps,
            "errors": view.errors,
        },
        "prompts": rows,
    }


def _held_cell(held: dict[str, Any] | None, chunks: int) -> str:
    if held is None:
        return "-"
    parts = [f"{t} {'?' if v is None else v['leading']}/{chunks}" for t, v in held["tiers"].items()]
    return ", ".join(parts) + f" ({held['fingerprint'][:8]})"


def format_explain(doc: dict[str, Any]) -> str:
    rows = doc["prompts"]
    cache = doc["cache"]
    lines = [
        f"kvtier explain: {len(rows)} prompts, chunks of {doc['chunk_size']} tokens, "
        f"rendered by {doc['rendered_by']}"
    ]
    if cache is None:
        lines.append("cache: not asked (pass --config to see which chunks the tiers hold now)")
    else:
        fps = ", ".join(f[:8] for f in cache["fingerprints"]) or "none"
        lines.append(
            f"cache: {' and '.join(cache['tiers']) or 'no persistent tier'}, namespace "
            f"{cache['namespace']!r}; layouts found: {fps}"
        )
        lines += [f"  {tier}: {err}" for tier, err in cache["errors"].items()]
    lines += [
        "",
        "| # | prompt | tokens | leading chunks shared | with | first divergence | held now "
        "(leading chunks) |",
        "|---|---|---|---|---|---|---|",
    ]
    for i, r in enumerate(rows, start=1):
        lines.append(
            f"| {i} | {r['label']} | {r['tokens']:,} | {r['shared_chunks']} of {r['chunks']} | "
            f"#{r['partner'] + 1} | {r['where']} | {_held_cell(r['held'], r['chunks'])} |"
        )
    for i, r in enumerate(rows, start=1):
        ctx, j = r["context"], r["partner"] + 1
        if ctx is None:
            continue
        end = f" (where #{j} ends)" if r["kind"] == "extends" else ""
        lines += [
            "",
            f"#{i} differs from #{j} at token {r['first_divergence']:,}{end}:",
            *(
                f"  {name + ':':<8}{json.dumps(ctx[key], ensure_ascii=False)}"
                for name, key in (("before", "before"), (f"#{i}", "this"), (f"#{j}", "other"))
            ),
        ]
    return "\n".join(lines)


def _cmd(args: argparse.Namespace) -> int:
    try:
        doc = explain(args)
    except (ExplainError, ConfigError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(doc, indent=2) if args.json else format_explain(doc))
    return 0


def register(subparsers: Any) -> None:
    """Add `explain` to the `kvtier` CLI."""
    p = add_command(subparsers, "explain", "where prompts stop sharing a cacheable prefix", __doc__)
    p.add_argument("prompts", nargs="+", help="text files, or .jsonl of requests (one per line)")
    r = p.add_argument_group("rendering (one of)")
    r.add_argument("--server-url", help="the running vLLM, e.g. http://127.0.0.1:8100")
    r.add_argument("--api-key-file", help="file holding the server's API key")
    r.add_argument("--model", help="served model name (default: the first of /v1/models)")
    r.add_argument("--model-dir", help="the model's directory, to render offline")
    c = p.add_argument_group("cache (read-only)")
    c.add_argument("--config", help="kvtier YAML: chunk size, disk and S3 tiers to ask")
    c.add_argument("--namespace", help="namespace to look in (default: the config's)")
    c.add_argument("--fingerprint", help="layout to look in (default: every one found)")
    c.add_argument("--chunk-size", type=int, help="default: the config's, else 256")
    p.add_argument("--context", type=int, default=16, help="tokens shown around a divergence")
    p.add_argument("--json", action="store_true", help="print the answer as JSON")
    p.set_defaults(func=_cmd)
