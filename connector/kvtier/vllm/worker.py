"""Worker side: copy blocks between vLLM's paged KV buffer and the tiered store.

- Loads run before the forward pass (vLLM marks the step as having synchronous loads): all
  chunks of the step are fetched in parallel and written into their blocks. The wait is capped
  at ``blocking_timeout_secs``; whatever has not arrived, failed verification or has the wrong
  size is reported through ``failed_blocks`` so vLLM recomputes those tokens.
- Saves run in ``wait_for_save`` after the forward pass: the chunks' blocks are copied out
  synchronously (one memcpy per layer; vLLM may reuse the blocks right after the step) and
  handed to the store a run at a time (one S3 object), which writes the slower tiers in the
  background.
Every failure here is a miss (logged with its cause), never an exception into vLLM.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, Protocol

from kvtier.stats import SAMPLES, StoreStats, store_deltas, without_fill
from kvtier.store import ChunkRef
from kvtier.vllm.copier import BlockCopier
from kvtier.vllm.layout import LayoutError
from kvtier.vllm.plan import LoadSpec, SaveSpec

log = logging.getLogger(__name__)


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
        # One thread waits on the store so a stalled tier cannot hold the forward pass
        # beyond the timeout (the late result is dropped).
        self._fetcher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvtier-fetch")
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
        self._counters[key] = self._counters.get(key, 0) + n

    def _sample(self, key: str, seconds: float) -> None:
        """One duration for a histogram (and its sum as a counter under ``key``)."""
        self._samples.setdefault(key, []).append(seconds)
        self._count(key, seconds)

    # ------------------------------------------------------------------ loads
    def load(self, specs: Sequence[LoadSpec]) -> None:
        if not specs:
            return
        start = time.perf_counter()
        verified_before = self.store.stats().verify_seconds
        unique = {s.chunk_hash: ChunkRef(s.chunk_hash, s.object_hash, s.position) for s in specs}
        refs = list(unique.values())
        fut = self._fetcher.submit(self.store.get_many, refs)
        try:
            got = fut.result(timeout=self.timeout_secs)
            payloads = {r.chunk_id: p for r, p in zip(refs, got, strict=True)}
        except FutureTimeout:
            log.warning(
                "kvtier: loading %d chunks took longer than blocking_timeout_secs=%s; "
                "vLLM recomputes them",
                len(refs),
                self.timeout_secs,
            )
            self._count("load_timeouts")
            payloads = {}
        fetched = time.perf_counter()
        ready: list[tuple[LoadSpec, bytes]] = []
        broken: set[str] = set()  # requests with a failed chunk: vLLM recomputes from there
        for spec in specs:  # in prompt order per request (as planned)
            payload = payloads.get(spec.chunk_hash)
            if spec.req_id in broken:
                self._fail(spec, "follows a chunk that failed")
                continue
            if payload is None:
                self._fail(spec, "not in any tier, or failed verification")
                broken.add(spec.req_id)
                continue
            try:
                self.copier.check_payload(payload, spec.stored_blocks)
            except LayoutError as exc:
                self._fail(spec, str(exc))
                broken.add(spec.req_id)
                continue
            ready.append((spec, payload))
        copy_start = time.perf_counter()
        try:
            self.copier.scatter_many([(p, s.stored_blocks, s.first, s.block_ids) for s, p in ready])
        except Exception as exc:  # a bad copy must become a recompute, never a crash
            log.warning("kvtier: cannot write loaded chunks: %s", exc, exc_info=True)
            for spec, _ in ready:
                self._fail(spec, "copy failed")
            ready = []
        loaded_chunks = len(ready)
        loaded_tokens = sum(s.num_tokens for s, _ in ready)
        self._count("loaded_chunks", loaded_chunks)
        self._count("loaded_tokens", loaded_tokens)
        end = time.perf_counter()
        verify = self.store.stats().verify_seconds - verified_before
        self._sample("load_seconds", end - start)
        self._count("load_fetch_seconds", fetched - start)
        self._count("load_verify_seconds", verify)
        self._count("load_copy_seconds", end - copy_start)
        self._load_ended = end
        log.info(
            "kvtier: loaded %d of %d chunks (%d tokens) in %.1f ms (fetch %.1f ms, "
            "verify %.1f ms summed over its threads; copy %.1f ms)",
            loaded_chunks,
            len(specs),
            loaded_tokens,
            (end - start) * 1000,
            (fetched - start) * 1000,
            verify * 1000,
            (end - copy_start) * 1000,
        )

    def step_done(self) -> None:
        """After the forward pass (vLLM calls wait_for_save then): its time, in steps that
        loaded chunks, is the rest of a hit's TTFT."""
        if self._load_ended is not None:
            forward = time.perf_counter() - self._load_ended
            self._count("forward_seconds", forward)
            self._count("forward_steps")
            log.info("kvtier: forward pass after the load: %.1f ms", forward * 1000)
            self._load_ended = None

    def _fail(self, spec: LoadSpec, cause: str) -> None:
        log.warning(
            "kvtier: chunk %s of request %s not loaded (%s): %d tokens will be recomputed",
            spec.chunk_hash,
            spec.req_id,
            cause,
            spec.num_tokens,
        )
        self._failed_blocks.update(spec.block_ids)
        self._count("load_failed_chunks")
        self._count("load_failed_tokens", spec.num_tokens)

    def take_failed_blocks(self) -> set[int]:
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
        self.store.close(timeout)
