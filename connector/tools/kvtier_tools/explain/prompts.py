"""The prompts to explain: text files, or JSONL of requests as sent to the OpenAI API.

A text file is one completions prompt (its whole content). A ``.jsonl`` file holds one request
per line: a completions body (``prompt``: text or token ids) or a chat body (``messages``, with
the options that change the rendering: ``add_generation_prompt``, ``continue_final_message``,
``add_special_tokens``, ``chat_template``, ``chat_template_kwargs``, ``tools``); a line of the
OpenAI batch format (``{"custom_id": ..., "body": {...}}``) is read as its body.

A request's identity beyond its tokens is kept too (`identity_of`): its ``cache_salt``, the
``model`` it names (a LoRA adapter is asked for by its name), its ``kvtier_namespace`` and
whether its messages carry images or audio. Two prompts with the same tokens and another
identity share no chunk (kvtier.keys).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

#: Request fields that change how a chat is rendered (passed to /tokenize or the template).
CHAT_OPTIONS = (
    "add_generation_prompt",
    "continue_final_message",
    "add_special_tokens",
    "chat_template",
    "chat_template_kwargs",
    "tools",
)


class ExplainError(ValueError):
    """A bad input to `kvtier explain` (or a renderer that cannot work); says what to fix."""


@dataclass(frozen=True)
class Prompt:
    """One prompt: a label for the output and what to render."""

    label: str
    text: str | None = None  # a completions prompt
    token_ids: tuple[int, ...] | None = None  # a completions prompt given as token ids
    messages: tuple[dict[str, Any], ...] | None = None  # a chat request
    options: dict[str, Any] = field(default_factory=dict)
    identity: tuple[tuple[str, str], ...] = ()  # (field, value), sorted: see identity_of


def identity_of(body: dict[str, Any]) -> tuple[tuple[str, str], ...]:
    """What besides the tokens goes into a request's chunk keys, as far as the request shows."""
    out: dict[str, str] = {}
    for name in ("cache_salt", "model"):
        if isinstance(body.get(name), str) and body[name]:
            out[name] = body[name]
    params = body.get("kv_transfer_params")
    if isinstance(params, dict) and isinstance(params.get("kvtier_namespace"), str):
        out["kvtier_namespace"] = params["kvtier_namespace"]
    parts = [
        part
        for m in body.get("messages") or ()
        if isinstance(m, dict) and isinstance(m.get("content"), list)
        for part in m["content"]
        if isinstance(part, dict) and part.get("type") not in (None, "text")
    ]
    if parts:
        out["multimodal"] = f"{len(parts)} non-text part(s)"
    return tuple(sorted(out.items()))


def _from_request(label: str, body: Any) -> Prompt:
    if isinstance(body, dict) and isinstance(body.get("body"), dict):
        label = str(body.get("custom_id") or label)
        body = body["body"]
    if not isinstance(body, dict):
        raise ExplainError(f"{label}: a request must be a JSON object")
    options = {k: body[k] for k in CHAT_OPTIONS if k in body}
    identity = identity_of(body)
    if "messages" in body:
        msgs = body["messages"]
        if not isinstance(msgs, list) or not all(isinstance(m, dict) for m in msgs):
            raise ExplainError(f"{label}: 'messages' must be a list of objects")
        return Prompt(label, messages=tuple(msgs), options=options, identity=identity)
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return Prompt(label, text=prompt, options=options, identity=identity)
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return Prompt(label, token_ids=tuple(prompt), options=options, identity=identity)
    raise ExplainError(
        f"{label}: neither 'messages' (chat) nor 'prompt' (a string or token ids); "
        "one prompt per request, as /v1/completions or /v1/chat/completions take them"
    )


def read_prompts(paths: list[str]) -> list[Prompt]:
    """Every prompt of ``paths`` in order; raises :class:`ExplainError`."""
    out: list[Prompt] = []
    for path in paths:
        try:
            content = Path(path).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ExplainError(f"cannot read {path}: {exc}") from exc
        if not path.endswith(".jsonl"):
            out.append(Prompt(Path(path).name, text=content))
            continue
        for number, line in enumerate(content.splitlines(), start=1):
            if not line.strip():
                continue
            label = f"{Path(path).name}:{number}"
            try:
                body = json.loads(line)
            except ValueError as exc:
                raise ExplainError(f"{label}: not JSON ({exc})") from exc
            out.append(_from_request(label, body))
    if len(out) < 2:
        raise ExplainError(
            f"{len(out)} prompt(s) in {', '.join(paths)}: pass two or more (files, or JSONL lines)"
        )
    return out
