"""Streaming completions against an OpenAI-compatible server, timing the first token.

Standard library only, so the e2e tests, the benchmarks and `kvtier verify` share it without
pulling an HTTP client into the connector's dependencies. Prompts are token ids (exact lengths,
no tokenizer needed on the client); decoding is greedy with a fixed output length so that two
runs of the same prompt must produce the same tokens.
"""

from __future__ import annotations

import http.client
import json
import time
import urllib.error
import urllib.request
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any


class CompletionError(RuntimeError):
    """The server refused or broke off a completion (the message quotes what it said). The one
    error `stream_completion` raises for anything the server or the network did."""


@dataclass
class Completion:
    token_ids: list[int]
    text: str
    #: Seconds from sending the request to the first streamed token.
    ttft: float
    #: Seconds from sending the request to the end of the stream.
    total: float
    prompt_tokens: int


def stream_completion(
    server_url: str,
    model: str,
    prompt_token_ids: Sequence[int],
    max_tokens: int = 32,
    *,
    api_key: str | None = None,
    extra_body: Mapping[str, Any] | None = None,
    timeout: float = 300.0,
) -> Completion:
    """POST ``<server_url>/v1/completions`` (streamed, greedy, exactly ``max_tokens`` tokens)."""
    body: dict[str, Any] = {
        "model": model,
        "prompt": list(prompt_token_ids),
        "max_tokens": max_tokens,
        "min_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "return_token_ids": True,
        "stream_options": {"include_usage": True},
    }
    body.update(extra_body or {})
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    request = urllib.request.Request(
        server_url.rstrip("/") + "/v1/completions", json.dumps(body).encode(), headers
    )
    start = time.perf_counter()
    try:
        resp = urllib.request.urlopen(request, timeout=timeout)
    except urllib.error.HTTPError as exc:
        raise CompletionError(
            f"completion failed: HTTP {exc.code} from {server_url}: {exc.read()[:500]!r}"
        ) from exc
    except (urllib.error.URLError, OSError, http.client.HTTPException) as exc:
        raise CompletionError(f"completion failed: {server_url} unreachable: {exc}") from exc
    try:
        with resp:
            completion = _read_stream(resp, start)
    # A server that dies or times out mid-stream, or sends something that is not the
    # OpenAI event stream: one error type for the callers to report.
    except (OSError, http.client.HTTPException) as exc:
        raise CompletionError(f"the stream from {server_url} broke off: {exc!r}") from exc
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise CompletionError(f"the stream from {server_url} is malformed: {exc!r}") from exc
    if completion is None:
        raise CompletionError(f"the stream from {server_url} ended without any token")
    return completion


def _read_stream(resp: Iterable[bytes], start: float) -> Completion | None:
    """The completion in a server-sent event stream; None when it holds no token."""
    ttft: float | None = None
    ids: list[int] = []
    text: list[str] = []
    prompt_tokens = 0
    for raw in resp:
        line = raw.decode().strip()
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            break
        event = json.loads(data)
        if event.get("usage"):
            prompt_tokens = int(event["usage"]["prompt_tokens"])
        for choice in event.get("choices", []):
            new_ids = choice.get("token_ids") or []
            if (new_ids or choice.get("text")) and ttft is None:
                ttft = time.perf_counter() - start
            ids.extend(new_ids)
            text.append(choice.get("text") or "")
    total = time.perf_counter() - start
    if ttft is None:
        return None
    return Completion(ids, "".join(text), ttft, total, prompt_tokens)
