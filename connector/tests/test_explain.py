"""`kvtier explain` on real prose (a Debian license text) rendered by the tiny model's tokenizer:
a timestamp line at the top, at the bottom, and none; the chunks a disk tier holds, asked
without changing it; the server renderer's requests; bad inputs."""

from __future__ import annotations

import http.server
import json
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import pytest
from _helpers import FINGERPRINT

from kvtier.config import load_config
from kvtier.format import pack_header
from kvtier.keys import chunk_hashes
from kvtier.tiers.disk import DiskTier
from kvtier.tiers.s3_boto3 import Boto3S3Tier
from kvtier_tools.cli import main
from kvtier_tools.explain.compare import Rendered
from kvtier_tools.explain.held import CacheView

LICENSE = Path("/usr/share/common-licenses/GPL-2")  # ~3,000 words: Debian's base-files
STAMP = "Generated 2026-12-03T10:00:00Z\n"


@pytest.fixture
def docs(tmp_path: Path) -> dict[str, Path]:
    if not LICENSE.is_file():
        pytest.skip(f"{LICENSE} is missing (not a Debian host)")
    text = LICENSE.read_text()
    out = {}
    for name, content in {
        "original": text,
        "top": STAMP + text,
        "bottom": text + STAMP,
        "copy": text,
    }.items():
        out[name] = tmp_path / f"{name}.txt"
        out[name].write_text(content)
    return out


def _explain(capsys: pytest.CaptureFixture[str], *args: str) -> dict[str, Any]:
    assert main(["explain", *args, "--json"]) == 0, capsys.readouterr().err
    doc: dict[str, Any] = json.loads(capsys.readouterr().out)
    return doc


def _tokens(model: Path, path: Path) -> list[int]:
    from tokenizers import Tokenizer

    return list(Tokenizer.from_file(str(model / "tokenizer.json")).encode(path.read_text()).ids)


def test_timestamp_at_the_top_diverges_at_chunk_0(
    tiny_model_files: Path, docs: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    doc = _explain(
        capsys, "--model-dir", str(tiny_model_files), str(docs["original"]), str(docs["top"])
    )
    top = doc["prompts"][1]
    assert top["tokens"] > 5000 and top["chunks"] >= 20  # real prose, thousands of tokens
    assert (top["shared_chunks"], top["first_divergence"], top["kind"]) == (0, 0, "diverges")
    assert top["where"] == "token 0, chunk 0"
    assert top["context"]["before"] == ""
    assert top["context"]["this"].startswith("Generated 2026-12-03")
    assert "GNU GENERAL PUBLIC LICENSE" in LICENSE.read_text()[: len(top["context"]["other"]) + 40]


def test_timestamp_at_the_bottom_diverges_in_the_last_chunk(
    tiny_model_files: Path, docs: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    model = str(tiny_model_files)
    assert main(["explain", "--model-dir", model, str(docs["original"]), str(docs["bottom"])]) == 0
    text = capsys.readouterr().out
    doc = _explain(capsys, "--model-dir", model, str(docs["original"]), str(docs["bottom"]))
    original, bottom = doc["prompts"]
    n = len(_tokens(tiny_model_files, docs["original"]))
    assert bottom["first_divergence"] == n and bottom["kind"] == "extends"
    assert bottom["first_divergence"] // 256 == bottom["tokens"] // 256  # its last chunk
    assert bottom["shared_chunks"] == original["chunks"] == n // 256  # every full chunk shared
    assert bottom["context"]["this"].startswith("Generated 2026-12-03")
    assert bottom["context"]["other"] == ""
    assert LICENSE.read_text().endswith(bottom["context"]["before"])
    assert original["kind"] == "contained" and original["where"] == "none: it begins #2"
    assert f"#2 differs from #1 at token {n:,} (where #1 ends):" in text
    assert '"Generated 2026-12-03' in text


def test_unchanged_document_does_not_diverge(
    tiny_model_files: Path, docs: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    paths = [str(docs[k]) for k in ("original", "top", "bottom", "copy")]
    doc = _explain(capsys, "--model-dir", str(tiny_model_files), *paths)
    original, top, bottom, copy = doc["prompts"]
    assert original["kind"] == copy["kind"] == "identical"
    assert (original["partner"], copy["partner"]) == (3, 0)
    assert original["first_divergence"] is None and original["where"] == "none: identical"
    assert original["shared_chunks"] == original["chunks"]
    assert top["shared_chunks"] == 0 and bottom["shared_chunks"] == original["chunks"]


def _disk_config(tmp_path: Path, cap_gib: float) -> Path:
    config = tmp_path / "kvtier.yaml"
    config.write_text(
        f"local_disk: {tmp_path / 'disk'}\nmax_local_disk_size: {cap_gib:.6f}\nnamespace: prod\n"
    )
    return config


def _store(root: Path, fingerprint: str, hashes: list[str], namespace: str = "prod") -> None:
    """Chunks written as the store writes them (header naming layout and chunk, then payload)."""
    tier = DiskTier(str(root), 1 << 30)
    for h in hashes:
        payload = os.urandom(1024)
        header = pack_header(bytes.fromhex(fingerprint), bytes.fromhex(h), 256, payload)
        tier.put(f"{namespace}/{fingerprint}/{h}", header, payload)


def _snapshot(root: Path) -> dict[str, tuple[int, int]]:
    return {
        str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns)
        for p in root.rglob("*")
        if p.is_file()
    }


def test_held_now_counts_the_leading_chunks_on_disk_read_only(
    tiny_model_files: Path,
    docs: dict[str, Path],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    hashes = chunk_hashes(_tokens(tiny_model_files, docs["original"]), 256)
    other_layout = "ab" * 16
    _store(tmp_path / "disk", FINGERPRINT, hashes[:10] + hashes[12:15])  # a gap at chunk 10
    _store(tmp_path / "disk", other_layout, hashes[:3])
    (tmp_path / "disk" / "prod" / FINGERPRINT / "left-by-a-writer.kvt.1.2.tmp").write_bytes(b"x")
    # A cap below what is stored: building a DiskTier would evict; explain must not.
    config = _disk_config(tmp_path, 0.000001)
    before = _snapshot(tmp_path / "disk")
    args = ["--model-dir", str(tiny_model_files), "--config", str(config)]
    doc = _explain(capsys, *args, str(docs["original"]), str(docs["top"]))
    assert _snapshot(tmp_path / "disk") == before
    assert doc["cache"]["fingerprints"] == sorted([FINGERPRINT, other_layout])
    original, top = doc["prompts"]
    assert original["held"]["fingerprint"] == FINGERPRINT
    assert original["held"]["leading"] == 10
    assert original["held"]["tiers"]["disk"] == {"leading": 10, "held": 13}
    assert top["held"]["leading"] == 0
    only = _explain(capsys, *args, "--fingerprint", "abab", str(docs["original"]), str(docs["top"]))
    assert only["cache"]["fingerprints"] == [other_layout]
    assert only["prompts"][0]["held"]["tiers"]["disk"] == {"leading": 3, "held": 3}
    assert main(["explain", *args, str(docs["original"]), str(docs["top"])]) == 0
    out = capsys.readouterr().out
    assert f"| disk 10/{original['chunks']} ({FINGERPRINT[:8]}) |" in out


class _FakeS3Client:
    """The listing a bucket gives with Delimiter='/' (what explain asks S3 for layouts)."""

    def __init__(self, prefixes: list[str]) -> None:
        self.prefixes = prefixes
        self.calls: list[dict[str, Any]] = []

    def get_paginator(self, name: str) -> Any:
        assert name == "list_objects_v2"
        client = self

        class Pages:
            def paginate(self, **kwargs: Any) -> Iterator[dict[str, Any]]:
                client.calls.append(kwargs)
                yield {"CommonPrefixes": [{"Prefix": p} for p in client.prefixes]}

        return Pages()


class _FakeS3Tier(Boto3S3Tier):
    """The boto3 tier on a fake client (its listing is real), with HEADs answered here."""

    def __init__(self, client: _FakeS3Client, present: set[str]) -> None:
        super().__init__(client, "kvtier-cache", "pre", concurrency=1)
        self.present = present
        self.asked: list[str] = []

    def heads(self, keys: list[str]) -> list[list[str] | None]:
        """Objects of one chunk each (they list no chunks)."""
        self.asked += keys
        return [[] if k in self.present else None for k in keys]


def test_s3_layouts_come_from_a_delimited_listing_and_heads() -> None:
    cfg = load_config({"local_cpu": False})
    view = CacheView(cfg, "prod")
    fp = "cd" * 16
    client = _FakeS3Client([f"pre/prod/{fp}/", "pre/prod/.doctor/", f"pre/prod/{'ef' * 16}/"])
    view._s3 = _FakeS3Tier(client, {f"prod/{fp}/h1"})
    assert view.fingerprints(None) == sorted([fp, "ef" * 16])
    assert client.calls == [{"Bucket": "kvtier-cache", "Prefix": "pre/prod/", "Delimiter": "/"}]
    assert view.held(fp, ["h1", "h2"]) == {"s3": [True, False]}


class _FakeVllm(http.server.BaseHTTPRequestHandler):
    """/tokenize, /detokenize and /v1/models as vLLM 0.32 answers them (one token per char)."""

    bodies: ClassVar[list[dict[str, Any]]] = []

    def _send(self, doc: dict[str, Any]) -> None:
        body = json.dumps(doc).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        self._send({"data": [{"id": "served-tiny"}]})

    def do_POST(self) -> None:
        req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        req["_path"], req["_auth"] = self.path, self.headers.get("Authorization")
        self.bodies.append(req)
        if self.path == "/detokenize":
            self._send({"prompt": "".join(chr(t) for t in req["tokens"])})
            return
        text = req.get("prompt") or "".join(f"<{m['role']}>{m['content']}" for m in req["messages"])
        tokens = [ord(c) for c in text]
        self._send({"tokens": tokens, "count": len(tokens), "max_model_len": 32768})

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def fake_vllm() -> Iterator[str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _FakeVllm)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    _FakeVllm.bodies = []
    yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    server.shutdown()
    server.server_close()


def test_server_renderer_sends_completions_and_chat_as_vllm_takes_them(
    fake_vllm: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    requests = tmp_path / "requests.jsonl"
    chat = {"messages": [{"role": "system", "content": "be brief"}], "add_generation_prompt": False}
    lines = [
        {"model": "x", "prompt": "hello world", "max_tokens": 5},
        {"custom_id": "batch-7", "body": chat},
        {"prompt": [104, 101, 108]},  # token ids: used as they are
    ]
    requests.write_text("\n".join(json.dumps(line) for line in lines) + "\n\n")
    (tmp_path / "key").write_text("sekret\n")
    args = ["--server-url", fake_vllm, "--api-key-file", str(tmp_path / "key"), str(requests)]
    doc = _explain(capsys, *args)
    assert [p["label"] for p in doc["prompts"]] == [
        "requests.jsonl:1",
        "batch-7",
        "requests.jsonl:3",
    ]
    assert doc["rendered_by"].endswith("/tokenize (model served-tiny)")
    tokenize = [b for b in _FakeVllm.bodies if b["_path"] == "/tokenize"]
    assert {k: v for k, v in tokenize[0].items() if k != "_auth"} == {
        "model": "served-tiny",
        "prompt": "hello world",
        "_path": "/tokenize",
    }
    assert tokenize[1]["messages"] == chat["messages"]
    assert tokenize[1]["add_generation_prompt"] is False
    assert {b["_auth"] for b in _FakeVllm.bodies} == {"Bearer sekret"}
    first, _, ids = doc["prompts"]
    assert (first["partner"], first["shared_tokens"]) == (2, 3)  # [104, 101, 108] is "hel"
    assert ids["kind"] == "contained" and ids["where"] == "none: it begins #1"
    assert first["context"] == {"before": "hel", "this": "lo world", "other": ""}


def test_bad_inputs_say_what_to_pass(
    tiny_model_files: Path,
    docs: dict[str, Path],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    one, two = str(docs["original"]), str(docs["top"])
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a"}\n{not json\n')
    chat = tmp_path / "chat.jsonl"
    chat.write_text('{"messages": [{"role": "user", "content": "hi"}]}\n{"prompt": "hi"}\n')
    model = ["--model-dir", str(tiny_model_files)]
    cases: dict[tuple[str, ...], str] = {
        (*model, one): "pass two or more",
        (one, two): "pass --server-url (the running vLLM) or --model-dir",
        (*model, one, str(tmp_path / "missing.txt")): "cannot read",
        (*model, str(bad)): "bad.jsonl:2: not JSON",
        ("--model-dir", str(tmp_path), one, two): "no tokenizer",
        ("--server-url", "http://127.0.0.1:9", "--model", "m", one, two): "is the server up?",
        (*model, "--config", str(tmp_path / "none.yaml"), one, two): "none.yaml",
    }
    try:
        import transformers  # noqa: F401
    except ImportError:
        cases[(*model, str(chat))] = "needs the model's chat template"
    for args, message in cases.items():
        assert main(["explain", *args]) == 2, args
        assert message in capsys.readouterr().err, args


def test_same_tokens_under_another_identity_share_no_chunk(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Another cache_salt, adapter or namespace: a miss whatever the tokens; said so."""
    tokens = list(range(300, 300 + 600))
    lines = [
        {"prompt": tokens, "cache_salt": "tenant-a", "model": "sql"},
        {"prompt": tokens, "cache_salt": "tenant-b", "model": "sql"},
        {"prompt": tokens, "cache_salt": "tenant-a", "model": "support"},
        {"prompt": tokens, "cache_salt": "tenant-a"},
    ]
    path = tmp_path / "tenants.jsonl"
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    doc = _explain(capsys, str(path))
    _, other_salt, other_adapter, default_model = doc["prompts"]
    assert other_salt["shared_chunks"] == 0
    assert other_salt["other_identity"] == "cache_salt 'tenant-b' vs 'tenant-a'"
    assert "chunk 0: another identity (cache_salt 'tenant-b' vs 'tenant-a')" in other_salt["where"]
    assert other_adapter["other_identity"] == "model 'support' vs 'sql'"
    # No model named: the served default, which may be "sql": not called another identity.
    assert default_model["other_identity"] is None and default_model["shared_chunks"] == 2
    # A salt goes into the keys as the server puts it: not the unsalted prompt's keys.
    salted = Rendered.of("a", tokens, 256, (("cache_salt", "tenant-a"),))
    assert salted.hashes[0] != Rendered.of("plain", tokens, 256).hashes[0]
