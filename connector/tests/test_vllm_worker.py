"""The worker side without vLLM or torch: a copier that records what it writes, and lends
save buffers whose device copy can be held back (a stand-in for the CUDA copier's pinned
slots), and a store whose reads can be held back stand in for the KV cache and the tiers.

- Loads the forward pass waits for end before `load` returns; loads in the background (vLLM's
  asynchronous load) end later, in a thread, ordered after the fence vLLM's thread took, and
  each request is reported once (only after its writes have landed), with its failed blocks.
- Saves: `save` (vLLM's thread) only queues the copies and returns; the save thread waits for
  them and hands runs to the store; a buffer goes back once the store is done with it; with
  no buffer free, a request's chunks of the step are dropped and counted, never waited for
  beyond save_wait_secs; a load of a chunk still being saved waits for its save.
The CUDA side of these orderings runs on a GPU (connector/tests/cuda)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import pytest

import kvtier.vllm.worker as worker_module
from kvtier.stats import StoreStats
from kvtier.store import ChunkRef
from kvtier.vllm.blockcopy.host_buffer import HostBuffer, SlotsBusy
from kvtier.vllm.layout import LayoutError
from kvtier.vllm.step_plan import LoadSpec, SaveSpec
from kvtier.vllm.worker import WorkerSide

PAYLOAD = b"k" * 64


class Lent(HostBuffer):
    """A save buffer whose device copy lands when `landed` is set."""

    def __init__(self, copier: Copier) -> None:
        self.landed = threading.Event()
        if not copier.hold:
            self.landed.set()
        super().__init__(memoryview(bytearray(PAYLOAD)), on_release=self._back)
        self.copier = copier

    def wait(self) -> None:
        assert self.landed.wait(10)

    def _back(self) -> None:
        with self.copier.cond:
            self.copier.lent -= 1
            self.copier.cond.notify_all()


class Copier:
    def __init__(self, slots: int = 8) -> None:
        self.written: list[tuple[int, ...]] = []
        self.scatter_calls: list[dict[str, Any]] = []
        self.slots, self.lent = slots, 0
        self.cond = threading.Condition()
        self.bufs: list[Lent] = []
        self.fences = 0
        self.many_calls: list[list[str]] = []  # groups of each gather_many_to_host call
        self.hold = False  # save buffers' copies land only when a test sets them
        self.copies_in_background = True  # as on CUDA
        self.slot_requests = 0

    def gather(self, block_ids: Sequence[int]) -> bytes:
        return PAYLOAD

    def gather_to_host(self, block_ids: Sequence[int], wait_secs: float | None = None) -> Lent:
        self.slot_requests += 1
        with self.cond:
            if not self.cond.wait_for(lambda: self.lent < self.slots, wait_secs):
                raise SlotsBusy("no slot")
            self.lent += 1
        buf = Lent(self)
        self.bufs.append(buf)
        return buf

    def gather_many_to_host(
        self,
        block_id_lists: Sequence[Sequence[int]],
        wait_secs: float | None = None,
        groups: Sequence[str] | None = None,
    ) -> list[Lent | None]:
        """As BlockCopier's (kvtier.vllm.blockcopy.copier): a chunk with no slot, and its
        group's later chunks, are None."""
        self.many_calls.append(list(groups or []))
        out: list[Lent | None] = []
        busy: set[str | None] = set()
        for i, ids in enumerate(block_id_lists):
            group = groups[i] if groups is not None else None
            if group in busy:
                out.append(None)
                continue
            try:
                out.append(self.gather_to_host(ids, wait_secs))
            except SlotsBusy:
                busy.add(group)
                out.append(None)
        return out

    def fence(self) -> str:
        self.fences += 1
        return f"fence-{self.fences}"

    def scatter(self, payload: Any, stored_blocks: int, first: int, block_ids: Any) -> None:
        pass

    def scatter_many(
        self, items: Sequence[tuple[Any, int, int, Sequence[int]]], **kwargs: Any
    ) -> None:
        self.scatter_calls.append(kwargs)
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

    put: list[tuple[str, bytes]]
    put_tiers: list[str]
    on_done: list[Callable[[], None]]

    def put_run(
        self,
        chunks: Sequence[tuple[str, bytes | memoryview, int]],
        on_done: Callable[[], None] | None = None,
        tiers: str = "all",
    ) -> None:
        self.__dict__.setdefault("put", []).extend((h, bytes(p)) for h, p, _ in chunks)
        self.__dict__.setdefault("put_tiers", []).extend(tiers for _ in chunks)
        if on_done is not None:  # the tiers' writes end when the test says so
            self.__dict__.setdefault("on_done", []).append(on_done)

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
    # Ordered on the compute stream (no fence, no host wait).
    assert copier.scatter_calls[-1] == {"after": None, "wait": False}
    assert worker.take_finished() == set() and worker.take_failed_blocks() == set()
    worker.close(1)


def test_background_loads_end_later_and_are_reported_once() -> None:
    copier, store = Copier(), Store({"c0": PAYLOAD, "c1": PAYLOAD})
    worker = WorkerSide(store, copier, timeout_secs=5)  # type: ignore[arg-type]
    store.release.clear()  # S3 is slow
    worker.load([_spec("r", 0, True), _spec("r", 1, True)])
    # Back in the step while the store still holds the read: nothing written, nothing done.
    assert worker.take_finished() == set() and copier.written == []
    store.release.set()
    assert _finished(worker) == {"r"}
    assert copier.written == [(0, 1), (2, 3)]
    # Written in the loading thread after the fence vLLM's thread took, and waited for there.
    assert copier.scatter_calls[-1] == {"after": "fence-1", "wait": True}
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


def _save(req: str, k: int) -> SaveSpec:
    return SaveSpec(req_id=req, chunk_hash=f"s{k}", block_ids=(2 * k, 2 * k + 1), num_tokens=32)


def _until(cond: Callable[[], bool], timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.005)
    return cond()


def test_a_save_returns_before_its_copies_land_and_lends_its_buffers_until_written() -> None:
    copier, store = Copier(), Store({})
    worker = WorkerSide(store, copier, timeout_secs=5)  # type: ignore[arg-type]
    copier.hold = True  # the device -> host copies are still in flight
    worker.save([_save("r", 0), _save("r", 1)])  # back while no copy has landed
    bufs = copier.bufs[-2:]
    # The save thread waits for the copies (a slot's view waits for its copy), not vLLM.
    assert not getattr(store, "put", []) and not any(b.landed.is_set() for b in bufs)
    for buf in bufs:
        buf.landed.set()
    assert _until(lambda: len(getattr(store, "put", [])) == 2)
    assert copier.lent == 2  # lent to the tiers' writes ...
    for done in store.on_done:
        done()
    assert copier.lent == 0  # ... and back once they ended
    stats = worker.take_stats()
    assert stats["saved_chunks"] == 2 and "save_dropped_chunks" not in stats
    worker.close(1)


def test_with_no_save_buffer_free_the_step_drops_the_rest_of_the_request_and_counts() -> None:
    copier, store = Copier(slots=2), Store({})
    worker = WorkerSide(store, copier, timeout_secs=5, save_wait_secs=0.05)  # type: ignore[arg-type]
    worker.save([_save("a", 0), _save("a", 1), _save("a", 2), _save("a", 3)])
    # Two slots, then one bounded wait for a third that fails; the last chunk is not tried.
    assert copier.slot_requests == 3
    assert _until(lambda: len(getattr(store, "put", [])) == 2)
    assert [h for h, _ in store.put] == ["s0", "s1"]
    assert worker.take_stats()["save_dropped_chunks"] == 2
    for done in store.on_done:
        done()
    worker.save([_save("b", 4)])  # buffers back: saves go on
    assert _until(lambda: len(store.put) == 3)
    worker.close(1)


def test_a_store_that_raises_gives_the_slots_back_and_counts_the_chunks_failed() -> None:
    """put_run is not meant to raise, but a copy for the CPU tier can run out of memory: the
    run's buffers come back (else the save pool would drain and every later save drop)."""

    class Raises(Store):
        def put_run(self, chunks: Any, on_done: Any = None, tiers: str = "all") -> None:
            if chunks[0][0] == "s0":
                raise MemoryError("no memory for the CPU tier's copy")
            super().put_run(chunks, on_done, tiers)

    copier, store = Copier(), Raises({})
    worker = WorkerSide(store, copier, timeout_secs=5)  # type: ignore[arg-type]
    worker.save([_save("a", 0), _save("a", 1), _save("b", 2)])
    assert _until(lambda: len(getattr(store, "put", [])) == 2)  # a run per chunk here
    assert [h for h, _ in store.put] == ["s1", "s2"]  # the runs after it are stored
    assert copier.lent == 2  # only their buffers, lent to the tiers
    stats = worker.take_stats()
    assert stats["save_failed_chunks"] == 1 and stats["saved_chunks"] == 2
    worker.close(1)


def test_on_a_larger_host_a_step_s_runs_are_stored_side_by_side(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Four runs (requests) of one step: with store threads (a 16-core host has 4; forced
    here), each run is in the store and its buffers lent, and a load of one waits for it."""
    monkeypatch.setattr(worker_module, "_STORE_THREADS", 3)
    copier, store = Copier(), Store({})
    worker = WorkerSide(store, copier, timeout_secs=5)  # type: ignore[arg-type]
    assert worker._storers is not None
    worker.save([_save(f"r{k}", k) for k in range(4)])
    assert _until(lambda: len(getattr(store, "put", [])) == 4)
    assert sorted(h for h, _ in store.put) == ["s0", "s1", "s2", "s3"]
    assert copier.lent == 4 and worker.take_stats()["saved_chunks"] == 4
    for done in store.on_done:
        done()
    assert copier.lent == 0
    worker.close(1)


def test_a_load_of_a_chunk_still_being_saved_waits_for_the_save() -> None:
    """Else the CPU tier would not hold it yet, and the load would fail."""
    copier = Copier()

    class Saved(Store):
        def put_run(self, chunks: Any, on_done: Any = None, tiers: str = "all") -> None:
            super().put_run(chunks, on_done, tiers)
            for h, p, _ in chunks:
                self.held[h] = bytes(p)

    store = Saved({})
    worker = WorkerSide(store, copier, timeout_secs=5)  # type: ignore[arg-type]
    copier.hold = True
    worker.save([_save("r", 0)])
    threading.Timer(0.2, copier.bufs[-1].landed.set).start()
    spec = LoadSpec(
        req_id="q", chunk_hash="s0", stored_blocks=2, first=0, block_ids=(8, 9), num_tokens=32
    )
    worker.load([spec])
    assert worker.take_failed_blocks() == set() and copier.written[-1] == (8, 9)
    worker.close(1)


def test_on_the_cpu_build_a_save_is_in_the_store_when_save_returns() -> None:
    copier, store = Copier(), Store({})
    copier.copies_in_background = False  # the CPU build's copy is done in the call
    worker = WorkerSide(store, copier, timeout_secs=5)  # type: ignore[arg-type]
    worker.save([_save("r", 0), _save("r", 1)])
    assert [h for h, _ in store.put] == ["s0", "s1"]
    worker.close(1)


def test_a_late_admission_of_a_chunk_that_failed_to_load_in_the_step_is_not_saved() -> None:
    """A chunk a local tier held goes to the remote tier from the request's blocks when its
    sight admits it (kvtier.admission). If its load failed in this step, the blocks do not hold
    it: that save is dropped (counted); the others go to the tiers their specs name."""
    copier, store = Copier(), Store({"c0": PAYLOAD})  # c1 is gone
    copier.copies_in_background = False
    worker = WorkerSide(store, copier, timeout_secs=5)  # type: ignore[arg-type]
    worker.load([_spec("r", 0, False), _spec("r", 1, False)])
    late = [
        SaveSpec("r", f"c{k}", (2 * k, 2 * k + 1), 32, "c0", index=k, tiers="remote")
        for k in (0, 1)
    ]
    worker.save([*late, SaveSpec("r", "c2", (4, 5), 32, "c2", index=2, tiers="local")])
    assert [h for h, _ in store.put] == ["c0", "c2"]
    assert store.put_tiers == ["remote", "local"]
    assert worker.take_stats()["save_dropped_chunks"] == 1
    assert worker.take_failed_blocks() == {2, 3}
    worker.close(1)


def test_a_step_s_saves_are_one_copier_call_and_a_busy_request_does_not_drop_the_others() -> None:
    """vLLM's thread asks the copier once per step (on CUDA: one ids upload, one launch); when
    request a's chunk gets no slot, a's later chunks are dropped, b's still get one if free."""
    copier, store = Copier(slots=3), Store({})
    worker = WorkerSide(store, copier, timeout_secs=5, save_wait_secs=0.05)  # type: ignore[arg-type]
    copier.hold = True  # nothing comes back during the step
    worker.save([_save("a", 0), _save("a", 1), _save("a", 2), _save("a", 3), _save("b", 4)])
    assert copier.many_calls == [["a", "a", "a", "a", "b"]]
    assert worker.take_stats()["save_dropped_chunks"] == 2  # a's 4th (no slot) and b's
    for buf in copier.bufs:
        buf.landed.set()
    assert _until(lambda: len(getattr(store, "put", [])) == 3)
    assert [h for h, _ in store.put] == ["s0", "s1", "s2"]
    for done in store.on_done:
        done()
    copier.hold = False
    worker.save([_save("a", 5), _save("b", 6), _save("b", 7)])
    assert _until(lambda: len(store.put) == 6)
    assert [h for h, _ in store.put][3:] == ["s5", "s6", "s7"]
    assert "save_dropped_chunks" not in worker.take_stats()
    worker.close(1)


def test_a_failed_gather_fails_the_step_s_saves_and_counts_them() -> None:
    class Broken(Copier):
        def gather_many_to_host(self, *args: Any, **kwargs: Any) -> list[Lent | None]:
            raise RuntimeError("device lost")

    copier, store = Broken(), Store({})
    worker = WorkerSide(store, copier, timeout_secs=5)  # type: ignore[arg-type]
    worker.save([_save("a", 0), _save("b", 1)])  # no exception into vLLM
    stats = worker.take_stats()
    assert stats["save_failed_chunks"] == 2 and "save_dropped_chunks" not in stats
    assert worker._saving == {}
    worker.close(1)
