"""What one KV block looks like in vLLM's paged buffer, and how whole blocks are copied.

kvtier never interprets KV values: it copies whole blocks as raw bytes. What must match between
writer and reader is therefore the exact byte order of a block, and that goes into the layout
fingerprint (hence into every key), so chunks written under one layout are never read under
another.

In vLLM 0.32 every attention layer's cache, on both builds, is handed to connectors as a
*logical* ``[num_blocks, H, N, C]`` view of one shared allocation (``allocate_kv_cache`` /
``create_kv_cache_views`` in vllm/v1/worker/utils.py and vllm/v1/kv_cache_interface.py):
``H = spec.num_heads`` (the KV heads, or a backend's head slots), ``N = spec.num_states`` (the
block size) and ``C`` = one state's content, i.e. ``[K | V]`` = ``2 * head_size`` elements for
the usual backends. Backends no longer declare ``get_kv_cache_shape``: what differs is the
*physical* order, one ``KVCacheLayout`` (vllm/v1/kv_cache_layout.py) resolved once for the
whole model by the engine core from every backend's ``supported_kv_cache_layouts()`` (or
``VLLM_KV_CACHE_LAYOUT``) and stored in ``KVCacheConfig.kv_cache_layout``:

- CPU build (tested end to end): ``cpu_attn`` supports ``LBHNC`` only, so each layer is one
  contiguous ``[blocks, kv_heads, block_size, 2 * head_size]`` tensor; *inside* a block the
  order also depends on the CPU attention kernel variant (``vec``, ``vec16``, ``amx``, ...: K
  may be stored transposed), which vLLM picks from the dtype, block size, head size and ISA.
- CUDA build: FLASH_ATTN, TRITON_ATTN and FLASHINFER on Hopper declare no preference (any of
  the six layouts; the default is ``LBNHC``), FLEX_ATTENTION ``LBNHC`` only, FLASHINFER on
  Blackwell ``LBHNC``/``BLHNC``. A block's page is stored as its ``[H, N, C]`` in the
  layout's within-block order: ``HND`` (``LBHNC``, ``LHBNC``, ``BLHNC``, ``BHLNC``) or ``NHD``
  (``LBNHC``, ``BLNHC``); where layers and blocks sit around it (layer-major, block-major,
  heads split across blocks) does not change those bytes. The payload keeps the page in that
  order, so the variant is ``HND`` or ``NHD``. The copies (kvtier.vllm.blockcopy.cuda) read the
  strides of the tensors vLLM registers; they are tested on an H200 with torch against views
  built as vLLM 0.32 builds them (connector/tests/cuda), but vLLM's CUDA build itself has not
  run with this connector (no machine here has it): `expected_layout`'s CUDA branch is
  UNTESTED against a live vLLM.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvtier.keys import LayoutFingerprint


class LayoutError(RuntimeError):
    """The KV cache cannot be handled by kvtier (the message says why and what to change)."""


@dataclass(frozen=True)
class KVLayout:
    """Layout of one TP rank's KV cache, identical in the scheduler and in the worker."""

    backend: str  # "cpu_attn", or the CUDA attention backend's name
    variant: str  # CPU kernel ISA ("amx", "vec", "vec16", ...) or the CUDA page order (HND/NHD)
    device: str  # "cpu" or "cuda"
    dtype: str  # e.g. "bfloat16"
    itemsize: int
    layer_names: tuple[str, ...]
    num_kv_heads: int
    head_size: int
    block_size: int
    #: Logical shape of one block of one layer (what ``kv_layer[block_id]`` returns).
    block_shape: tuple[int, ...]
    #: vLLM's resolved KVCacheLayout name (CUDA; e.g. "LBNHC"). Not part of the key: the
    #: page bytes only depend on `variant`, wherever vLLM puts layers and blocks.
    cache_layout: str = ""

    @property
    def num_layers(self) -> int:
        return len(self.layer_names)

    @property
    def block_nbytes(self) -> int:
        """Bytes of one block of one layer."""
        return math.prod(self.block_shape) * self.itemsize

    def payload_nbytes(self, num_blocks: int) -> int:
        """Bytes of a chunk payload holding `num_blocks` blocks of every layer."""
        return self.num_layers * num_blocks * self.block_nbytes

    def kv_layout(self) -> str:
        shape = "x".join(str(d) for d in self.block_shape)
        return f"{self.device}:{self.backend}:{self.variant}:{shape}"

    def fingerprint(
        self,
        model_id: str,
        chunk_size: int,
        tp_rank: int,
        tp_size: int,
        object_chunks: int = 1,
        stage: PipelineStage | None = None,
    ) -> LayoutFingerprint:
        """The fingerprint of this layout's rank ``tp_rank`` of pipeline ``stage`` (its own
        layers; the layout of any stage gives any stage's: they differ in their layers only)."""
        pp = stage if stage is not None and stage.size > 1 else None
        return LayoutFingerprint(
            object_chunks=object_chunks,
            model_id=model_id,
            dtype=self.dtype,
            num_layers=pp.num_layers if pp else self.num_layers,
            num_kv_heads=self.num_kv_heads,
            head_size=self.head_size,
            block_size=self.block_size,
            chunk_size=chunk_size,
            tp_rank=tp_rank,
            tp_size=tp_size,
            kv_layout=self.kv_layout(),
            pp_rank=pp.rank if pp else 0,
            pp_size=pp.size if pp else 1,
            layers=f"{pp.start}-{pp.end}" if pp else "",
        )


@dataclass(frozen=True)
class PipelineStage:
    """One pipeline-parallel stage: it holds the model's layers ``start`` to ``end - 1``."""

    rank: int
    size: int
    start: int
    end: int

    @property
    def num_layers(self) -> int:
        return self.end - self.start


def pipeline_stages(vllm_config: Any) -> tuple[PipelineStage, ...]:
    """Every stage's layers, as vLLM splits them (``get_pp_indices``: even, or
    ``VLLM_PP_LAYER_PARTITION``), computed alike by the scheduler and by every worker."""
    from vllm.distributed.utils import get_pp_indices

    size = int(getattr(vllm_config.parallel_config, "pipeline_parallel_size", 1) or 1)
    total = int(vllm_config.model_config.get_total_num_hidden_layers())
    return tuple(
        PipelineStage(rank, size, *get_pp_indices(total, rank, size)) for rank in range(size)
    )


def check_stage(layout: KVLayout, stage: PipelineStage) -> None:
    """Refuse a stage whose KV cache does not hold exactly the layers vLLM's split gives it:
    its chunks would be keyed with layers it does not hold (fail closed)."""
    from vllm.model_executor.models.utils import extract_layer_index

    try:
        held = sorted(extract_layer_index(name) for name in layout.layer_names)
    except (AssertionError, ValueError) as e:
        held, why = [], f" ({e})"
    else:
        why = ""
    if held != list(range(stage.start, stage.end)):
        raise LayoutError(
            f"kvtier cannot tell which layers pipeline stage {stage.rank} holds: its KV cache "
            f"has layers {list(layout.layer_names)}{why}, vLLM's split gives it layers "
            f"{stage.start} to {stage.end - 1}. Serve with --pipeline-parallel-size 1, or "
            "without kv_transfer_config"
        )


def _natural_key(name: str) -> tuple[Any, ...]:
    # "model.layers.10.self_attn.attn" must sort after "model.layers.9...".
    return tuple(int(p) if p.isdigit() else p for p in name.split("."))


#: vLLM's legacy names for two KVCacheLayout members (vllm/config/cache.py).
_LAYOUT_ALIASES = {"NHD": "LBNHC", "HND": "LBHNC"}


def page_order(layer_view_order: Sequence[int]) -> str:
    """``"HND"`` or ``"NHD"``: the order of a block's ``[H, N, C]`` in memory, from a
    KVCacheLayout's ``layer_view_order`` (physical order of the logical ``[B, H, N, C]`` axes;
    e.g. LBNHC -> ``(0, 2, 1, 3)`` -> ``"NHD"``)."""
    order = tuple(int(d) for d in layer_view_order)
    if sorted(order) != [0, 1, 2, 3] or order[-1] != 3:
        raise LayoutError(f"not a KV cache layer view order (C innermost): {order}")
    inner = [d for d in order if d in (1, 2)]
    return "HND" if inner == [1, 2] else "NHD"


def cuda_kv_layout(
    *,
    backend: str,
    cache_layout: str,
    layer_view_order: Sequence[int],
    num_heads: int,
    num_states: int,
    content_elems: int,
    common: dict[str, Any],
) -> KVLayout:
    """The KVLayout of a CUDA build, from vLLM's resolved KVCacheLayout and the (backend
    customised) KV cache spec: logical block ``[num_heads, num_states, content_elems]``."""
    return KVLayout(
        backend=backend,
        variant=page_order(layer_view_order),
        device="cuda",
        block_shape=(num_heads, num_states, content_elems),
        cache_layout=cache_layout,
        **common,
    )


def _cuda_backend_name(vllm_config: Any, spec: Any, dtype: Any, cache_dtype: str) -> str:
    """The attention backend's name (part of the key: a backend may pack a page its own way,
    e.g. B12X's K and V planes). UNTESTED against vLLM's CUDA build."""
    configured = getattr(vllm_config.attention_config, "backend", None)
    if configured is not None:
        return str(configured.name)
    from vllm.config import set_current_vllm_config
    from vllm.v1.attention.selector import get_attn_backend

    with set_current_vllm_config(vllm_config):
        backend = get_attn_backend(spec.head_size, dtype, cache_dtype)
    return str(backend.get_name())


#: FP8 KV caches kvtier stores on CUDA, by --kv-cache-dtype: the name in the layout (and so in
#: every key). vLLM stores them as uint8 pages; "fp8" is e4m3 on CUDA. Their per-layer scales
#: come from the checkpoint (the model's files are in the key) or are 1.0.
_FP8_ON_CUDA = {"fp8": "fp8_e4m3", "fp8_e4m3": "fp8_e4m3", "fp8_e5m2": "fp8_e5m2"}


def _kv_dtype_name(vllm_config: Any, dtype: Any, cuda: bool) -> str:
    """The KV cache's element type as the layout names it; refused where kvtier cannot
    store it bit for bit."""
    cache_dtype = vllm_config.cache_config.cache_dtype
    model_dtype = str(vllm_config.model_config.dtype).removeprefix("torch.")
    # "auto", or the model's own dtype named explicitly: the KV cache holds the model's dtype.
    if cache_dtype in ("auto", model_dtype) and dtype == vllm_config.model_config.dtype:
        return model_dtype
    if cache_dtype in _FP8_ON_CUDA and cuda:
        return _FP8_ON_CUDA[cache_dtype]
    where = (
        "FP8 KV caches are stored on vLLM's CUDA build only: vLLM's CPU build cannot transfer "
        "FP8 KV"
        if cache_dtype in _FP8_ON_CUDA
        else f"kvtier stores a KV cache of the model's dtype ({model_dtype})"
        + (f" or of {', '.join(sorted(_FP8_ON_CUDA))} on CUDA" if cuda else "")
    )
    raise LayoutError(
        f"kvtier does not support kv_cache_dtype {cache_dtype!r} here (set by "
        "--kv-cache-dtype, or resolved by vLLM from the checkpoint's quantization config, as "
        f"for FP8 checkpoints): {where}. Serve with --kv-cache-dtype {model_dtype}, or without "
        "kv_transfer_config"
    )


def expected_layout(vllm_config: Any, kv_cache_config: Any) -> KVLayout:
    """The layout vLLM will use, computed from the configuration alone.

    The scheduler needs it before any worker exists (it is part of every lookup key); the
    worker checks the tensors it is given against it.
    """
    import torch
    from vllm.platforms import current_platform
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec

    groups = kv_cache_config.kv_cache_groups
    # MLAAttentionSpec subclasses FullAttentionSpec in vLLM 0.32: refuse it by name.
    spec0 = groups[0].kv_cache_spec if len(groups) == 1 else None
    if (
        spec0 is None
        or not isinstance(spec0, FullAttentionSpec)
        or isinstance(spec0, MLAAttentionSpec)
    ):
        raise LayoutError(
            "kvtier supports models with one full-attention KV cache group; this model has "
            f"{[type(g.kv_cache_spec).__name__ for g in groups]} (hybrid, sliding-window-only "
            "or MLA models are not supported: remove kv_transfer_config for this model)"
        )
    spec = groups[0].kv_cache_spec
    if getattr(spec, "non_causal", False):
        raise LayoutError(
            "kvtier does not support models with non-causal attention (prefix LM): a token's "
            "KV then depends on tokens after it, so a stored prefix is not reusable (vLLM turns "
            "its own prefix caching off for them too). Serve this model without "
            "kv_transfer_config"
        )
    dtype: torch.dtype = spec.dtype
    dtype_name = _kv_dtype_name(vllm_config, dtype, current_platform.is_cuda())
    cache_dtype = vllm_config.cache_config.cache_dtype
    itemsize = torch.empty((), dtype=dtype).element_size()
    common: dict[str, Any] = {
        "dtype": dtype_name,
        "itemsize": itemsize,
        "layer_names": tuple(sorted(groups[0].layer_names, key=_natural_key)),
        "num_kv_heads": spec.num_kv_heads,
        "head_size": spec.head_size,
        "block_size": spec.block_size,
    }
    if current_platform.is_cpu():
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        isa = _get_attn_isa(dtype, spec.block_size, spec.head_size, cache_dtype)
        return KVLayout(
            backend="cpu_attn",
            variant=isa,
            device="cpu",
            block_shape=(spec.num_kv_heads, spec.block_size, 2 * spec.head_size),
            **common,
        )
    if current_platform.is_cuda():  # UNTESTED against vLLM's CUDA build (no such machine here)
        from vllm.v1.kv_cache_layout import KVCacheLayout

        name = getattr(kv_cache_config, "kv_cache_layout", None)
        name = name or vllm_config.cache_config.kv_cache_layout
        if name is None:
            raise LayoutError(
                "vLLM has not resolved its KV cache layout (KVCacheConfig.kv_cache_layout is "
                "unset): kvtier needs vLLM 0.32's engine core to resolve it first"
            )
        cache_layout = KVCacheLayout[_LAYOUT_ALIASES.get(name, name)]
        content = spec.state_content_size_bytes
        if content % itemsize or getattr(spec, "tokens_per_state", 1) != 1:
            raise LayoutError(
                f"kvtier cannot copy this KV cache spec ({type(spec).__name__}: "
                f"{content} content bytes per state, tokens_per_state="
                f"{getattr(spec, 'tokens_per_state', 1)})"
            )
        return cuda_kv_layout(
            backend=_cuda_backend_name(vllm_config, spec, dtype, cache_dtype),
            cache_layout=cache_layout.name,
            layer_view_order=cache_layout.layer_view_order,
            num_heads=spec.num_heads,
            num_states=spec.num_states,
            content_elems=content // itemsize,
            common=common,
        )
    raise LayoutError(
        f"kvtier supports the CPU and CUDA builds of vLLM, not platform "
        f"{current_platform.device_name!r}"
    )


@dataclass(frozen=True)
class PageGeometry:
    """Where the pages (one block of one layer) of a paged KV cache lie, in `word`-byte units
    relative to the first layer's storage: page of layer l, block b = `runs` runs of
    `run_words` words at ``layer_offsets[l] + b * block_stride + r * run_stride``. The payload
    holds each page as those runs in order (the block's ``[H, N, C]`` in memory order)."""

    word: int
    layer_offsets: tuple[int, ...]
    block_stride: int
    run_stride: int
    run_words: int
    runs: int
    #: Permutation of the logical dims (1, 2, 3) into memory order (for torch's own ops).
    inner_order: tuple[int, ...]
    #: Largest power of two <= 16 dividing every byte offset, stride and run length.
    align: int

    @property
    def page_words(self) -> int:
        return self.runs * self.run_words


def page_geometry(
    shape: Sequence[int],
    strides: Sequence[Sequence[int]],
    byte_addresses: Sequence[int],
    itemsize: int,
    base_address: int,
) -> PageGeometry:
    """The PageGeometry of per-layer ``[B, H, N, C]`` views with these element strides and data
    addresses (`base_address`: where offsets count from). Pure arithmetic: no torch."""
    if len(shape) != 4:
        raise LayoutError(f"KV cache views must be [blocks, H, N, C], got shape {tuple(shape)}")
    if any(tuple(s) != tuple(strides[0]) for s in strides):
        raise LayoutError("the layers' KV cache views have different strides")
    st = [int(x) for x in strides[0]]
    size = [int(x) for x in shape]
    if size[3] > 1 and st[3] != 1:
        raise LayoutError(f"the content dim of the KV cache is not contiguous (strides {st})")
    # Memory order of the block's dims: size-1 dims first (their stride is meaningless).
    inner = sorted((1, 2, 3), key=lambda d: (1, -st[d]) if size[d] > 1 else (0, 0))
    run = 1
    outer: list[int] = []
    for d in reversed(inner):
        if size[d] == 1:
            continue
        if not outer and st[d] == run:
            run *= size[d]
        else:
            outer.append(d)
    if len(outer) > 1:
        raise LayoutError(f"kvtier cannot copy blocks with strides {st} (shape {size})")
    runs = size[outer[0]] if outer else 1
    run_stride = st[outer[0]] if outer else run
    byte_quantities = [
        *(a - base_address for a in byte_addresses),
        st[0] * itemsize,
        run_stride * itemsize,
        run * itemsize,
        base_address,
    ]
    g = 0
    for q in byte_quantities:
        g = math.gcd(g, q)
    align = 16
    while align > 1 and g % align:
        align //= 2
    word = min(align, 4)
    return PageGeometry(
        word=word,
        layer_offsets=tuple((a - base_address) // word for a in byte_addresses),
        block_stride=st[0] * itemsize // word,
        run_stride=run_stride * itemsize // word,
        run_words=run * itemsize // word,
        runs=runs,
        inner_order=tuple(inner),
        align=align,
    )


def check_tensors(layout: KVLayout, kv_caches: dict[str, Any]) -> list[Any]:
    """The per-layer tensors in `layout.layer_names` order, after checking their shapes (and,
    on CUDA, that their strides give the page order the layout names)."""
    missing = [n for n in layout.layer_names if n not in kv_caches]
    if missing:
        raise LayoutError(f"vLLM registered no KV cache for layers {missing}")
    tensors = [kv_caches[n] for n in layout.layer_names]
    for name, t in zip(layout.layer_names, tensors, strict=True):
        block_shape = tuple(int(d) for d in t.shape[1:])
        if layout.device == "cpu" and block_shape != layout.block_shape:
            raise LayoutError(
                f"KV cache of {name} has blocks of shape {block_shape}, expected "
                f"{layout.block_shape} for {layout.kv_layout()}: this vLLM build lays out "
                "its CPU KV cache differently than kvtier expects"
            )
        if layout.device == "cuda" and block_shape != layout.block_shape:
            raise LayoutError(
                f"KV cache of {name} has blocks of shape {block_shape}, expected "
                f"{layout.block_shape} for {layout.kv_layout()} (a kernel block size smaller "
                "than --block-size splits blocks, which kvtier does not support: set "
                "--block-size to one the attention backend takes)"
            )
        if math.prod(block_shape) * t.element_size() != layout.block_nbytes:
            raise LayoutError(
                f"KV cache of {name}: {math.prod(block_shape) * t.element_size()} bytes per "
                f"block, expected {layout.block_nbytes} ({layout.kv_layout()})"
            )
    if layout.device == "cuda":
        geometry = page_geometry(
            tensors[0].shape,
            [t.stride() for t in tensors],
            [t.data_ptr() for t in tensors],
            tensors[0].element_size(),
            tensors[0].data_ptr(),
        )
        order = "".join("HNC"[d - 1] for d in geometry.inner_order)
        found = "NHD" if order.index("N") < order.index("H") else "HND"
        if found != layout.variant and layout.block_shape[0] > 1 and layout.block_shape[1] > 1:
            raise LayoutError(
                f"the KV cache vLLM registered stores blocks in {found} order, but its "
                f"configured layout {layout.cache_layout or '?'} means {layout.variant}"
            )
    return tensors
