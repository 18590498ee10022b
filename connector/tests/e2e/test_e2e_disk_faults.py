"""The disk tier when its filesystem fills up and when vLLM dies while writing: it evicts and
keeps serving; a crash leaves no half-written chunk that is ever read back. Real vLLM, a real
small filesystem (tmpfs of 24 MiB: each 4096-token prompt is 4 MiB of the tiny model's KV),
disk tier only, vLLM's prefix cache off."""

from __future__ import annotations

import os
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from _e2e import (
    CHUNK,
    OUTPUT_TOKENS,
    Counters,
    Servers,
    assert_same_tokens,
    prompt,
    prompt_resumed_at_a_step_boundary,
)

from kvtier.keys import chunk_hashes

#: 16 whole chunks and a token: a load ends on a chunk boundary, hence on a prefill step boundary
#: of the cold run (_e2e.py; a prompt of exactly 16 chunks loads 15.5 of them: vLLM computes at
#: least its last token, here the last 128-token block).
DOC = 16 * CHUNK + 1
FS_MIB = 24


@pytest.fixture
def small_fs(scratch: Path) -> Iterator[Path]:
    mount = scratch / "small-fs"
    mount.mkdir(exist_ok=True)
    subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={FS_MIB}m", "tmpfs", str(mount)], check=True
    )
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def _disk(path: Path, **extra: object) -> dict[str, object]:
    # The cap (1 GiB) is far above the filesystem: only ENOSPC can stop the tier.
    return {"local_cpu": False, "local_disk": str(path), "max_local_disk_size": 1.0, **extra}


def _fill(path: Path, stop: threading.Event) -> None:
    """Another writer: fills the filesystem to the brim, then holds what it took. kvtier must
    then make room among its own chunks (a writer that grew into every byte kvtier freed won
    that race on some machines every time, and nothing kvtier wrote last was left to read)."""
    fd = os.open(path / "other-writer.bin", os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        while not stop.is_set():
            try:
                os.write(fd, bytes(256 << 10))
            except OSError:
                return  # full
    finally:
        os.close(fd)


def test_a_disk_tier_filled_to_the_brim_evicts_and_keeps_serving(
    servers: Servers, small_fs: Path
) -> None:
    srv = servers.make("disk-full", _disk(small_fs), prefix_caching=False)
    docs = [prompt(DOC, seed=600 + i) for i in range(10)]  # 40 MiB for a 24 MiB filesystem
    stop = threading.Event()
    filler = threading.Thread(target=_fill, args=(small_fs, stop))
    try:
        first = [srv.complete(d, max_tokens=OUTPUT_TOKENS) for d in docs[:3]]
        filler.start()
        rest = [srv.complete(d, max_tokens=OUTPUT_TOKENS) for d in docs[3:]]
        time.sleep(1.0)
        c = Counters(srv)
        again = srv.complete(docs[-1], max_tokens=OUTPUT_TOKENS)
        disk_hits = c.delta("kvtier:tier_hits_total", tier="disk")
        resumed = c.resumed_at()
    finally:
        stop.set()
        if filler.is_alive():
            filler.join()
    log = srv.log_text()
    srv.stop()
    assert len(first) + len(rest) == 10 and "Traceback" not in log
    # It did run out, and said so (whether or not the retry after evicting found room).
    assert "is full (No space left)" in log
    # What was written last is still there: a hit, with the same tokens.
    assert disk_hits >= 1
    assert prompt_resumed_at_a_step_boundary(resumed), resumed
    assert again.token_ids == rest[-1].token_ids


def test_kill_9_while_writing_leaves_nothing_half_written_that_is_read_back(
    servers: Servers, scratch: Path
) -> None:
    disk = scratch / "crash-disk"
    srv = servers.make("disk-crash", _disk(disk), prefix_caching=False)
    docs = [prompt(DOC, seed=700 + i) for i in range(3)]
    cold = [srv.complete(d, max_tokens=OUTPUT_TOKENS) for d in docs]
    srv.complete(prompt(DOC, seed=799), max_tokens=1)  # its chunks are being written...
    srv.kill()  # ...when the whole server dies
    # A write cut short at the worst moment, as a crash can leave it, and a chunk of the first
    # document torn at its final name (what power loss can do after the rename).
    victim = next(disk.rglob(f"{chunk_hashes(docs[0], CHUNK)[5]}.kvt"))
    partial = victim.with_name(victim.name + ".4242.1.tmp")
    partial.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])
    os.truncate(victim, victim.stat().st_size // 2)  # torn at the final name (power loss)
    srv.start()
    assert not list(disk.rglob("*.tmp")), "temp files of the crash are left"
    c = Counters(srv)
    for doc, reference in zip(docs, cold, strict=True):
        each = Counters(srv)
        assert_same_tokens(srv.complete(doc, max_tokens=OUTPUT_TOKENS), reference, each)
    # The torn chunk is caught (truncated) and recomputed from there; the others load.
    assert c.delta("kvtier:tier_errors_total", tier="disk", cause="truncated") >= 1
    assert c.delta("kvtier:loaded_tokens_total") >= (5 + 2 * 15) * CHUNK
    srv.stop()
