"""The Triton kernel of kvtier.vllm.blockcopy.cuda: every layer's pages of a chunk in one launch.

Imported only on CUDA, when Triton is there. One program copies one piece of one run of one
page (layer l, block j), 16-byte vectors where the geometry is 16-byte aligned:
``kv[layer_offsets[l] + block_ids[j] * block_stride + r * run_stride + i]`` <->
``payload[((l * payload_blocks + payload_first + j) * runs + r) * run_words + i]``.
`launch_gather_many`: the pages of several chunks (a step's saves) into one staging buffer in one
launch, each block at the offset its chunk's place in the buffer gives (per-block offsets).
"""

from __future__ import annotations

from typing import Any

import triton
import triton.language as tl

from kvtier.vllm.layout import PageGeometry


def _kv_page_copy(
    kv,
    payload,
    layer_offsets,
    block_ids,
    num_ids,
    payload_blocks,
    payload_first,
    block_stride,
    run_stride,
    run_words,
    runs,
    pieces,
    TO_PAYLOAD: tl.constexpr,
    VEC: tl.constexpr,
    BLOCK: tl.constexpr,
):
    page = tl.program_id(0)
    piece = tl.program_id(1)
    layer = page // num_ids
    j = page - layer * num_ids
    r = piece // pieces
    p = piece - r * pieces
    kv_off = (
        tl.load(layer_offsets + layer)
        + tl.load(block_ids + j) * block_stride
        + r.to(tl.int64) * run_stride
        + p * BLOCK
    )
    kv_off = tl.multiple_of(kv_off, VEC)
    pl_off = ((layer * payload_blocks + payload_first + j).to(tl.int64) * runs + r) * run_words
    pl_off = tl.multiple_of(pl_off + p * BLOCK, VEC)
    idx = tl.arange(0, BLOCK)
    mask = p * BLOCK + idx < run_words
    if TO_PAYLOAD:
        vals = tl.load(kv + kv_off + idx, mask=mask)
        tl.store(payload + pl_off + idx, vals, mask=mask)
    else:
        vals = tl.load(payload + pl_off + idx, mask=mask)
        tl.store(kv + kv_off + idx, vals, mask=mask)


kv_page_copy: Any = triton.jit(
    _kv_page_copy, do_not_specialize=["num_ids", "payload_blocks", "payload_first"]
)


def launch(
    kv: Any,
    payload: Any,
    layer_offsets: Any,
    block_ids: Any,
    *,
    num_layers: int,
    num_ids: int,
    payload_blocks: int,
    payload_first: int,
    geometry: PageGeometry,
    to_payload: bool,
) -> None:
    """One launch on torch's current stream; `kv` and `payload` are word-typed tensors."""
    g = geometry
    block = min(4096, triton.next_power_of_2(g.run_words))
    pieces = triton.cdiv(g.run_words, block)
    grid = (num_layers * num_ids, g.runs * pieces)
    kv_page_copy[grid](
        kv,
        payload,
        layer_offsets,
        block_ids,
        num_ids,
        payload_blocks,
        payload_first,
        g.block_stride,
        g.run_stride,
        g.run_words,
        g.runs,
        pieces,
        TO_PAYLOAD=to_payload,
        VEC=max(1, g.align // g.word),
        BLOCK=block,
        num_warps=4 if block <= 1024 else 8,
    )


def _kv_page_gather_many(
    kv,
    payload,
    layer_offsets,
    block_ids,
    payload_base,
    payload_layer_stride,
    num_ids,
    block_stride,
    run_stride,
    run_words,
    runs,
    pieces,
    VEC: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # Pages of several chunks into one staging buffer: block j (of all the chunks' blocks
    # concatenated) goes to ``payload_base[j] + layer * payload_layer_stride[j]`` (its chunk's
    # offset, its place in the chunk; the chunk's blocks times the page's words).
    page = tl.program_id(0)
    piece = tl.program_id(1)
    layer = page // num_ids
    j = page - layer * num_ids
    r = piece // pieces
    p = piece - r * pieces
    kv_off = (
        tl.load(layer_offsets + layer)
        + tl.load(block_ids + j) * block_stride
        + r.to(tl.int64) * run_stride
        + p * BLOCK
    )
    kv_off = tl.multiple_of(kv_off, VEC)
    pl_off = (
        tl.load(payload_base + j)
        + layer.to(tl.int64) * tl.load(payload_layer_stride + j)
        + r.to(tl.int64) * run_words
        + p * BLOCK
    )
    pl_off = tl.multiple_of(pl_off, VEC)
    idx = tl.arange(0, BLOCK)
    mask = p * BLOCK + idx < run_words
    vals = tl.load(kv + kv_off + idx, mask=mask)
    tl.store(payload + pl_off + idx, vals, mask=mask)


kv_page_gather_many: Any = triton.jit(_kv_page_gather_many, do_not_specialize=["num_ids"])


def launch_gather_many(
    kv: Any,
    payload: Any,
    layer_offsets: Any,
    block_ids: Any,
    payload_base: Any,
    payload_layer_stride: Any,
    *,
    num_layers: int,
    num_ids: int,
    geometry: PageGeometry,
) -> None:
    """One launch on torch's current stream: pages of several chunks (`block_ids`, int64, all
    the chunks' blocks in order) into `payload` at the words `payload_base` and
    `payload_layer_stride` give for each block (int64 tensors, same length)."""
    g = geometry
    block = min(4096, triton.next_power_of_2(g.run_words))
    pieces = triton.cdiv(g.run_words, block)
    grid = (num_layers * num_ids, g.runs * pieces)
    kv_page_gather_many[grid](
        kv,
        payload,
        layer_offsets,
        block_ids,
        payload_base,
        payload_layer_stride,
        num_ids,
        g.block_stride,
        g.run_stride,
        g.run_words,
        g.runs,
        pieces,
        VEC=max(1, g.align // g.word),
        BLOCK=block,
        num_warps=4 if block <= 1024 else 8,
    )
