"""CUDA data path of BlockCopier: paged KV blocks <-> pooled pinned host buffers.

Imported only when vLLM's KV cache is on a CUDA device (the CPU build never imports it).

- gather (a save), on the copier's own CUDA stream, ordered after the work already queued on
  the current stream: (1) one launch copies every layer's pages of the chunk into a device
  staging buffer in payload order (Triton; ``mode="torch"``: one ``index_select`` per layer),
  (2) one DMA copies the staging buffer into a slot of the pinned pool. The current stream
  waits for (1) only (a later kernel may then overwrite the blocks); the host waits for (2)
  when it reads the slot (``HostBuffer.view()``). A step's saves (`gather_many_to_host`):
  the block ids of all its chunks go up in one copy, one launch writes as many chunks as the
  staging buffer holds (sized ``staging_bytes``: a 7B step's 32 chunks in one launch) at the
  places their slots have in the pool, and one DMA per run of adjacent slots copies them out,
  so vLLM's thread spends a fixed few hundred microseconds per step, not one launch per chunk.
- scatter (a load), on the same stream, after the compute stream's work: one DMA from a pinned
  slot (a pageable payload is first copied into one, outside the copy lock, so a long load
  never holds up the other thread's copies; a payload in memory pinned by `pin_host_region`,
  the CPU tier's slab, is copied from where it is and held until the DMA has read it) into
  staging, one launch into the pages. A load
  the forward pass waits for: the compute stream waits for it, the host does not. A load in
  the background (``wait=True``, in a loading thread): the thread waits for an event recorded
  after its writes, so the request is reported loaded only once its blocks hold the data.

"The compute stream" is the stream vLLM computes on, given by `compute_stream` (on CUDA the
connector passes ``vllm.utils.torch_utils.current_stream``: vLLM's model runner computes on a
dedicated stream it sets on its main thread, not on the thread-local default stream). It is
asked on vLLM's thread only; a background load is ordered after an event (`fence`) that vLLM's
thread recorded on it when the load was planned.

Two pinned pools of chunk-sized slots, allocated once (sized from the chunk, or from the first
payload and grown when a larger one comes): nothing is pinned per request. Loads use `slots`
of them (fetch targets, bounces); saves use `save_slots`, each held from the step that gathers
it until the tiers have written it (kvtier.vllm.worker). Slot reuse is fenced by CUDA events: a
slot goes back to a caller only once the device is done with it.
"""

from __future__ import annotations

import itertools
import logging
import threading
import warnings
from collections import deque
from collections.abc import Callable, Hashable, Iterator, Sequence
from typing import Any

import numpy as np
import torch

from kvtier.vllm.blockcopy.host_buffer import (
    HostBuffer,
    Payload,
    SlotsBusy,
    seconds_left,
    slot_deadline,
)
from kvtier.vllm.blockcopy.pinned import PinnedHostBuffer, PinnedPool, in_pinned_region
from kvtier.vllm.layout import KVLayout, LayoutError, PageGeometry, page_geometry

log = logging.getLogger(__name__)

_WORD_DTYPES = {4: torch.int32, 2: torch.int16, 1: torch.uint8}
#: Device staging of a step's saves, at most (whole slots; at least one): the chunks gathered
#: in one launch. The compute stream waits for the last launch's reads, so with more chunks
#: than this holds it also waits for the copies out of the launches before it.
STAGING_BYTES = 512 << 20


class _IdsRing:
    """Block ids to the device without a host sync: a ring of pinned + device int64 rows,
    each reused only once the copy that read it has run."""

    def __init__(self, capacity: int, device: Any, entries: int = 8) -> None:
        self.capacity = capacity
        self.host = torch.empty((entries, max(1, capacity)), dtype=torch.int64, pin_memory=True)
        self._host_np = self.host.numpy()
        self.dev = torch.empty((entries, max(1, capacity)), dtype=torch.int64, device=device)
        self.events = [torch.cuda.Event() for _ in range(entries)]
        self.used = [False] * entries
        self.next = 0

    def put(self, ids: Sequence[int] | Any, stream: Any) -> Any:
        """The ids (a sequence or an int64 array) on the device (copy queued on `stream`, the
        current stream)."""
        k = self.next
        self.next = (k + 1) % len(self.events)
        if self.used[k]:
            self.events[k].synchronize()
        n = len(ids)
        self._host_np[k, :n] = ids
        dev = self.dev[k, :n]
        dev.copy_(self.host[k, :n], non_blocking=True)
        self.events[k].record(stream)
        self.used[k] = True
        return dev


class CudaBlockCopier:
    """The CUDA half of BlockCopier (same payload format: ``[layer][block][page bytes]``, each
    page in the KV cache's memory order)."""

    def __init__(
        self,
        layout: KVLayout,
        tensors: Sequence[Any],
        *,
        max_blocks: int | None = None,
        pinned_buffers: int = 4,
        save_buffers: int | None = None,
        mode: str = "auto",
        compute_stream: Callable[[], Any] | None = None,
        staging_bytes: int | None = None,
    ) -> None:
        self.layout = layout
        self.tensors = list(tensors)
        t0 = self.tensors[0]
        self.device = t0.device
        storage = t0.untyped_storage()
        self.geometry: PageGeometry = page_geometry(
            tuple(t0.shape),
            [tuple(t.stride()) for t in self.tensors],
            [int(t.data_ptr()) for t in self.tensors],
            t0.element_size(),
            int(storage.data_ptr()),
        )
        g = self.geometry
        if g.page_words * g.word != layout.block_nbytes:
            raise LayoutError(
                f"KV cache pages hold {g.page_words * g.word} bytes, expected "
                f"{layout.block_nbytes} ({layout.kv_layout()})"
            )
        word_dtype = _WORD_DTYPES[g.word]
        # The first layer's whole storage as words: the kernels address every layer from it.
        self._kv_words = torch.empty(0, dtype=word_dtype, device=self.device).set_(
            storage, 0, (1,), (1,)
        )
        self._word_dtype = word_dtype
        self._layer_offsets = torch.tensor(g.layer_offsets, dtype=torch.int64, device=self.device)
        if mode == "auto":
            mode = "triton" if _have_triton() else "torch"
        if mode not in ("triton", "torch"):
            raise LayoutError(f"unknown CUDA copy mode {mode!r} (triton, torch)")
        self.mode = mode
        self.stream = torch.cuda.Stream(device=self.device)
        self._compute_stream = compute_stream or (lambda: torch.cuda.current_stream(self.device))
        # Reused events (recording one again is fine once its waits are queued).
        self._ev_cur = torch.cuda.Event()  # the compute stream's work so far
        self._ev_read = torch.cuda.Event()  # a gather's kernel has read the blocks
        self._ev_written = torch.cuda.Event()  # a scatter's kernel has written them
        self._lock = threading.RLock()
        self._slots = max(2, pinned_buffers)
        self._save_slots = max(2, save_buffers if save_buffers is not None else pinned_buffers)
        self._pool: PinnedPool | None = None
        self._save_pool: PinnedPool | None = None
        self._staging: Any = None
        self._staging_bytes = STAGING_BYTES if staging_bytes is None else staging_bytes
        self._ids: _IdsRing | None = None
        self._many_ids: _IdsRing | None = None  # a step's saves: ids and staging offsets
        #: (event after the copy, tensor) of loads copied straight from another's pinned
        #: memory, oldest first.
        self._held_sources: deque[tuple[Any, Any]] = deque()
        if max_blocks:  # both pools now: pinning them mid-step would stall it
            self._ensure_capacity(layout.payload_nbytes(max_blocks))
            self._ensure_capacity(layout.payload_nbytes(max_blocks), saves=True)

    # ------------------------------------------------------------------ buffers
    @property
    def pool(self) -> PinnedPool | None:
        """The loads' pool (fetch targets, bounces)."""
        return self._pool

    @property
    def save_pool(self) -> PinnedPool | None:
        """The saves' pool (gathers)."""
        return self._save_pool

    def _ensure_capacity(self, nbytes: int, saves: bool = False) -> PinnedPool:
        """The pool of loads (``saves``: of saves) for payloads of `nbytes`, and the device
        staging buffer; grown, never per request: a larger payload than any before replaces
        them once."""
        with self._lock:
            pool = self._save_pool if saves else self._pool
            if pool is not None and nbytes <= pool.slot_bytes:
                return pool
            slot_bytes = max(
                [nbytes, *(p.slot_bytes for p in (self._pool, self._save_pool) if p is not None)]
            )
            if pool is not None:
                self.stream.synchronize()
                log.info(
                    "kvtier: payload of %d bytes exceeds the pinned slots (%d bytes): pool "
                    "re-allocated (pass max_blocks to size it once)",
                    nbytes,
                    pool.slot_bytes,
                )
            staging = slot_bytes * max(1, min(self._save_slots, self._staging_bytes // slot_bytes))
            if self._staging is None or staging > self._staging.numel():
                if self._staging is not None:
                    self.stream.synchronize()  # the copy stream may still read the old one
                self._staging = torch.empty(staging, dtype=torch.uint8, device=self.device)
            blocks = max(1, slot_bytes // (self.layout.num_layers * self.layout.block_nbytes))
            if self._ids is None or blocks > self._ids.capacity:
                # A row per copy that can be in flight (every slot of both pools, and a
                # margin): a step queues all its gathers at once, and reusing a row the copy
                # stream has not read yet would make the host wait for it.
                entries = self._slots + self._save_slots + 8
                self._ids = _IdsRing(blocks, self.device, entries)
                # A step's saves: ids, staging offsets and layer strides of every block of
                # the chunks that hold a save slot (at most all of them), one row per step.
                self._many_ids = _IdsRing(3 * self._save_slots * blocks, self.device, 4)
            if saves:
                self._save_pool = PinnedPool(slot_bytes, self._save_slots)
                return self._save_pool
            self._pool = PinnedPool(slot_bytes, self._slots)
            return self._pool

    def host_buffer(self, nbytes: int) -> PinnedHostBuffer:
        pool = self._ensure_capacity(nbytes)
        return PinnedHostBuffer(pool, pool.acquire(), nbytes)

    def fence(self) -> Any:
        """An event after the work queued so far on the compute stream (call on vLLM's
        thread); a background load passes it to `scatter_many` to be ordered after it."""
        ev = torch.cuda.Event()
        ev.record(self._compute_stream())
        return ev

    # ------------------------------------------------------------------ gather
    def gather_to_host(
        self, block_ids: Sequence[int], wait_secs: float | None = None
    ) -> PinnedHostBuffer:
        """A save slot holding `block_ids` of every layer once the copy lands (``view()``
        waits). A slot is waited for up to `wait_secs` (default: the pool's bound), then
        `kvtier.vllm.blockcopy.copier.SlotsBusy` is raised."""
        n = len(block_ids)
        nbytes = self.layout.payload_nbytes(n)
        pool = self._ensure_capacity(nbytes, saves=True)
        buf = PinnedHostBuffer(pool, pool.acquire(wait_secs), nbytes)
        try:
            with self._lock:
                cur = self._compute_stream()
                s = self.stream
                self._ev_cur.record(cur)
                s.wait_event(self._ev_cur)
                with torch.cuda.stream(s):
                    assert self._ids is not None
                    ids = self._ids.put(block_ids, s)
                    self._copy_pages(ids, n, n, 0, to_payload=True)
                    self._ev_read.record(s)
                    buf.tensor.copy_(self._staging[:nbytes], non_blocking=True)
                    buf.pool.record(buf.slot, s)
                cur.wait_event(self._ev_read)
        except BaseException:
            buf.release()
            raise
        return buf

    def gather_many_to_host(
        self,
        block_id_lists: Sequence[Sequence[int]],
        wait_secs: float | None = None,
        groups: Sequence[Hashable] | None = None,
    ) -> list[PinnedHostBuffer | None]:
        """`gather_to_host` for each of several chunks (a step's saves) in one go: a save
        slot each (taken in order, each waited for up to `wait_secs`), one copy of all the
        block ids to the device, one gather launch per stagingful of chunks, one DMA per run
        of adjacent slots. Ordered like `gather_to_host`: after the compute stream's work so
        far; the compute stream waits for the gathers' reads, the host for nothing.

        A chunk that gets no slot within `wait_secs` is None, and so is every later chunk of
        its group (`groups`: one key per chunk, e.g. the request; None: all one group); a
        later chunk of another group still tries. Any other failure raises, with every slot
        taken here given back."""
        count = len(block_id_lists)
        if count == 0:
            return []
        self._drop_finished_sources()  # a step's call: loads' sources are let go in time
        sizes = [len(ids) for ids in block_id_lists]
        nbytes = [self.layout.payload_nbytes(n) for n in sizes]
        pool = self._ensure_capacity(max(nbytes), saves=True)
        slots = self._take_save_slots(pool, count, wait_secs, groups)
        try:
            bufs = [
                None if slot is None else PinnedHostBuffer(pool, slot, nb)
                for slot, nb in zip(slots, nbytes, strict=True)
            ]
            taken = [
                (slot, block_id_lists[i], sizes[i], nbytes[i])
                for i, slot in enumerate(slots)
                if slot is not None
            ]
            if taken:
                self._gather_into_slots(pool, taken)
        except BaseException:
            for slot in slots:
                if slot is not None:
                    pool.release(slot)
            raise
        return bufs

    def _take_save_slots(
        self,
        pool: PinnedPool,
        count: int,
        wait_secs: float | None,
        groups: Sequence[Hashable] | None,
    ) -> list[int | None]:
        """A save slot for each chunk in order (None: see `gather_many_to_host`): those free
        now in one go, then the others waited for until `wait_secs` from now, all together."""
        deadline = slot_deadline(wait_secs)
        free = iter(pool.acquire_many(count))
        out: list[int | None] = []
        busy: set[Hashable] = set()
        try:
            for i in range(count):
                group = groups[i] if groups is not None else None
                if group in busy:
                    out.append(None)
                    continue
                slot = next(free, None)
                if slot is None:
                    try:
                        slot = pool.acquire(seconds_left(deadline))
                    except SlotsBusy:
                        busy.add(group)
                        out.append(None)
                        continue
                out.append(slot)
        except BaseException:
            for slot in out:
                if slot is not None:
                    pool.release(slot)
            raise
        finally:
            for slot in free:  # none are left unless something raised
                pool.release(slot)
        return out

    def _gather_into_slots(
        self, pool: PinnedPool, items: list[tuple[int, Sequence[int], int, int]]
    ) -> None:
        """(slot, block ids, blocks, bytes) of each chunk: gathered on the copy stream and
        copied into its slot (see `gather_many_to_host`)."""
        g = self.geometry
        sb = pool.slot_bytes
        items = sorted(items, key=lambda it: it[0])  # adjacent slots: one DMA
        per_launch = max(1, self._staging.numel() // sb)
        ns = np.fromiter((it[2] for it in items), dtype=np.int64, count=len(items))
        total = int(ns.sum())
        # Per block: its id, its page's word in the staging buffer (layer 0) and the words
        # between its layers' pages (its chunk's blocks of pages).
        row = np.empty(3 * total, dtype=np.int64)
        row[:total] = np.fromiter(
            itertools.chain.from_iterable(it[1] for it in items), dtype=np.int64, count=total
        )
        place = np.arange(len(items), dtype=np.int64) % per_launch
        first = np.cumsum(ns) - ns
        row[total : 2 * total] = np.repeat(place * (sb // g.word) - first * g.page_words, ns) + (
            np.arange(total, dtype=np.int64) * g.page_words
        )
        row[2 * total :] = np.repeat(ns * g.page_words, ns)
        with self._lock:
            cur = self._compute_stream()
            s = self.stream
            self._ev_cur.record(cur)
            s.wait_event(self._ev_cur)
            with torch.cuda.stream(s):
                assert self._many_ids is not None
                dev = self._many_ids.put(row, s)
                staging_words = self._staging.view(self._word_dtype)
                for b0 in range(0, len(items), per_launch):
                    batch = items[b0 : b0 + per_launch]
                    lo = int(first[b0])
                    hi = lo + int(ns[b0 : b0 + per_launch].sum())
                    if self.mode == "triton" and hi > lo:
                        from kvtier.vllm.blockcopy import _triton

                        _triton.launch_gather_many(
                            self._kv_words,
                            staging_words,
                            self._layer_offsets,
                            dev[lo:hi],
                            dev[total + lo : total + hi],
                            dev[2 * total + lo : 2 * total + hi],
                            num_layers=self.layout.num_layers,
                            num_ids=hi - lo,
                            geometry=g,
                        )
                    elif hi > lo:
                        at = lo
                        for k, (_, _, n, _) in enumerate(batch):
                            self._copy_pages(
                                dev[at : at + n], n, n, 0, to_payload=True, staging_offset=k * sb
                            )
                            at += n
                    if b0 + per_launch >= len(items):
                        self._ev_read.record(s)  # every page of the step read
                    self._copy_out(pool, batch, s)
            cur.wait_event(self._ev_read)

    def _copy_out(
        self, pool: PinnedPool, batch: list[tuple[int, Sequence[int], int, int]], s: Any
    ) -> None:
        """Chunk k of `batch`, at ``k * slot_bytes`` in the staging buffer, into its slot: one
        DMA per run of adjacent slots (a partial chunk's slot gets the rest of its staging
        place too, unused), one event after each."""
        sb = pool.slot_bytes
        start = 0
        for k, (slot, _, _, nbytes) in enumerate(batch):
            if k + 1 < len(batch) and batch[k + 1][0] == slot + 1:
                continue
            first = batch[start][0]
            length = (k - start) * sb + nbytes
            pool.host[first * sb : first * sb + length].copy_(
                self._staging[start * sb : start * sb + length], non_blocking=True
            )
            ev = torch.cuda.Event()
            ev.record(s)
            pool.record_shared(range(first, slot + 1), ev)
            start = k + 1

    def gather_iter(
        self, block_id_lists: Sequence[Sequence[int]]
    ) -> Iterator[tuple[int, PinnedHostBuffer]]:
        ahead = max(1, self._save_slots - 1)  # gathers hold save slots
        queued: deque[tuple[int, PinnedHostBuffer]] = deque()
        try:
            for i, ids in enumerate(block_id_lists):
                queued.append((i, self.gather_to_host(ids)))
                if len(queued) >= ahead:
                    yield queued.popleft()
            while queued:
                yield queued.popleft()
        finally:  # the caller stopped early: give the queued slots back
            for _, buf in queued:
                buf.release()

    def gather_bytes(self, block_ids: Sequence[int]) -> bytes:
        with self.gather_to_host(block_ids) as buf:
            return bytes(buf.view())

    # ------------------------------------------------------------------ scatter
    def scatter_many(
        self,
        items: Sequence[tuple[Payload, int, int, Sequence[int]]],
        *,
        after: Any = None,
        wait: bool = False,
    ) -> None:
        """`BlockCopier.scatter_many` (copier.py) on CUDA (``after``, ``wait``: there)."""
        if not items:
            return
        for payload, stored, first, block_ids in items:
            expected = self.layout.payload_nbytes(stored)
            if len(payload) != expected:
                raise LayoutError(f"payload has {len(payload)} bytes, expected {expected}")
            if first < 0 or first + len(block_ids) > stored:
                raise LayoutError(
                    f"blocks {first}..{first + len(block_ids)} of a payload of {stored} blocks"
                )
        s = self.stream
        with self._lock:
            if after is None:
                after = self._ev_cur
                after.record(self._compute_stream())
            s.wait_event(after)
        done = torch.cuda.Event()
        self._drop_finished_sources()
        for payload, stored, first, block_ids in items:
            nbytes = self.layout.payload_nbytes(stored)
            # The bounce (pageable -> pinned, a host memcpy) runs outside the lock.
            src, pool, slot, bounce = self._pinned_source(payload, nbytes)
            try:
                with self._lock, torch.cuda.stream(s):
                    assert self._ids is not None
                    ids = self._ids.put(block_ids, s)
                    self._staging[:nbytes].copy_(src, non_blocking=True)
                    if pool is not None:
                        pool.record(slot, s)
                    else:  # another's pinned memory: held until this copy has read it
                        read = torch.cuda.Event()
                        read.record(s)
                        self._held_sources.append((read, src))
                    self._copy_pages(ids, len(block_ids), stored, first, to_payload=False)
                    done.record(s)
            finally:
                if bounce and pool is not None:
                    pool.release(slot)
        if wait:
            done.synchronize()
            return
        self._compute_stream().wait_event(done)

    def _drop_finished_sources(self) -> None:
        """Let go of the pinned sources whose copies have landed (their lenders may reuse
        them: a CPU tier's slot is leased while a tensor over it lives)."""
        with self._lock:
            while self._held_sources and self._held_sources[0][0].query():
                self._held_sources.popleft()

    def _pinned_source(
        self, payload: Payload, nbytes: int
    ) -> tuple[Any, PinnedPool | None, int, bool]:
        """(pinned uint8 tensor of the payload, its pool, slot, whether the slot is ours).
        No pool: the payload lies in memory pinned by `pin_host_region` (the CPU tier's slab),
        copied from where it is; the caller holds the tensor until the copy has read it."""
        pool = self._ensure_capacity(nbytes)
        if isinstance(payload, PinnedHostBuffer):  # ours or another copier's: pinned either way
            payload.wait()
            return payload.tensor, payload.pool, payload.slot, False
        data = payload.view() if isinstance(payload, HostBuffer) else payload
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # read-only buffer, only read
            src = torch.frombuffer(data, dtype=torch.uint8)
        for mine in (pool, self._save_pool):
            where = mine.slot_at(int(src.data_ptr()), nbytes) if mine is not None else None
            if mine is not None and where is not None:  # a view of one of our slots
                slot, offset = where
                mine.wait(slot)
                return mine.tensor(slot, nbytes, offset), mine, slot, False
        if in_pinned_region(int(src.data_ptr()), nbytes):
            return src, None, -1, False
        slot = pool.acquire()
        dst = pool.tensor(slot, nbytes)
        _parallel_copy(dst, src)
        return dst, pool, slot, True

    # ------------------------------------------------------------------ the copy itself
    def _copy_pages(
        self,
        ids: Any,
        num_ids: int,
        payload_blocks: int,
        payload_first: int,
        *,
        to_payload: bool,
        staging_offset: int = 0,
    ) -> None:
        """Pages `ids` of every layer <-> payload blocks ``payload_first ..`` of the payload
        at `staging_offset` (bytes) of the staging buffer holding `payload_blocks` blocks per
        layer; on the current stream."""
        g = self.geometry
        if num_ids == 0:
            return
        if self.mode == "triton":
            from kvtier.vllm.blockcopy import _triton

            _triton.launch(
                self._kv_words,
                self._staging[staging_offset:].view(self._word_dtype),
                self._layer_offsets,
                ids,
                num_layers=self.layout.num_layers,
                num_ids=num_ids,
                payload_blocks=payload_blocks,
                payload_first=payload_first,
                geometry=g,
                to_payload=to_payload,
            )
            return
        t0 = self.tensors[0]
        perm = (0, *g.inner_order)
        sizes = [int(t0.shape[d]) for d in g.inner_order]
        nbytes = self.layout.payload_nbytes(payload_blocks)
        staged = self._staging[staging_offset : staging_offset + nbytes].view(t0.dtype)
        staged = staged.view(self.layout.num_layers, payload_blocks, *sizes)
        for i, t in enumerate(self.tensors):
            pages = t.permute(*perm)
            if to_payload:
                torch.index_select(pages, 0, ids, out=staged[i])
            else:
                pages.index_copy_(0, ids, staged[i, payload_first : payload_first + num_ids])

    def synchronize(self) -> None:
        self.stream.synchronize()

    def close(self) -> None:
        with self._lock:
            self.stream.synchronize()
            self._held_sources.clear()
            for pool in (self._pool, self._save_pool):
                if pool is not None:
                    pool.close()


#: Pageable -> pinned bounces are split over this many threads: one thread's memcpy (10-20
#: GB/s) is slower than the host -> device link, and vLLM runs its workers with one torch
#: thread. torch's copy releases the GIL.
_BOUNCE_THREADS = 8
_BOUNCE_MIN_BYTES = 4 << 20
_bounce_pool: Any = None
_bounce_lock = threading.Lock()


def _parallel_copy(dst: Any, src: Any) -> None:
    """dst.copy_(src) for flat uint8 CPU tensors, in parts copied by a few threads."""
    global _bounce_pool
    n = src.numel()
    if n < _BOUNCE_MIN_BYTES:
        dst.copy_(src)
        return
    with _bounce_lock:
        if _bounce_pool is None:
            from concurrent.futures import ThreadPoolExecutor

            _bounce_pool = ThreadPoolExecutor(_BOUNCE_THREADS, thread_name_prefix="kvtier-bounce")
    step = -(-n // _BOUNCE_THREADS)
    parts = [(dst[i : i + step], src[i : i + step]) for i in range(0, n, step)]
    for fut in [_bounce_pool.submit(d.copy_, s_) for d, s_ in parts]:
        fut.result()


def _have_triton() -> bool:
    try:
        from kvtier.vllm.blockcopy import _triton  # noqa: F401
    except ImportError:
        return False
    return True


__all__ = ["CudaBlockCopier", "PinnedHostBuffer", "PinnedPool"]
