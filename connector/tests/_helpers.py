"""Helpers shared by kvtier's tests (no fixtures from conftest.py are redefined here)."""

from __future__ import annotations

import http.server
import json
import os
from collections.abc import Sequence

from kvtier.keys import LayoutFingerprint, chunk_hashes

FINGERPRINT = LayoutFingerprint(
    "tiny@0123456789abcdef", "bfloat16", 2, 2, 64, 16, 256, 0, 1, "cpu:vec16"
).digest()


def chunks(n: int, size: int = 64 * 1024, seed: int = 0) -> list[tuple[str, bytes]]:
    """``n`` (hash, payload) pairs of a made-up prompt; payloads are random bytes."""
    hashes = chunk_hashes([seed * 1_000_003 + i for i in range(n * 256)], 256)
    return [(h, os.urandom(size)) for h in hashes]


def rss_bytes() -> int:
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def send_completion_stream(
    handler: http.server.BaseHTTPRequestHandler,
    token_ids: Sequence[int],
    prompt_tokens: int,
    text: str = "x",
) -> None:
    """Answer a request as vLLM's streamed /v1/completions does: one event per token (with
    ``return_token_ids``), the usage event, ``[DONE]``."""
    handler.send_response(200)
    handler.send_header("Content-Type", "text/event-stream")
    handler.end_headers()
    for token in token_ids:
        event = {"choices": [{"text": text, "token_ids": [token]}]}
        handler.wfile.write(f"data: {json.dumps(event)}\n\n".encode())
    usage = {"choices": [], "usage": {"prompt_tokens": prompt_tokens}}
    handler.wfile.write(f"data: {json.dumps(usage)}\n\ndata: [DONE]\n\n".encode())
