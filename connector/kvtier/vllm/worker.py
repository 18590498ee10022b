"""Worker side: copy blocks between vLLM's paged KV buffer and the tiered store.

- Loads run before the forward pass (vLLM marks the step as having synchronous loads): all
  chunks of the step are fetched in parallel and written into their blocks. The wait is capped
  at ``blocking_timeout_secs``; whatever has not arrived, failed verification or has the wrong
  size is reported through ``failed_blocks`` so vLLM recomputes those tokens. Loads planned in
  the background (``enable_async_loading``: the request waits outside the batch, vLLM's
  asynchronous load) run in a thread while the steps of the other requests go on; the request
  is reported done through ``take_finished``, with its failed blocks, and then scheduled.
- Saves run in ``wait_for_save`` after the forward pass: the chunks' blocks are copied out
  synchronously (one memcpy per layer; vLLM may reuse the blocks right after the step) and
  handed to the store a run at a time (one S3 object), which writes the slower tiers in the
  background.
Every failure here is a miss (logged with its cause), never an exception into vLLM.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, Protocol

from kvtier.stats import SAMPLES, StoreStats, store_deltas, without_fill
from kvtier.store import ChunkRef
from kvtier.vllm.copier import BlockCopier
from kvtier.vllm.layout import LayoutError
from kvtier.vllm.plan import LoadSpec, SaveSpec

log = logging.getLogger(__name__)
#: Fetch threads left waiting on a tier after their load timed out, at most (see __init__).
_MAX_ABANDONED = 4


class ChunkStore(Protocol):
    """The part of kvtier.store.TieredStore the worker uses."""

    def get_many(self, refs: Sequence[str | ChunkRef]) -> list[bytes | None]: ...
    def put_run(self, chunks: Sequence[tuple[str, bytes | memoryview, int]]) -> None: ...
    def stats(self) -> StoreStats: ...
    def close(self, timeout: float | None = ...) -> None: ...


def _run_of(spec: SaveSpec) -> tuple[str, str]:
    """What makes consecutive saves one object: the request and its run's first chunk."""
    return spec.req_id, spec.object_hash or spec.chunk_hash


class WorkerSide:
    def __init__(
        self,
        store: ChunkStore,
        copier: BlockCopier,
        timeout_secs: float,
    ) -> None:
        self.store = store
        self.copier = copier
        self.timeout_secs = timeout_secs
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
        # A request's chunks are planned together, in prompt order.
        for req_id, group in itertools.groupby(later, key=lambda spec: spec.req_id):
            self._background.submit(self._load_later, req_id, list(group))

    def _load_later(self, req_id: str, specs: list[LoadSpec]) -> None:
        try:
            failed = self._load(specs, wait=False)
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

    def _load(self, specs: Sequence[LoadSpec], wait: bool) -> set[int]:
        """Fetch, check and write the chunks of ``specs`` into their blocks; the blocks that
        did not load (vLLM recomputes their tokens)."""
        start = time.perf_counter()
        verified_before = self.store.stats().verify_seconds
        unique = {s.chunk_hash: ChunkRef(s.chunk_hash, s.object_hash, s.position) for s in specs}
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
            self.copier.scatter_many([(p, s.stored_blocks, s.first, s.block_ids) for s, p in ready])
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
        """Copy each chunk's blocks out (each buffer goes back to the copier at once; on CUDA
        the next chunks' copies are already queued: BlockCopier.gather_iter), then hand the
        copies to the store."""
        if not specs:
            return
        start = time.perf_counter()
        copied: list[bytes] = []
        try:
            for _, buf in self.copier.gather_iter([s.block_ids for s in specs]):
                try:
                    copied.append(bytes(buf.view()))
                finally:
                    buf.release()
        except Exception as exc:  # never fail the step over a cache write
            failed = specs[len(copied) :]
            log.warning(
                "kvtier: cannot copy %d chunks out (from %s on): %s",
                len(failed),
                failed[0].chunk_hash if failed else "-",
                exc,
                exc_info=True,
            )
            self._count("save_failed_chunks", len(failed))
        # Handed to the store only once every chunk of the step is copied: its background
        # writers (disk, S3) start with the first put, and on a few cores they would slow the
        # rest of these copies, which the request's first token waits for. Consecutive chunks
        # of one run go together (one object on the remote tier).
        done = list(zip(specs, copied, strict=False))
        for _, run in itertools.groupby(done, key=lambda sp: _run_of(sp[0])):
            chunks = [(spec.chunk_hash, payload, spec.num_tokens) for spec, payload in run]
            self.store.put_run(chunks)
            self._count("saved_chunks", len(chunks))
            self._count("saved_bytes", sum(len(p) for _, p, _ in chunks))
        self._sample("save_copy_seconds", time.perf_counter() - start)

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
        self.store.close(timeout)
