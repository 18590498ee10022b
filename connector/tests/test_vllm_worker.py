"""The worker side's loads without vLLM or torch: a copier that records what it writes and a
store whose reads can be held back stand in for the KV cache and the tiers. Loads the forward
pass waits for end before `load` returns; loads in the background (vLLM's asynchronous load)
end later, in a thread, and each request is reported once, with the blocks that failed."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Any

from kvtier.stats import StoreStats
from kvtier.store import ChunkRef
from kvtier.vllm.layout import LayoutError
from kvtier.vllm.plan import LoadSpec
from kvtier.vllm.worker import WorkerSide

PAYLOAD = b"k" * 64


class Copier:
    def __init__(self) -> None:
        self.written: list[tuple[int, ...]] = []

    def gather(self, block_ids: Sequence[int]) -> bytes:
        return PAYLOAD

    def scatter(self, payload: Any, stored_blocks: int, first: int, block_ids: Any) -> None:
        pass

    def scatter_many(self, items: Sequence[tuple[Any, int, int, Sequence[int]]]) -> None:
        self.written.extend(tuple(ids) for _, _, _, ids in items)

    def check_payload(self, payload: bytes, stored_blocks: int) -> None:
        if len(payload) != len(PAYLOAD):
            raise LayoutError("wrong size")


class Store:
    """Payloads by chunk hash; reads wait until ``release`` is set."""

    def __init__(self, held: dict[str, bytes]) -> None:
        self.held = held
        self.release = threading.Event()
        self.release.set()
        self.asked: list[list[ChunkRef]] = []

    def get_many(self, refs: Sequence[str | ChunkRef]) -> list[bytes | None]:
        self.release.wait(10)
        wanted = [r if isinstance(r, ChunkRef) else ChunkRef(r) for r in refs]
        self.asked.append(wanted)
        return [self.held.get(r.chunk_id) for r in wanted]

    def put_run(self, chunks: Sequence[tuple[str, bytes | memoryview, int]]) -> None:
        pass

    def stats(self) -> StoreStats:
        return StoreStats()

    def close(self, timeout: float | None = None) -> None:
        pass


def _spec(req: str, k: int, background: bool) -> LoadSpec:
    return LoadSpec(
        req_id=req,
        chunk_hash=f"c{k}",
        stored_blocks=2,
        first=0,
        block_ids=(2 * k, 2 * k + 1),
        num_tokens=32,
        object_hash="c0",
        position=k,
        background=background,
    )


def _finished(worker: WorkerSide, timeout: float = 5.0) -> set[str]:
    deadline = time.monotonic() + timeout
    while not (done := worker.take_finished()) and time.monotonic() < deadline:
        time.sleep(0.01)
    return done


def test_foreground_loads_are_in_their_blocks_when_load_returns() -> None:
    copier, store = Copier(), Store({"c0": PAYLOAD, "c1": PAYLOAD})
    worker = WorkerSide(store, copier, timeout_secs=5)  # type: ignore[arg-type]
    worker.load([_spec("r", 0, False), _spec("r", 1, False)])
    assert copier.written == [(0, 1), (2, 3)]
    assert store.asked[0] == [ChunkRef("c0", "c0", 0), ChunkRef("c1", "c0", 1)]
    assert worker.take_finished() == set() and worker.take_failed_blocks() == set()
    worker.close(1)


def test_background_loads_end_later_and_are_reported_once() -> None:
    copier, store = Copier(), Store({"c0": PAYLOAD, "c1": PAYLOAD})
    worker = WorkerSide(store, copier, timeout_secs=5)  # type: ignore[arg-type]
    store.release.clear()  # S3 is slow
    started = time.monotonic()
    worker.load([_spec("r", 0, True), _spec("r", 1, True)])
    assert time.monotonic() - started < 0.5  # the step goes on
    assert worker.take_finished() == set() and copier.written == []
    store.release.set()
    assert _finished(worker) == {"r"}
    assert copier.written == [(0, 1), (2, 3)]
    assert worker.take_finished() == set() and worker.take_failed_blocks() == set()
    stats = worker.take_stats()
    assert stats["loaded_chunks"] == 2 and stats["loaded_tokens"] == 64
    worker.close(1)


def test_a_background_load_that_fails_reports_its_blocks_with_the_request() -> None:
    """vLLM asks for finished requests, then for failed blocks, in the same step: the blocks
    of a chunk that did not load (and of those after it) come with the request."""
    copier, store = Copier(), Store({"c0": PAYLOAD})  # c1 is gone
    worker = WorkerSide(store, copier, timeout_secs=5)  # type: ignore[arg-type]
    worker.load([_spec("r", 0, True), _spec("r", 1, True), _spec("r", 2, True)])
    assert _finished(worker) == {"r"}
    assert worker.take_failed_blocks() == {2, 3, 4, 5}
    assert copier.written == [(0, 1)]
    assert worker.take_stats()["load_failed_tokens"] == 64
    worker.close(1)


def test_a_load_after_a_timed_out_one_does_not_queue_behind_it() -> None:
    """The first fetch hangs (a black-holed endpoint) and times out; the next loads get their
    own thread and load (before: one fetch thread, so each later load waited for the hung one
    and timed out too). Past four hung fetches, loads fail at once instead of waiting."""
    hung = threading.Event()

    class HangsOnce(Store):
        calls = 0

        def get_many(self, refs: Sequence[str | ChunkRef]) -> list[bytes | None]:
            HangsOnce.calls += 1
            if HangsOnce.calls == 1:
                hung.wait(10)
            return super().get_many(refs)

    store, copier = HangsOnce({"c0": PAYLOAD, "c1": PAYLOAD}), Copier()
    worker = WorkerSide(store, copier, timeout_secs=0.2)  # type: ignore[arg-type]
    worker.load([_spec("a", 0, background=False)])
    assert worker.take_failed_blocks() == {0, 1}  # timed out: recomputed
    worker.load([_spec("b", 1, background=False)])
    assert worker.take_failed_blocks() == set() and copier.written == [(2, 3)]
    hung.set()
    worker.close(5)


def test_loads_fail_at_once_while_four_fetches_hang() -> None:
    store, copier = Store({"c0": PAYLOAD}), Copier()
    store.release.clear()  # every fetch hangs
    worker = WorkerSide(store, copier, timeout_secs=0.05)  # type: ignore[arg-type]
    for _ in range(5):
        worker.load([_spec("a", 0, background=False)])
    assert len(store.asked) == 0 and worker.take_failed_blocks() == {0, 1}
    assert worker.take_stats()["load_timeouts"] == 5
    store.release.set()
    worker.close(5)
