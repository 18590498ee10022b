"""The connector's CUDA data path (kvtier.vllm.blockcopy.cuda) on KV caches laid out exactly as
vLLM 0.32 allocates them and registers them with connectors: one int8 buffer, per-layer
logical ``[blocks, kv_heads, block_size, 2 * head_size]`` bf16 views whose strides follow the
resolved KVCacheLayout. vLLM is not on the GPU machine, so the views come from the vendored
copy of its allocation code (vllm032_kv.py, checked against vLLM by test_vllm032_fixture.py).

Every layout each CUDA backend can be given (FLASH_ATTN / TRITON_ATTN / FLASHINFER on Hopper:
all six, LBNHC = NHD by default, LBHNC = HND with VLLM_KV_CACHE_LAYOUT=HND; FLEX_ATTENTION:
LBNHC), both copy modes (one Triton launch; torch's own ops), random bits (NaN patterns too)
compared as int16: bit-exact round trips, partial scatters, untouched blocks, stream ordering
without host syncs, the pinned pool. Needs a CUDA GPU and torch, so CI skips it; run on the
device machine: ``PYTHONPATH=connector python -m pytest connector/tests/cuda -q``.
"""

from __future__ import annotations

import ctypes
import random
import threading
import time

import pytest

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

import vllm032_kv as vk  # noqa: E402

from kvtier.vllm.blockcopy import pinned  # noqa: E402
from kvtier.vllm.blockcopy.copier import BlockCopier  # noqa: E402
from kvtier.vllm.layout import (  # noqa: E402
    KVLayout,
    LayoutError,
    check_tensors,
    cuda_kv_layout,
)

MODES = ["triton", "torch"]
CASES = [
    pytest.param(b, lay, id=f"{b}-{lay}{'(default)' if lay == vk.resolved_layout(b) else ''}")
    for b in vk.BACKEND_LAYOUTS
    for lay in vk.backend_layouts(b)
]
LAYERS, HEADS, BLOCK, HEAD, NUM_BLOCKS = 4, 4, 16, 128, 64


def _caches(
    cache_layout: str, backend: str = "FLASH_ATTN", dtype: object = None
) -> tuple[KVLayout, list[object]]:
    """KV caches as vLLM 0.32 registers them, random bits; bf16, or ``torch.uint8`` pages as
    vLLM allocates them for ``--kv-cache-dtype fp8`` (the layout then names fp8_e4m3)."""
    fp8 = dtype == torch.uint8
    tensors = vk.allocate_kv_caches(
        cache_layout,
        num_layers=LAYERS,
        num_blocks=NUM_BLOCKS,
        num_kv_heads=HEADS,
        block_size=BLOCK,
        head_size=HEAD,
        dtype=dtype or torch.bfloat16,
        device="cuda",
    )
    for t in tensors:  # every bit pattern, NaNs included: compared as int16, never as floats
        bits = t.view(torch.int16)
        bits.copy_(torch.randint(-(2**15), 2**15, bits.shape, dtype=torch.int16, device="cuda"))
    layout = cuda_kv_layout(
        backend=backend,
        cache_layout=cache_layout,
        layer_view_order=vk.layer_view_order(cache_layout),
        num_heads=HEADS,
        num_states=BLOCK,
        content_elems=2 * HEAD,
        common={
            "dtype": "fp8_e4m3" if fp8 else "bfloat16",
            "itemsize": 1 if fp8 else 2,
            "layer_names": tuple(f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)),
            "num_kv_heads": HEADS,
            "head_size": HEAD,
            "block_size": BLOCK,
        },
    )
    return layout, check_tensors(layout, dict(zip(layout.layer_names, tensors, strict=True)))


def _bits(t: object) -> object:
    return t.view(torch.int16)


def _reference(tensors: list[object], ids: list[int], variant: str) -> bytes:
    pages = [t[ids] if variant == "HND" else t[ids].permute(0, 2, 1, 3) for t in tensors]
    return b"".join(p.contiguous().cpu().view(torch.uint8).numpy().tobytes() for p in pages)


def _assert_moved(
    src: list[object], ids: list[int], dst: list[object], before: list[object], target: list[int]
) -> None:
    keep = [b for b in range(NUM_BLOCKS) if b not in target]
    for s, d, b in zip(src, dst, before, strict=True):
        assert torch.equal(_bits(s[ids]), _bits(d[target]))
        assert torch.equal(_bits(d[keep]), _bits(b[keep]))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(("backend", "cache_layout"), CASES)
def test_round_trip_is_bit_exact(mode: str, backend: str, cache_layout: str) -> None:
    layout, src = _caches(cache_layout, backend)
    _, dst = _caches(cache_layout, backend)
    before = [d.clone() for d in dst]
    rng = random.Random(f"{backend}{cache_layout}{mode}")
    ids = rng.sample(range(NUM_BLOCKS), 16)
    target = rng.sample(range(NUM_BLOCKS), 16)
    copier = BlockCopier(layout, src, max_blocks=16, cuda_mode=mode)
    assert copier._cuda.mode == mode
    with copier.gather_to_host(ids) as buf:
        payload = bytes(buf.view())
    assert len(payload) == layout.payload_nbytes(16)
    assert payload == _reference(src, ids, layout.variant)
    back = BlockCopier(layout, dst, max_blocks=16, cuda_mode=mode)
    back.scatter(payload, 16, 0, target)  # no host sync: the current stream waits for it
    _assert_moved(src, ids, dst, before, target)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("cache_layout", ["LBNHC", "LBHNC", "BHLNC"])
def test_partial_scatter_writes_only_those_blocks(mode: str, cache_layout: str) -> None:
    layout, src = _caches(cache_layout)
    _, dst = _caches(cache_layout)
    before = [d.clone() for d in dst]
    ids = [9, 2, 40, 33, 17, 5, 60, 1]
    payload = BlockCopier(layout, src, cuda_mode=mode).gather(ids)
    BlockCopier(layout, dst, cuda_mode=mode).scatter(payload, 8, 3, [50, 51, 52])
    _assert_moved(src, ids[3:6], dst, before, [50, 51, 52])


@pytest.mark.parametrize("mode", MODES)
def test_every_payload_kind_scatters_the_same(mode: str) -> None:
    layout, src = _caches("LBNHC")
    ids = [3, 14, 15, 9, 26, 53]
    original = [t[ids].clone() for t in src]
    copier = BlockCopier(layout, src, max_blocks=8, cuda_mode=mode)
    raw = copier.gather(ids)
    pinned = copier.host_buffer(len(raw))
    pinned.view()[:] = raw
    gathered = copier.gather_to_host(ids)
    _, other = _caches("LBNHC")
    foreign = BlockCopier(layout, other, max_blocks=8, cuda_mode=mode).host_buffer(len(raw))
    foreign.view()[:] = raw
    kinds = {
        "bytes": raw,
        "memoryview": memoryview(raw),
        "bytearray": memoryview(bytearray(raw)),
        "pinned HostBuffer": pinned,
        "view of a pinned slot": pinned.view(),
        "gathered HostBuffer": gathered,
        "another copier's HostBuffer": foreign,
    }
    free = [b for b in range(NUM_BLOCKS) if b not in ids]
    for i, (kind, payload) in enumerate(kinds.items()):
        target = free[6 * i : 6 * i + 6]
        keep = [b for b in range(NUM_BLOCKS) if b not in target]
        before = [t[keep].clone() for t in src]
        copier.scatter(payload, 6, 0, target)  # into the same cache, other blocks
        for t, o, b in zip(src, original, before, strict=True):
            assert torch.equal(_bits(t[target]), _bits(o)), kind
            assert torch.equal(_bits(t[keep]), _bits(b)), kind
    for buf in (pinned, gathered, foreign):
        buf.release()
    with pytest.raises(LayoutError, match="after release"):
        pinned.view()


def test_gather_waits_for_the_current_stream_and_guards_the_blocks() -> None:
    layout, src = _caches("LBNHC")
    ids = [4, 8, 15, 16, 23, 42]
    copier = BlockCopier(layout, src, max_blocks=8)
    new = [torch.randint_like(_bits(t), -(2**15), 2**15) for t in src]
    expected = _reference([n.view(torch.bfloat16) for n in new], ids, layout.variant)
    torch.cuda._sleep(100_000_000)  # the current stream is busy for a while ...
    for t, n in zip(src, new, strict=True):
        _bits(t).copy_(n)  # ... then writes the blocks: the gather must see these values
    buf = copier.gather_to_host(ids)
    for t in src:
        t.zero_()  # queued after the gather: must not reach the payload
    assert bytes(buf.view()) == expected
    buf.release()


def test_scatter_is_visible_to_the_current_stream_without_a_host_sync() -> None:
    layout, src = _caches("LBHNC")
    _, dst = _caches("LBHNC")
    ids, target = [1, 2, 3, 4], [10, 20, 30, 40]
    payload = BlockCopier(layout, src).gather(ids)
    back = BlockCopier(layout, dst, max_blocks=4)
    with torch.cuda.stream(back._cuda.stream):
        torch.cuda._sleep(200_000_000)  # the copy stream is late ...
    back.scatter(payload, 4, 0, target)
    sums = [_bits(d[target]).to(torch.int64).sum() for d in dst]  # ... current stream reads
    assert [int(s) for s in sums] == [int(_bits(s[ids]).to(torch.int64).sum()) for s in src]


def test_pool_is_allocated_once_and_reused() -> None:
    layout, src = _caches("LBNHC")
    _, dst = _caches("LBNHC")
    copier = BlockCopier(layout, src, max_blocks=16, pinned_buffers=2)
    back = BlockCopier(layout, dst, max_blocks=16, pinned_buffers=2)
    pool = copier._cuda.pool
    assert pool.slot_bytes == layout.payload_nbytes(16) and pool.slots == 2
    rng = random.Random(7)
    for _ in range(20):
        n = rng.randint(1, 16)
        ids = rng.sample(range(NUM_BLOCKS), n)
        before = [d.clone() for d in dst]
        with copier.gather_to_host(ids) as buf:
            back.scatter(buf, n, 0, ids)
        _assert_moved(src, ids, dst, before, ids)
    assert copier._cuda.pool is pool and back._cuda.pool.slots == 2
    # Without max_blocks the pool is sized by the first payload and grows once for a larger.
    lazy = BlockCopier(layout, src)
    lazy.gather([1])
    small = lazy._cuda.save_pool
    assert lazy.gather(list(range(16))) == _reference(src, list(range(16)), layout.variant)
    assert lazy._cuda.save_pool is not small
    assert lazy._cuda.save_pool.slot_bytes == pool.slot_bytes


def test_an_exhausted_pool_fails_the_copy_instead_of_allocating(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(pinned, "POOL_WAIT_SECS", 0.2)
    layout, src = _caches("LBNHC")
    copier = BlockCopier(layout, src, max_blocks=4, pinned_buffers=2)
    held = [copier.gather_to_host([1, 2]), copier.gather_to_host([3, 4])]
    with pytest.raises(LayoutError, match="pinned buffers"):
        copier.gather_to_host([5, 6])
    held[0].release()
    with copier.gather_to_host([5, 6]) as buf:
        assert bytes(buf.view()) == _reference(src, [5, 6], layout.variant)
    held[1].release()


def test_gather_iter_streams_chunks_in_order() -> None:
    layout, src = _caches("LBNHC")
    copier = BlockCopier(layout, src, max_blocks=16, pinned_buffers=3)
    rng = random.Random(11)
    chunks = [rng.sample(range(NUM_BLOCKS), rng.randint(1, 16)) for _ in range(9)]
    seen = []
    for i, buf in copier.gather_iter(chunks):
        assert bytes(buf.view()) == _reference(src, chunks[i], layout.variant)
        buf.release()
        seen.append(i)
    assert seen == list(range(9))
    it = copier.gather_iter(chunks)
    _, first = next(it)
    first.release()
    it.close()  # stopped early: the queued slots come back
    held = [copier.host_buffer(16) for _ in range(3)]
    for buf in held:
        buf.release()


def test_a_background_load_returns_once_its_blocks_are_written() -> None:
    """vLLM computes on a stream of its own; a background load runs in another thread and
    its request is reported as soon as the call returns: the blocks must hold the payload
    then, even with the copy stream busy (a save in flight)."""
    layout, src = _caches("LBNHC")
    _, dst = _caches("LBNHC")
    ids, target = [3, 5, 7, 9], [11, 13, 17, 19]
    payload = BlockCopier(layout, src).gather(ids)
    compute = torch.cuda.Stream()
    back = BlockCopier(layout, dst, max_blocks=4, compute_stream=lambda: compute)
    fence = back.fence()
    with torch.cuda.stream(back._cuda.stream):
        torch.cuda._sleep(200_000_000)  # the copy stream is late
    done = threading.Event()

    def load() -> None:
        back.scatter_many([(payload, 4, 0, target)], after=fence, wait=True)
        done.set()

    threading.Thread(target=load).start()
    assert done.wait(30)
    with torch.cuda.stream(compute):  # read at once on the compute stream, no host sync
        sums = [int(_bits(d[target]).to(torch.int64).sum()) for d in dst]
    assert sums == [int(_bits(s[ids]).to(torch.int64).sum()) for s in src]


def test_an_fp8_kv_cache_round_trips_bit_exact() -> None:
    """--kv-cache-dtype fp8: vLLM allocates uint8 pages; every bit pattern comes back."""
    layout, src = _caches("LBNHC", dtype=torch.uint8)
    _, dst = _caches("LBNHC", dtype=torch.uint8)
    assert layout.dtype == "fp8_e4m3"
    ids, target = [2, 4, 6], [40, 41, 42]
    before = [d.clone() for d in dst]
    BlockCopier(layout, dst).scatter(BlockCopier(layout, src).gather(ids), 3, 0, target)
    torch.cuda.synchronize()
    _assert_moved(src, ids, dst, before, target)


# ---------------------------------------------------------------- a step's saves in one call
@pytest.mark.parametrize("staging_slots", [1, 3, None])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(("backend", "cache_layout"), CASES)
def test_gather_many_round_trips_chunks_of_any_length_bit_exact(
    mode: str, backend: str, cache_layout: str, staging_slots: int | None
) -> None:
    """A step's chunks (1 to 16 blocks each) in one call: each slot holds exactly its chunk's
    payload, also with the slots scattered over the pool (runs of adjacent slots and gaps) and
    with fewer staging places than chunks (several launches)."""
    layout, src = _caches(cache_layout, backend)
    slot = layout.payload_nbytes(16)
    copier = BlockCopier(
        layout,
        src,
        max_blocks=16,
        save_buffers=14,
        cuda_mode=mode,
        cuda_staging_bytes=None if staging_slots is None else staging_slots * slot,
    )
    rng = random.Random(f"{backend}{cache_layout}{mode}{staging_slots}")
    # Hold every third slot so that the call's slots come in runs with gaps between them.
    held = [copier.gather_to_host([0]) for _ in range(14)]
    for k, buf in enumerate(held):
        if k % 3:
            buf.release()
    held = [b for k, b in enumerate(held) if not k % 3]
    chunks = [rng.sample(range(NUM_BLOCKS), rng.choice([1, 5, 16, 16])) for _ in range(9)]
    bufs = copier.gather_many_to_host(chunks, 1.0)
    assert all(b is not None for b in bufs)
    assert len({b.slot for b in bufs}) == 9
    for ids, buf in zip(chunks, bufs, strict=True):
        assert len(buf) == layout.payload_nbytes(len(ids))
        assert bytes(buf.view()) == _reference(src, ids, layout.variant)
    # Back through a scatter into another cache: bit-exact.
    _, dst = _caches(cache_layout, backend)
    back = BlockCopier(layout, dst, max_blocks=16, cuda_mode=mode)
    for ids, buf in zip(chunks, bufs, strict=True):
        target = rng.sample(range(NUM_BLOCKS), len(ids))
        back.scatter(buf, len(ids), 0, target)
        for s, d in zip(src, dst, strict=True):
            assert torch.equal(_bits(s[ids]), _bits(d[target]))
    for buf in [*bufs, *held]:
        buf.release()


def test_gather_many_reuses_the_slots_step_after_step() -> None:
    layout, src = _caches("LBHNC")
    copier = BlockCopier(layout, src, max_blocks=16, save_buffers=8)
    pool = copier._cuda.save_pool
    rng = random.Random(21)
    for step in range(25):
        chunks = [
            rng.sample(range(NUM_BLOCKS), rng.randint(1, 16)) for _ in range(rng.randint(1, 8))
        ]
        bufs = copier.gather_many_to_host(chunks, 1.0)
        order = list(range(len(bufs)))
        rng.shuffle(order)  # the store gives them back in any order
        for i in order:
            assert bytes(bufs[i].view()) == _reference(src, chunks[i], layout.variant), step
            bufs[i].release()
    assert copier._cuda.save_pool is pool and len(pool._free) == 8


def test_gather_many_with_no_slot_drops_the_rest_of_that_group_only() -> None:
    layout, src = _caches("LBNHC")
    copier = BlockCopier(layout, src, max_blocks=4, save_buffers=3)
    chunks = [[1, 2], [3, 4], [5, 6], [7, 8], [9, 10], [11, 12]]
    groups = ["a", "a", "a", "a", "b", "a"]
    bufs = copier.gather_many_to_host(chunks, 0.05, groups)
    assert [b is not None for b in bufs] == [True, True, True, False, False, False]
    for ids, buf in zip(chunks, bufs, strict=True):
        if buf is not None:
            assert bytes(buf.view()) == _reference(src, ids, layout.variant)
    bufs[0].release()
    # One slot free: "a" gets it; "b" waits its bound and gets none; "c" neither.
    again = copier.gather_many_to_host([[1], [2], [3]], 0.05, ["a", "b", "c"])
    assert [b is not None for b in again] == [True, False, False]
    again[0].release()
    # No groups: the call's chunks are one group, the first without a slot ends it.
    bufs[1].release()
    one = copier.gather_many_to_host([[1], [2], [3], [4]], 0.05)
    assert [b is not None for b in one] == [True, True, False, False]
    for buf in [one[0], one[1], bufs[2]]:
        buf.release()
    assert copier.gather_many_to_host([], 0.05) == []
    assert len(copier._cuda.save_pool._free) == 3


def test_gather_many_waits_for_slots_at_most_its_bound_in_all() -> None:
    """Slots coming free one by one every 40 ms: a call bounded to 100 ms gets at most the
    ones freed within those 100 ms, not one slot per 100 ms (the bound is for the call)."""
    layout, src = _caches("LBNHC")
    copier = BlockCopier(layout, src, max_blocks=4, save_buffers=8)
    held = copier.gather_many_to_host([[i] for i in range(8)], 0.05)
    assert all(b is not None for b in held)

    def give_back() -> None:
        for buf in held:
            time.sleep(0.04)
            buf.release()  # type: ignore[union-attr]

    releaser = threading.Thread(target=give_back)
    releaser.start()
    bufs = copier.gather_many_to_host([[i] for i in range(8)], 0.1)
    releaser.join()
    got = [b for b in bufs if b is not None]
    assert 1 <= len(got) <= 3, [b is not None for b in bufs]
    for buf in got:
        buf.release()


def test_gather_many_waits_for_the_compute_stream_and_guards_the_blocks() -> None:
    """Ordered as gather_to_host: after the work vLLM queued on its own compute stream (the
    blocks' new values), and before that stream's later kernels (which overwrite them)."""
    layout, src = _caches("LBNHC")
    compute = torch.cuda.Stream()
    slot = layout.payload_nbytes(8)
    copier = BlockCopier(
        layout,
        src,
        max_blocks=8,
        save_buffers=8,
        compute_stream=lambda: compute,
        cuda_staging_bytes=2 * slot,  # several launches: every one before the overwrite
    )
    rng = random.Random(5)
    chunks = [rng.sample(range(NUM_BLOCKS), rng.randint(1, 8)) for _ in range(6)]
    new = [torch.randint_like(_bits(t), -(2**15), 2**15) for t in src]
    with torch.cuda.stream(compute):
        torch.cuda._sleep(100_000_000)  # the compute stream is busy for a while ...
        for t, n in zip(src, new, strict=True):
            _bits(t).copy_(n)  # ... then writes the blocks: the gathers must see these
    bufs = copier.gather_many_to_host(chunks, 1.0)
    with torch.cuda.stream(compute):
        for t in src:
            t.zero_()  # queued after the gathers: must not reach the payloads
    fresh = [n.view(torch.bfloat16) for n in new]
    for ids, buf in zip(chunks, bufs, strict=True):
        assert bytes(buf.view()) == _reference(fresh, ids, layout.variant)
        buf.release()


def test_gather_many_of_an_fp8_kv_cache_is_bit_exact() -> None:
    layout, src = _caches("LBNHC", dtype=torch.uint8)
    copier = BlockCopier(layout, src, max_blocks=4, save_buffers=4)
    chunks = [[2, 4, 6], [1], [8, 9, 10, 11]]
    bufs = copier.gather_many_to_host(chunks, 1.0)
    for ids, buf in zip(chunks, bufs, strict=True):
        assert bytes(buf.view()) == _reference(src, ids, layout.variant)
        buf.release()


def test_a_load_from_the_pinned_cpu_slab_needs_no_bounce_and_holds_its_slot() -> None:
    """The connector's CPU tier (a slab pinned by pin_host_region): a chunk read from it is
    copied to the device from where it lies (no bounce slot taken), bit-exact, and its slot
    stays leased until the copy has read it, even with the reader's references gone and the
    chunk evicted: a save that lands in the freed slot must not reach the blocks."""
    from kvtier.tiers.base import TierError
    from kvtier.tiers.cpu import CpuSlabTier

    layout, src = _caches("LBNHC")
    _, dst = _caches("LBNHC")
    ids, target = [4, 8, 15, 16, 23, 42], [1, 2, 3, 5, 6, 7]
    payload = BlockCopier(layout, src).gather(ids)
    tier = CpuSlabTier(len(payload), len(payload), pinned.pin_host_region)
    assert pinned.in_pinned_region(tier._base, len(payload))
    tier.put("a", b"", payload)
    copier = BlockCopier(layout, dst, max_blocks=6)
    got = tier.get("a")
    assert got is not None
    free_before = list(copier._cuda.pool._free)
    with torch.cuda.stream(copier._cuda.stream):
        torch.cuda._sleep(200_000_000)  # the copy stream is late: the DMA has not read yet
    copier.scatter(got[1], 6, 0, target)
    assert copier._cuda.pool._free == free_before  # no bounce slot was taken
    del got
    with pytest.raises(TierError) as err:  # evicts a, but its one slot is still being read
        tier.put("b", b"", b"\0" * len(payload))
    assert err.value.cause == "slots_leased" and not tier.contains("a")
    torch.cuda.current_stream().synchronize()
    for s, d in zip(src, dst, strict=True):
        assert torch.equal(_bits(s[ids]), _bits(d[target]))
    copier.scatter(payload, 6, 0, target)  # a later call lets go of what has landed
    tier.put("b", b"", b"\0" * len(payload))  # the slot is free again
    copier.close()
    tier.close()
    assert not pinned.in_pinned_region(tier._base, len(payload))


def test_a_pin_that_fails_leaves_no_error_for_the_next_kernel() -> None:
    """A failed cudaHostRegister (here: the region is pinned already) is logged and the region
    served unpinned; the runtime error it left must not surface in the next kernel launch on
    this thread, where torch would raise it as its own (vLLM PR #50070)."""
    import mmap

    mem = mmap.mmap(-1, 1 << 20)
    address = ctypes.addressof((ctypes.c_char * (1 << 20)).from_buffer(mem))
    unpin = pinned.pin_host_region(address, 1 << 20)
    assert unpin is not None
    assert pinned.pin_host_region(address, 1 << 20) is None  # already registered: refused
    x = torch.ones(1024, device="cuda")
    assert int((x * 2).sum().item()) == 2048  # no stale error raised here
    unpin()
    assert not pinned.in_pinned_region(address, 1 << 20)
