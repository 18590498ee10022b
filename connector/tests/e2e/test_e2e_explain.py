"""`kvtier explain` against a real vLLM: prompts rendered by its /tokenize, and the chunks its
disk tier saved while serving one of them, found read-only by explain. The same server then
shows the connector's side of "why did it miss": a prompt whose "Current time" line changed
after a long system prompt is logged with the chunk where it diverges and counted in
kvtier:prefix_divergences_total; an unchanged repeat is not."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
from _e2e import CHUNK, VLLM_PYTHON, Counters, Servers

from kvtier_tools.cli import main
from kvtier_tools.server import VllmServer

LICENSE = Path("/usr/share/common-licenses/GPL-2")
STAMP = "Generated 2026-12-03T10:00:00Z\n"
SYSTEM_PROMPT = Path("/usr/share/common-licenses/Apache-2.0")
DOCUMENT = Path("/usr/share/common-licenses/Artistic")


def _explain(capsys: pytest.CaptureFixture[str], *args: str) -> dict[str, Any]:
    assert main(["explain", *args, "--json"]) == 0, capsys.readouterr().err
    doc: dict[str, Any] = json.loads(capsys.readouterr().out)
    return doc


def _wait_for_files(root: Path, count: int, timeout: float = 60.0) -> int:
    deadline = time.monotonic() + timeout
    found = len(list(root.rglob("*.kvt")))
    while found < count and time.monotonic() < deadline:
        time.sleep(0.5)  # background writes: nothing to wait on but the directory
        found = len(list(root.rglob("*.kvt")))
    return found


def test_explain_renders_through_the_server_and_sees_its_disk_chunks(
    servers: Servers,
    tiny_model: str,
    scratch: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    text = LICENSE.read_text()
    docs = {"original": text, "top": STAMP + text, "bottom": text + STAMP}
    paths = []
    for name, content in docs.items():
        paths.append(str(scratch / f"{name}.txt"))
        Path(paths[-1]).write_text(content)
    kvtier = {"local_cpu": False, "local_disk": str(scratch / "disk"), "max_local_disk_size": 1.0}
    config = scratch / "kvtier.yaml"
    config.write_text(json.dumps(kvtier))  # JSON is YAML
    server = servers.make("explain", kvtier)
    tokens = server.tokenize(text)
    server.complete(tokens, max_tokens=4)  # prefilled: every full chunk saved to disk
    assert _wait_for_files(scratch / "disk", len(tokens) // 256) >= len(tokens) // 256

    doc = _explain(capsys, "--server-url", server.base_url, "--config", str(config), *paths)
    original, top, bottom = doc["prompts"]
    assert doc["rendered_by"].endswith("/tokenize (model tiny)")
    assert original["tokens"] == len(tokens)
    assert top["first_divergence"] == 0 and top["shared_chunks"] == 0
    assert bottom["first_divergence"] == len(tokens) and bottom["kind"] == "extends"
    assert bottom["context"]["this"].startswith("Generated 2026-")
    assert len(doc["cache"]["fingerprints"]) == 1
    assert original["held"]["tiers"]["disk"]["leading"] == len(tokens) // 256
    assert bottom["held"]["leading"] == len(tokens) // 256  # the original's chunks
    assert top["held"]["leading"] == 0

    # Offline rendering from the model directory (through transformers, as vLLM renders: run
    # from the vLLM venv) agrees with the server's.
    done = subprocess.run(
        [
            VLLM_PYTHON,
            "-m",
            "kvtier_tools.cli",
            "explain",
            "--model-dir",
            tiny_model,
            *paths,
            "--json",
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    offline = json.loads(done.stdout)
    keys = ("tokens", "shared_chunks", "first_divergence", "kind")
    assert [[p[k] for k in keys] for p in offline["prompts"]] == [
        [p[k] for k in keys] for p in doc["prompts"]
    ]
    _divergence_is_logged_and_counted(server, scratch / "disk", len(tokens) // CHUNK)
    server.stop()


def _divergence_is_logged_and_counted(server: VllmServer, disk: Path, files: int) -> None:
    """Two requests one minute apart whose system prompt (several chunks) is followed by the
    current time: the second shares the chunks before that line, and the server says where it
    stopped. ``files``: chunk files the disk tier holds already."""
    system = SYSTEM_PROMPT.read_text()[:3000]
    document = DOCUMENT.read_text()

    def at(clock: str) -> list[int]:
        return server.tokenize(f"{system}\nCurrent time: 2026-12-03 {clock}\n\n{document}")

    earlier, later = at("10:00:00"), at("10:01:00")
    differs = next(i for i, (a, b) in enumerate(zip(earlier, later, strict=False)) if a != b)
    chunk = differs // CHUNK
    assert chunk >= 1, f"the clock is at token {differs}: in the first chunk, nothing to compare"
    server.complete(earlier, max_tokens=4)
    assert _wait_for_files(disk, files + len(earlier) // CHUNK) >= files + len(earlier) // CHUNK

    # vLLM's own prefix cache serves the shared chunks here; kvtier's lookup (from chunk 0,
    # whatever vLLM holds) is what compares the two prompts.
    c = Counters(server)
    server.complete(later, max_tokens=4)
    assert c.delta("kvtier:prefix_divergences_total") == 1, server.log_tail()
    full = len(later) // CHUNK
    assert (
        f"its prompt diverges from an earlier request's at chunk {chunk} (tokens "
        f"{chunk * CHUNK}-{(chunk + 1) * CHUNK - 1}): {chunk} of its {full} chunks shared"
    ) in server.log_text()

    c = Counters(server)
    server.complete(later, max_tokens=4)  # unchanged: the same prompt again
    assert c.delta("kvtier:prefix_divergences_total") == 0, server.log_tail()
