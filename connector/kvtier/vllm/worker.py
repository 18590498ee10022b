"""Worker side: copy blocks between vLLM's paged KV buffer and the tiered store.

- Loads run before the forward pass (vLLM marks the step as having synchronous loads): all
  chunks of the step are fetched in parallel and written into their blocks. The wait is capped
  at ``blocking_timeout_secs``; whatever has not arrived, failed verification or has the wrong
  size is reported through ``failed_blocks`` so vLLM recomputes those tokens. Loads planned in
  the background (``enable_async_loading``: the request waits outside the batch, vLLM's
  asynchronous load) run in a thread while the steps of the other requests go on; the request
  is reported done through ``take_finished``, with its failed blocks, and then scheduled.
- Saves start in ``wait_for_save`` after the forward pass. On CUDA it only queues the copies
  of all the step's chunks out of their blocks into slots of the pinned save pool, in one call
  (one upload of the block ids, one gather launch per staging buffer's worth of chunks, ordered
  before any later kernel can overwrite the blocks) and hands the buffers to the save thread,
  which waits for the copies and gives each run (one S3 object) to the store (a step's runs
  side by side on a host with cores to spare): it checksums the slot, copies it (without the
  GIL) into the CPU tier and writes the slower tiers in the background from the slot itself; the
  slot goes back to the pool once the last write has ended. When no save slot comes free
  within ``save_wait_secs`` the rest of that request's chunks of the step are not saved
  (counted: ``save_dropped_chunks``), so vLLM's thread never waits longer. A load of a chunk
  whose save is still in the save thread waits for it (the CPU tier would miss it). On the
  CPU build the copy out is a memcpy per layer that the step waits for anyway (vLLM may reuse
  the blocks right after it), and the same hand-over to the store runs inline: in a thread it
  only contends for the same cores and the GIL (measured: with TP 2 on two cores a warm
  round slowed to the cold round's time-to-first-token while another request's saves ran
  beside it).
Every failure here is a miss (logged with its cause), never an exception into vLLM.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
from collections.abc import Callable, Collection, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from functools import partial
from typing import Any, Protocol

from kvtier.admission import SaveTiers
from kvtier.metrics import SAMPLES
from kvtier.stats import StoreStats, store_deltas, without_fill
from kvtier.store import ChunkRef
from kvtier.vllm.blockcopy.copier import BlockCopier
from kvtier.vllm.blockcopy.host_buffer import HostBuffer
from kvtier.vllm.layout import LayoutError
from kvtier.vllm.step_plan import LoadSpec, SaveSpec

log = logging.getLogger(__name__)
#: Fetch threads left waiting on a tier after their load timed out, at most (see __init__).
_MAX_ABANDONED = 4
#: Threads that give a step's runs to the store side by side (CUDA; one on a small host).
_STORE_THREADS = max(1, min(4, (os.cpu_count() or 1) // 4))


class ChunkStore(Protocol):
    """The part of kvtier.store.TieredStore the worker uses."""

    def get_many(self, refs: Sequence[str | ChunkRef]) -> list[bytes | None]: ...
    def put_run(
        self,
        chunks: Sequence[tuple[str, bytes | memoryview, int]],
        on_done: Callable[[], None] | None = None,
        tiers: SaveTiers = "all",
    ) -> None: ...
    def stats(self) -> StoreStats: ...
    def close(self, timeout: float | None = ...) -> None: ...


def _run_of(spec: SaveSpec) -> tuple[str, str, str]:
    """What makes consecutive saves one object: the request, its run's first chunk, and the
    tiers they go to."""
    return spec.req_id, spec.object_hash or spec.chunk_hash, spec.tiers


class WorkerSide:
    def __init__(
        self,
        store: ChunkStore,
        copier: BlockCopier,
        timeout_secs: float,
        save_wait_secs: float = 0.005,
    ) -> None:
        self.store = store
        self.copier = copier
        self.timeout_secs = timeout_secs
        self.save_wait_secs = save_wait_secs
        # A thread waits on the store so a stalled tier cannot hold the forward pass beyond the
        # timeout (the late result is dropped). A fetch that timed out keeps its thread until
        # the tier's own timeouts end it: the next load gets a new one instead of queueing
        # behind it (at most _MAX_ABANDONED such threads; beyond, loads fail at once).
        self._fetcher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvtier-fetch")
        self._abandoned: list[Future[list[bytes | None]]] = []
        # Background loads (vLLM's asynchronous loads), a request at a time each thread.
        self._background = ThreadPoolExecutor(max_workers=2, thread_name_prefix="kvtier-load")
        self._finished_loads: dict[str, set[int]] = {}
        # Counters and failed blocks are written by the background loads too.
        self._lock = threading.Lock()
        self._failed_blocks: set[int] = set()
        self._counters: dict[str, float] = {}
        self._samples: dict[str, list[float]] = {}
        self._load_ended: float | None = None
        # Saves after wait_for_save (CUDA): one thread, in step order. `_saving`: chunk hash ->
        # how many of its saves are still in that thread (a load of it waits for them).
        self._saver = (
            ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvtier-save")
            if copier.copies_in_background
            else None
        )
        # The runs of a step go to the store side by side: checksumming and copying for the
        # CPU tier run without the GIL, and one thread falls behind a GPU's saves (measured on
        # an H100 host: fresh host memory filled at 1.6 GB/s by one thread, 5.0 by four).
        self._storers = (
            ThreadPoolExecutor(max_workers=_STORE_THREADS, thread_name_prefix="kvtier-store")
            if self._saver is not None and _STORE_THREADS > 1
            else None
        )
        self._saving: dict[str, int] = {}
        self._saved = threading.Condition(self._lock)
        # Counters from here on; the tiers' fill (a gauge built from deltas) whole, from zero.
        self._last_store_stats = without_fill(store.stats())
        # Warm the copy path (first torch calls allocate and spin up threads) on block 0,
        # unused before the first request, so the first real load is not slower than the rest.
        copier.scatter(copier.gather([0]), 1, 0, [0])

    def _count(self, key: str, n: float = 1) -> None:
        with self._lock:  # background loads count too
            self._counters[key] = self._counters.get(key, 0) + n

    def _sample(self, key: str, seconds: float) -> None:
        """One duration for a histogram (and its sum as a counter under ``key``)."""
        with self._lock:
            self._samples.setdefault(key, []).append(seconds)
        self._count(key, seconds)

    # ------------------------------------------------------------------ loads
    def load(self, specs: Sequence[LoadSpec]) -> None:
        """This step's loads: those the forward pass needs now, before it (waited for, up to
        ``timeout_secs``); those of requests that wait for their KV outside the batch
        (``background``, vLLM's asynchronous loads) in a thread, each request reported done
        by `take_finished` once its chunks are in its blocks or known to have failed."""
        now = [s for s in specs if not s.background]
        if now:
            failed = self._load(now, wait=True)
            with self._lock:
                self._failed_blocks |= failed
        later = [s for s in specs if s.background]
        # Written after what the compute stream has queued so far (the blocks' former users).
        fence = self.copier.fence() if later else None
        # A request's chunks are planned together, in prompt order.
        for req_id, group in itertools.groupby(later, key=lambda spec: spec.req_id):
            self._background.submit(self._load_later, req_id, list(group), fence)

    def _load_later(self, req_id: str, specs: list[LoadSpec], fence: Any) -> None:
        try:
            failed = self._load(specs, wait=False, fence=fence)
        except Exception as exc:  # the request must still be reported: its blocks as failed
            log.warning("kvtier: loading request %s failed: %s", req_id, exc, exc_info=True)
            failed = {b for spec in specs for b in spec.block_ids}
        with self._lock:
            self._finished_loads[req_id] = failed

    def take_finished(self) -> set[str]:
        """Requests whose background loads ended since the last call; the blocks that did not
        load are reported by the next `take_failed_blocks` (vLLM asks for both in one step,
        finished first)."""
        with self._lock:
            done, self._finished_loads = self._finished_loads, {}
            for failed in done.values():
                self._failed_blocks |= failed
        return set(done)

    def _fetch(self, refs: list[ChunkRef], wait: bool) -> dict[str, bytes | None]:
        """Payloads by chunk hash. ``wait``: through the fetch thread, given up after
        ``timeout_secs`` so a stalled tier cannot hold the forward pass (the late result is
        dropped); else here (a background load: its S3 client's timeouts bound it)."""
        if not wait:
            return dict(zip((r.chunk_id for r in refs), self.store.get_many(refs), strict=True))
        self._abandoned = [f for f in self._abandoned if not f.done()]
        if len(self._abandoned) >= _MAX_ABANDONED:
            self._count("load_timeouts")
            return {}  # the tier hangs every fetch: recompute at once rather than wait again
        fut = self._fetcher.submit(self.store.get_many, refs)
        try:
            got = fut.result(timeout=self.timeout_secs)
        except FutureTimeout:
            log.warning(
                "kvtier: loading %d chunks took longer than blocking_timeout_secs=%s; "
                "vLLM recomputes them",
                len(refs),
                self.timeout_secs,
            )
            self._count("load_timeouts")
            self._abandoned.append(fut)
            self._fetcher.shutdown(wait=False)
            self._fetcher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvtier-fetch")
            return {}
        return dict(zip((r.chunk_id for r in refs), got, strict=True))

    def _load(self, specs: Sequence[LoadSpec], wait: bool, fence: Any = None) -> set[int]:
        """Fetch, check and write the chunks of ``specs`` into their blocks; the blocks that
        did not load (vLLM recomputes their tokens). ``wait``: the forward pass waits for
        this load (it is ordered before it on the compute stream); else a background load,
        ordered after ``fence``, that returns once the blocks are written."""
        start = time.perf_counter()
        verified_before = self.store.stats().verify_seconds
        unique = {s.chunk_hash: ChunkRef(s.chunk_hash, s.object_hash, s.position) for s in specs}
        self._wait_for_saves(unique, deadline=start + self.timeout_secs)
        payloads = self._fetch(list(unique.values()), wait)
        fetched = time.perf_counter()
        failed: set[int] = set()
        ready: list[tuple[LoadSpec, bytes]] = []
        broken: set[str] = set()  # requests with a failed chunk: vLLM recomputes from there
        for spec in specs:  # in prompt order per request (as planned)
            payload = payloads.get(spec.chunk_hash)
            if spec.req_id in broken:
                self._fail(spec, "follows a chunk that failed", failed)
                continue
            if payload is None:
                self._fail(spec, "not in any tier, or failed verification", failed)
                broken.add(spec.req_id)
                continue
            try:
                self.copier.check_payload(payload, spec.stored_blocks)
            except LayoutError as exc:
                self._fail(spec, str(exc), failed)
                broken.add(spec.req_id)
                continue
            ready.append((spec, payload))
        copy_start = time.perf_counter()
        try:
            self.copier.scatter_many(
                [(p, s.stored_blocks, s.first, s.block_ids) for s, p in ready],
                after=fence,
                wait=not wait,
            )
        except Exception as exc:  # a bad copy must become a recompute, never a crash
            log.warning("kvtier: cannot write loaded chunks: %s", exc, exc_info=True)
            for spec, _ in ready:
                self._fail(spec, "copy failed", failed)
            ready = []
        loaded_tokens = sum(s.num_tokens for s, _ in ready)
        end = time.perf_counter()
        verify = self.store.stats().verify_seconds - verified_before
        self._count("loaded_chunks", len(ready))
        self._count("loaded_tokens", loaded_tokens)
        self._sample("load_seconds", end - start)
        self._count("load_fetch_seconds", fetched - start)
        self._count("load_verify_seconds", verify)
        self._count("load_copy_seconds", end - copy_start)
        if wait:  # the forward pass that follows is timed (step_done)
            self._load_ended = end
        log.info(
            "kvtier: loaded %d of %d chunks (%d tokens) in %.1f ms (fetch %.1f ms, "
            "verify %.1f ms summed over its threads; copy %.1f ms)%s",
            len(ready),
            len(specs),
            loaded_tokens,
            (end - start) * 1000,
            (fetched - start) * 1000,
            verify * 1000,
            (end - copy_start) * 1000,
            "" if wait else " in the background",
        )
        return failed

    def step_done(self) -> None:
        """After the forward pass (vLLM calls wait_for_save then): its time, in steps that
        loaded chunks, is the rest of a hit's TTFT."""
        if self._load_ended is not None:
            forward = time.perf_counter() - self._load_ended
            self._count("forward_seconds", forward)
            self._count("forward_steps")
            log.info("kvtier: forward pass after the load: %.1f ms", forward * 1000)
            self._load_ended = None

    def _fail(self, spec: LoadSpec, cause: str, failed: set[int]) -> None:
        log.warning(
            "kvtier: chunk %s of request %s not loaded (%s): %d tokens will be recomputed",
            spec.chunk_hash,
            spec.req_id,
            cause,
            spec.num_tokens,
        )
        failed.update(spec.block_ids)
        self._count("load_failed_chunks")
        self._count("load_failed_tokens", spec.num_tokens)

    def take_failed_blocks(self) -> set[int]:
        with self._lock:
            failed, self._failed_blocks = self._failed_blocks, set()
        return failed

    # ------------------------------------------------------------------ saves
    def save(self, specs: Sequence[SaveSpec]) -> None:
        """Queue each chunk's copy out of its blocks and hand the buffers to the save thread
        (vLLM's thread returns at once, see the module's docstring)."""
        if not specs:
            return
        start = time.perf_counter()
        with self._lock:
            failed_loads = set(self._failed_blocks)
        wanted: list[SaveSpec] = []
        for spec in specs:
            if spec.tiers == "remote" and not failed_loads.isdisjoint(spec.block_ids):
                # A late admission of a chunk whose load failed in this step: its blocks do not
                # hold it (vLLM recomputes them, and the scheduler saves them as computed).
                self._count("save_dropped_chunks")
                continue
            wanted.append(spec)
        # One call for the step: on CUDA one upload of the ids, one gather launch per staging
        # buffer's worth of chunks; a request whose chunk gets no slot within save_wait_secs
        # has its later chunks of the step not saved (None).
        try:
            bufs = self.copier.gather_many_to_host(
                [spec.block_ids for spec in wanted],
                self.save_wait_secs,
                [spec.req_id for spec in wanted],
            )
        except Exception as exc:  # never fail the step over a cache write
            log.warning("kvtier: cannot copy %d chunks out: %s", len(wanted), exc, exc_info=True)
            self._count("save_failed_chunks", len(wanted))
            bufs = [None] * len(wanted)
            failed = True
        else:
            failed = False
        queued: list[tuple[SaveSpec, HostBuffer]] = []
        given_up: set[str] = set()  # requests whose later chunks of this step are not saved
        for spec, buf in zip(wanted, bufs, strict=True):
            if buf is not None:
                queued.append((spec, buf))
                continue
            given_up.add(spec.req_id)
            if not failed:
                self._count("save_dropped_chunks")
        if given_up:
            log.info(
                "kvtier: %d chunks of this step not saved: no pinned save buffer came free "
                "within save_wait_secs=%s (or a copy failed); see save_dropped_chunks",
                len(specs) - len(queued),
                self.save_wait_secs,
            )
        if queued:
            with self._lock:
                for spec, _ in queued:
                    self._saving[spec.chunk_hash] = self._saving.get(spec.chunk_hash, 0) + 1
            if self._saver is None:
                self._store_saves(queued)
            else:
                try:
                    self._saver.submit(self._store_saves, queued)
                except RuntimeError:  # closing: nothing is saved any more
                    _release(queued)
                    self._saves_ended(queued)
        self._sample("save_copy_seconds", time.perf_counter() - start)

    def _store_saves(self, queued: list[tuple[SaveSpec, HostBuffer]]) -> None:
        """In the save thread: give each run of the step to the store (one S3 object), the runs
        side by side in `_storers` (CUDA on a larger host); a run's buffers go back once the
        store's writes of it have ended."""
        runs = [
            list(group) for _, group in itertools.groupby(queued, key=lambda sb: _run_of(sb[0]))
        ]
        try:
            if self._storers is None or len(runs) == 1:
                for run in runs:
                    self._store_run(run)
            else:
                list(self._storers.map(self._store_run, runs))
        finally:
            self._saves_ended(queued)

    def _store_run(self, run: list[tuple[SaveSpec, HostBuffer]]) -> None:
        """Wait for the run's copies, give it to the store; never raises."""
        try:
            chunks = [(spec.chunk_hash, buf.view(), spec.num_tokens) for spec, buf in run]
            self.store.put_run(chunks, on_done=partial(_release, run), tiers=run[0][0].tiers)
        except Exception as exc:  # the copy out failed, or the store (e.g. no memory for the
            # CPU tier's copy): not saved, and the slots come back (release is idempotent)
            log.warning(
                "kvtier: cannot copy out or store %d chunks: %s", len(run), exc, exc_info=True
            )
            self._count("save_failed_chunks", len(run))
            _release(run)
            return
        self._count("saved_chunks", len(chunks))
        self._count("saved_bytes", sum(len(p) for _, p, _ in chunks))

    def _saves_ended(self, queued: list[tuple[SaveSpec, HostBuffer]]) -> None:
        with self._saved:
            for spec, _ in queued:
                left = self._saving.pop(spec.chunk_hash) - 1
                if left:
                    self._saving[spec.chunk_hash] = left
            self._saved.notify_all()

    def _wait_for_saves(self, chunks: Collection[str], deadline: float) -> None:
        """Until none of `chunks` is still in the save thread (or `deadline`)."""
        with self._saved:
            self._saved.wait_for(
                lambda: not any(c in self._saving for c in chunks),
                max(0.0, deadline - time.perf_counter()),
            )

    # ------------------------------------------------------------------ stats / shutdown
    def take_stats(self) -> dict[str, Any]:
        """Counters since the last call, including the store's per-tier counters."""
        with self._lock:
            out: dict[str, Any] = dict(self._counters)
            self._counters = {}
            for key, samples in self._samples.items():
                out[key + SAMPLES] = samples
            self._samples = {}
        now = self.store.stats()
        out.update(store_deltas(self._last_store_stats, now))
        self._last_store_stats = now
        return out

    def close(self, timeout: float) -> None:
        self._fetcher.shutdown(wait=False, cancel_futures=True)
        self._background.shutdown(wait=False, cancel_futures=True)
        if self._saver is not None:
            self._saver.shutdown(wait=True)  # the steps' saves reach the store, then it flushes
        if self._storers is not None:
            self._storers.shutdown(wait=True)
        self.store.close(timeout)


def _release(run: Sequence[tuple[SaveSpec, HostBuffer]]) -> None:
    for _, buf in run:
        buf.release()
