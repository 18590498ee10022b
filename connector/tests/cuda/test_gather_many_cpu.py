"""`BlockCopier.gather_many_to_host` on the CPU build (torch on CPU, no GPU): the same payloads
as one `gather` per chunk, and the same answer to slots that do not come (a stand-in raises
`SlotsBusy`) as the CUDA copier's: a group's chunks from its first without a slot are None,
other groups still try, and a failure gives every buffer back."""

from __future__ import annotations

import random
from typing import Any

import pytest

torch = pytest.importorskip("torch")

import vllm032_kv as vk  # noqa: E402

from kvtier.vllm.blockcopy import host_buffer  # noqa: E402
from kvtier.vllm.blockcopy.copier import BlockCopier  # noqa: E402
from kvtier.vllm.blockcopy.host_buffer import HostBuffer, SlotsBusy  # noqa: E402
from kvtier.vllm.layout import cuda_kv_layout  # noqa: E402

LAYERS, HEADS, BLOCK, HEAD, NUM_BLOCKS = 3, 2, 16, 64, 24


def _copier() -> BlockCopier:
    tensors = vk.allocate_kv_caches(
        "LBNHC",
        num_layers=LAYERS,
        num_blocks=NUM_BLOCKS,
        num_kv_heads=HEADS,
        block_size=BLOCK,
        head_size=HEAD,
        dtype=torch.bfloat16,
        device="cpu",
    )
    for t in tensors:
        bits = t.view(torch.int16)
        bits.copy_(torch.randint(-(2**15), 2**15, bits.shape, dtype=torch.int16))
    layout = cuda_kv_layout(
        backend="FLASH_ATTN",
        cache_layout="LBNHC",
        layer_view_order=vk.layer_view_order("LBNHC"),
        num_heads=HEADS,
        num_states=BLOCK,
        content_elems=2 * HEAD,
        common={
            "dtype": "bfloat16",
            "itemsize": 2,
            "layer_names": tuple(f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)),
            "num_kv_heads": HEADS,
            "head_size": HEAD,
            "block_size": BLOCK,
        },
    )
    return BlockCopier(layout, tensors)


def test_many_chunks_in_one_call_are_the_chunks_gathered_one_by_one() -> None:
    copier = _copier()
    rng = random.Random(3)
    chunks = [rng.sample(range(NUM_BLOCKS), rng.randint(1, 8)) for _ in range(7)]
    bufs = copier.gather_many_to_host(chunks, 0.01, [f"r{i % 2}" for i in range(7)])
    for ids, buf in zip(chunks, bufs, strict=True):
        assert buf is not None and bytes(buf.view()) == copier.gather(ids)
        buf.release()
    assert copier.gather_many_to_host([], 0.01) == []


def test_a_group_without_a_slot_is_dropped_from_there_and_a_failure_gives_all_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    copier = _copier()
    real = copier.gather_to_host
    lent: list[HostBuffer] = []
    busy = {2, 3}  # the calls that find no slot

    def gather_to_host(block_ids: Any, wait_secs: float | None = None) -> HostBuffer:
        calls.append(list(block_ids))
        if len(calls) in busy:
            raise SlotsBusy("no slot")
        if len(calls) == fail_at:
            raise RuntimeError("device lost")
        buf = real(block_ids, wait_secs)
        lent.append(buf)
        return buf

    calls: list[list[int]] = []
    fail_at = 0
    monkeypatch.setattr(copier, "gather_to_host", gather_to_host)
    chunks = [[1], [2], [3], [4], [5], [6]]
    bufs = copier.gather_many_to_host(chunks, 0.01, ["a", "a", "a", "b", "b", "c"])
    # a: [1] saved, [2] no slot, [3] not tried; b: [4] no slot, [5] not tried; c: saved.
    assert [b is not None for b in bufs] == [True, False, False, False, False, True]
    assert calls == [[1], [2], [4], [6]]
    calls.clear()
    busy.clear()
    fail_at = 3
    with pytest.raises(RuntimeError, match="device lost"):
        copier.gather_many_to_host(chunks, 0.01)
    assert len(lent) == 4 and all(b._released for b in lent[2:])  # the two taken before it


def test_the_wait_for_slots_is_one_bound_for_the_whole_call(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`wait_secs` bounds the call, not each chunk: with every slot coming free just in time,
    a bound per chunk would let a step wait the bound once per chunk (measured: 44 ms for a
    32-chunk step with a 5 ms bound)."""
    copier = _copier()
    real = copier.gather_to_host
    now = [100.0]
    waits: list[float | None] = []

    class Clock:
        @staticmethod
        def monotonic() -> float:
            return now[0]

    def gather_to_host(block_ids: Any, wait_secs: float | None = None) -> HostBuffer:
        waits.append(wait_secs)
        now[0] += 0.004  # each slot comes free 4 ms into its wait
        return real(block_ids, wait_secs)

    monkeypatch.setattr(host_buffer, "time", Clock)
    monkeypatch.setattr(copier, "gather_to_host", gather_to_host)
    bufs = copier.gather_many_to_host([[1], [2], [3], [4], [5]], 0.01)
    assert waits == pytest.approx([0.01, 0.006, 0.002, 0.0, 0.0])
    for buf in bufs:
        assert buf is not None
        buf.release()
