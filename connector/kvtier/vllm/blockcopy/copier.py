"""Copying whole KV blocks between vLLM's paged buffer and flat chunk payloads in host memory.

The payload of a chunk is ``[layer][block][raw block bytes]`` in the byte order the layout
(kvtier.vllm.layout) names, so a prefix of a chunk's blocks can be read without the rest. On the
CPU build a copy is one ``index_select`` / ``index_copy_`` per layer; CUDA tensors are handed to
kvtier.vllm.blockcopy.cuda (imported only then: the CPU build never imports CUDA code).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterator, Sequence
from typing import Any

from kvtier.vllm.blockcopy.host_buffer import (
    HostBuffer,
    Payload,
    SlotsBusy,
    seconds_left,
    slot_deadline,
)
from kvtier.vllm.layout import KVLayout, LayoutError


class BlockCopier:
    """Copies whole blocks of every layer between vLLM's paged buffer and a flat payload.

    Payload order: layer-major, then block (``[layer][block][raw block bytes]``), so a prefix
    of a chunk's blocks can be read without touching the rest.

    CUDA tensors are handed to kvtier.vllm.blockcopy.cuda (imported only then): one launch gathers
    all layers' blocks on a copy stream, one DMA moves them to a pooled pinned buffer.
    `max_blocks` (blocks of a full chunk) sizes that pool's `pinned_buffers` slots up front;
    without it the pool is sized by the first payload and grows if a larger one comes.
    """

    def __init__(
        self,
        layout: KVLayout,
        tensors: Sequence[Any],
        *,
        max_blocks: int | None = None,
        pinned_buffers: int = 4,
        save_buffers: int | None = None,
        cuda_mode: str = "auto",
        compute_stream: Callable[[], Any] | None = None,
        cuda_staging_bytes: int | None = None,
    ) -> None:
        self.layout = layout
        self.tensors = list(tensors)
        self._cuda: Any = None
        if self.tensors and self.tensors[0].device.type == "cuda":
            from kvtier.vllm.blockcopy.cuda import CudaBlockCopier

            self._cuda = CudaBlockCopier(
                layout,
                self.tensors,
                max_blocks=max_blocks,
                pinned_buffers=pinned_buffers,
                save_buffers=save_buffers,
                mode=cuda_mode,
                compute_stream=compute_stream,
                staging_bytes=cuda_staging_bytes,
            )

    @property
    def copies_in_background(self) -> bool:
        """Whether a gather returns before its copy has landed (CUDA: `HostBuffer.view()`
        waits for it); on CPU the copy is done when `gather_to_host` returns."""
        return self._cuda is not None

    def _gather_cpu(self, block_ids: Sequence[int]) -> Any:
        """`block_ids` of every layer as one uint8 CPU tensor, payload order."""
        import torch

        first = self.tensors[0]
        idx = torch.tensor(list(block_ids), dtype=torch.long, device=first.device)
        # One index_select per layer into a preallocated host buffer: a single memcpy each.
        out = torch.empty(
            (self.layout.num_layers, len(block_ids), *first.shape[1:]),
            dtype=first.dtype,
            device="cpu",
        )
        for i, t in enumerate(self.tensors):
            torch.index_select(t, 0, idx, out=out[i])
        return out.view(torch.uint8)

    def gather(self, block_ids: Sequence[int]) -> bytes:
        """Raw bytes of `block_ids` (in that order) of every layer."""
        if self._cuda is not None:
            raw: bytes = self._cuda.gather_bytes(block_ids)
            return raw
        raw = self._gather_cpu(block_ids).numpy().tobytes()
        return raw

    def gather_to_host(
        self, block_ids: Sequence[int], wait_secs: float | None = None
    ) -> HostBuffer:
        """Like `gather`, without the copy into a `bytes`: the payload stays in a HostBuffer
        (on CUDA a slot of the saves' pinned pool, filled asynchronously: `view()` waits; a
        slot is waited for up to `wait_secs`, then `SlotsBusy`). The caller must `release()`
        it once done with the view (the store must copy what it keeps). The blocks may be
        reused by the compute stream as soon as this returns."""
        if self._cuda is not None:
            buf: HostBuffer = self._cuda.gather_to_host(block_ids, wait_secs)
            return buf
        return HostBuffer(memoryview(self._gather_cpu(block_ids).numpy()).cast("B"))

    def gather_many_to_host(
        self,
        block_id_lists: Sequence[Sequence[int]],
        wait_secs: float | None = None,
        groups: Sequence[Hashable] | None = None,
    ) -> list[HostBuffer | None]:
        """`gather_to_host` for each of a step's chunks, in one call (on CUDA: one copy of the
        block ids, one gather launch per staging buffer's worth of chunks, one DMA per run of
        adjacent slots). A chunk that gets no slot within `wait_secs` of the call is None, and
        so is every later chunk of its group (`groups`: a key per chunk, e.g. its request;
        None: all one group); other chunks still try. Any other failure raises, every buffer
        given back."""
        if self._cuda is not None:
            bufs: list[HostBuffer | None] = self._cuda.gather_many_to_host(
                block_id_lists, wait_secs, groups
            )
            return bufs
        out: list[HostBuffer | None] = []
        busy: set[Hashable] = set()
        deadline = slot_deadline(wait_secs)
        try:
            for i, ids in enumerate(block_id_lists):
                group = groups[i] if groups is not None else None
                if group in busy:
                    out.append(None)
                    continue
                try:
                    out.append(self.gather_to_host(ids, seconds_left(deadline)))
                except SlotsBusy:
                    busy.add(group)
                    out.append(None)
        except BaseException:
            for buf in out:
                if buf is not None:
                    buf.release()
            raise
        return out

    def fence(self) -> Any:
        """A mark of the work queued so far on the compute stream (CUDA; None on CPU), taken
        on vLLM's thread for a load that runs in another thread (`scatter_many`'s ``after``)."""
        return self._cuda.fence() if self._cuda is not None else None

    def gather_iter(
        self, block_id_lists: Sequence[Sequence[int]]
    ) -> Iterator[tuple[int, HostBuffer]]:
        """(index, HostBuffer) for each chunk's block ids, in order, with the next chunks'
        copies already queued (on CUDA up to the pool's slots - 1 ahead: double buffering). The
        caller must release each buffer before asking for the next one."""
        if self._cuda is not None:
            yield from self._cuda.gather_iter(block_id_lists)
            return
        for i, ids in enumerate(block_id_lists):
            yield i, self.gather_to_host(ids)

    def host_buffer(self, nbytes: int) -> HostBuffer:
        """An empty HostBuffer of `nbytes` for a fetched payload (read into `view()`, then pass
        the HostBuffer to `scatter_many`): on CUDA a pinned slot, so the copy to the device is
        one DMA without a bounce through another buffer."""
        if self._cuda is not None:
            buf: HostBuffer = self._cuda.host_buffer(nbytes)
            return buf
        return HostBuffer(memoryview(bytearray(nbytes)))

    def scatter(
        self, payload: Payload, stored_blocks: int, first: int, block_ids: Sequence[int]
    ) -> None:
        """Write blocks ``first .. first+len(block_ids)`` of a payload holding `stored_blocks`
        blocks per layer into `block_ids` of every layer."""
        self.scatter_many([(payload, stored_blocks, first, block_ids)])

    def check_payload(self, payload: Payload, stored_blocks: int) -> None:
        expected = self.layout.payload_nbytes(stored_blocks)
        if len(payload) != expected:
            raise LayoutError(f"payload has {len(payload)} bytes, expected {expected}")

    def scatter_many(
        self,
        items: Sequence[tuple[Payload, int, int, Sequence[int]]],
        *,
        after: Any = None,
        wait: bool = False,
    ) -> None:
        """`scatter` for several (payload, stored_blocks, first, block_ids), copying each
        payload once, straight from the fetched bytes into the KV cache. On CUDA the copies run
        on the copier's stream after the compute stream's work (or after the `fence`
        ``after``); the compute stream waits for them (no host wait), or with ``wait`` the
        call returns only once the blocks are written (a load in a thread of its own: its
        request is reported loaded then). On CPU the copy is done when the call returns."""
        if self._cuda is not None:
            self._cuda.scatter_many(items, after=after, wait=wait)
            return
        import warnings

        import torch

        if not items:
            return
        t0 = self.tensors[0]
        for item, stored_blocks, first, block_ids in items:
            payload = item.view() if isinstance(item, HostBuffer) else item
            self.check_payload(payload, stored_blocks)
            with warnings.catch_warnings():
                # Read-only buffer: torch warns that writing through it would be undefined;
                # it is only read here (one copy, straight into the KV cache).
                warnings.simplefilter("ignore", UserWarning)
                src = torch.frombuffer(payload, dtype=torch.uint8)
            src = src.view(t0.dtype).view(self.layout.num_layers, stored_blocks, *t0.shape[1:])
            part = src[:, first : first + len(block_ids)]
            idx = torch.tensor(list(block_ids), dtype=torch.long, device=t0.device)
            for i, t in enumerate(self.tensors):
                t.index_copy_(0, idx, part[i].to(t.device))

    def close(self) -> None:
        """Give the pinned pool back (CUDA); the copier must not be used afterwards."""
        if self._cuda is not None:
            self._cuda.close()
