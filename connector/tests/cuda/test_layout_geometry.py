"""The CUDA layout logic of kvtier.vllm.layout, without a GPU: torch (CPU) only, vLLM 0.32's
KV cache views built by the vendored copy of its allocation code (vllm032_kv.py).

- every KVCacheLayout gives the page order (HND/NHD) FlashInfer's names say;
- `page_geometry` read off those views, replayed run by run in Python on the raw buffer (what
  the Triton kernel does), gives each block's pages in that order, for each backend's layouts;
- `check_tensors` takes vLLM's views and refuses a mismatched order or a split block;
- the CPU BlockCopier's HostBuffer API returns the bytes `gather` returns.

Skipped where torch is missing (the CI tool venv may not have it).
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import vllm032_kv as vk  # noqa: E402

from kvtier.vllm import layout as kvl  # noqa: E402
from kvtier.vllm.blockcopy.copier import BlockCopier  # noqa: E402

ALL = [(b, lay) for b in vk.BACKEND_LAYOUTS for lay in vk.backend_layouts(b)]
SHAPES = {"gqa": (3, 4, 16, 64), "one_head": (2, 1, 16, 32)}  # layers, kv heads, block, head


def _layout(cache_layout: str, layers: int, heads: int, block: int, head: int) -> kvl.KVLayout:
    return kvl.cuda_kv_layout(
        backend="FLASH_ATTN",
        cache_layout=cache_layout,
        layer_view_order=vk.layer_view_order(cache_layout),
        num_heads=heads,
        num_states=block,
        content_elems=2 * head,
        common={
            "dtype": "bfloat16",
            "itemsize": 2,
            "layer_names": tuple(f"model.layers.{i}.self_attn.attn" for i in range(layers)),
            "num_kv_heads": heads,
            "head_size": head,
            "block_size": block,
        },
    )


def _random_bits(tensors: list[object]) -> None:
    for t in tensors:
        t.view(torch.int16).copy_(torch.randint(-(2**15), 2**15, t.shape, dtype=torch.int16))


def _reference(tensors: list[object], ids: list[int], variant: str) -> bytes:
    pages = [t[ids] if variant == "HND" else t[ids].permute(0, 2, 1, 3) for t in tensors]
    return b"".join(p.contiguous().view(torch.uint8).numpy().tobytes() for p in pages)


def _replay(tensors: list[object], ids: list[int], g: kvl.PageGeometry) -> bytes:
    """The Triton kernel's address arithmetic, run by run, on the raw bytes."""
    storage = tensors[0].untyped_storage()
    raw = torch.empty(0, dtype=torch.uint8).set_(storage).numpy()
    out = bytearray()
    for layer in range(len(tensors)):
        for b in ids:
            for r in range(g.runs):
                start = (g.layer_offsets[layer] + b * g.block_stride + r * g.run_stride) * g.word
                out += raw[start : start + g.run_words * g.word].tobytes()
    return bytes(out)


@pytest.mark.parametrize("name", sorted(vk.KV_CACHE_LAYOUTS))
def test_page_order_of_every_layout(name: str) -> None:
    order = kvl.page_order(vk.layer_view_order(name))
    assert order == vk.FLASHINFER_NAMES.get(name, "HND")  # LHBNC: heads outside blocks, HND


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize(("backend", "cache_layout"), ALL)
def test_geometry_replays_to_the_pages_in_layout_order(
    backend: str, cache_layout: str, shape: str
) -> None:
    layers, heads, block, head = SHAPES[shape]
    tensors = vk.allocate_kv_caches(
        cache_layout,
        num_layers=layers,
        num_blocks=12,
        num_kv_heads=heads,
        block_size=block,
        head_size=head,
        dtype=torch.bfloat16,
        device="cpu",
    )
    _random_bits(tensors)
    layout = _layout(cache_layout, layers, heads, block, head)
    checked = kvl.check_tensors(layout, dict(zip(layout.layer_names, tensors, strict=True)))
    g = kvl.page_geometry(
        tensors[0].shape,
        [t.stride() for t in checked],
        [t.data_ptr() for t in checked],
        2,
        tensors[0].untyped_storage().data_ptr(),
    )
    assert g.page_words * g.word == layout.block_nbytes
    assert g.align == 16 and g.word == 4
    if cache_layout in ("LHBNC", "BHLNC") and heads > 1:
        assert g.runs == heads  # heads are not next to each other within a block
    else:
        assert g.runs == 1  # a page is one contiguous run
    ids = [7, 0, 11, 3, 5]
    payload = _replay(checked, ids, g)
    assert len(payload) == layout.payload_nbytes(len(ids))
    assert payload == _reference(checked, ids, layout.variant)


def test_check_tensors_refuses_the_other_page_order() -> None:
    tensors = vk.allocate_kv_caches(
        "LBHNC",
        num_layers=2,
        num_blocks=4,
        num_kv_heads=4,
        block_size=16,
        head_size=64,
        dtype=torch.bfloat16,
        device="cpu",
    )
    nhd = _layout("LBNHC", 2, 4, 16, 64)
    with pytest.raises(kvl.LayoutError, match="HND order"):
        kvl.check_tensors(nhd, dict(zip(nhd.layer_names, tensors, strict=True)))


def test_check_tensors_refuses_split_kernel_blocks() -> None:
    # A kernel block of 8 tokens under --block-size 16: vLLM registers [2*B, H, 8, C] views.
    tensors = vk.allocate_kv_caches(
        "LBNHC",
        num_layers=2,
        num_blocks=8,
        num_kv_heads=4,
        block_size=8,
        head_size=64,
        dtype=torch.bfloat16,
        device="cpu",
    )
    layout = _layout("LBNHC", 2, 4, 16, 64)
    with pytest.raises(kvl.LayoutError, match="kernel block size"):
        kvl.check_tensors(layout, dict(zip(layout.layer_names, tensors, strict=True)))


def test_cuda_kv_layout_names_the_page_order_in_the_key() -> None:
    assert _layout("LBNHC", 2, 4, 16, 64).kv_layout() == "cuda:FLASH_ATTN:NHD:4x16x128"
    assert _layout("BHLNC", 2, 4, 16, 64).kv_layout() == "cuda:FLASH_ATTN:HND:4x16x128"
    # Where layers and blocks sit does not change a page's bytes, hence not the key.
    assert _layout("LBHNC", 2, 4, 16, 64).kv_layout() == _layout("BLHNC", 2, 4, 16, 64).kv_layout()


def test_page_geometry_refuses_unequal_layers() -> None:
    with pytest.raises(kvl.LayoutError, match="different strides"):
        kvl.page_geometry((4, 2, 16, 8), [(256, 128, 8, 1), (256, 8, 16, 1)], [0, 4096], 2, 0)


def test_cpu_host_buffer_api_matches_gather() -> None:
    layers, heads, block, head = 2, 2, 16, 32
    tensors = [torch.randn(10, heads, block, 2 * head).to(torch.bfloat16) for _ in range(layers)]
    layout = kvl.KVLayout(
        backend="cpu_attn",
        variant="vec",
        device="cpu",
        dtype="bfloat16",
        itemsize=2,
        layer_names=("a", "b"),
        num_kv_heads=heads,
        head_size=head,
        block_size=block,
        block_shape=(heads, block, 2 * head),
    )
    copier = BlockCopier(layout, tensors)
    ids = [4, 1, 9]
    with copier.gather_to_host(ids) as buf:
        assert bytes(buf.view()) == copier.gather(ids)
        held = bytes(buf.view())
    for i, buf in copier.gather_iter([[1], ids]):
        assert bytes(buf.view()) == copier.gather([[1], ids][i])
        buf.release()
    dst = [torch.zeros_like(t) for t in tensors]
    back = BlockCopier(layout, dst)
    target = back.host_buffer(len(held))
    target.view()[:] = held
    back.scatter_many([(target, 3, 1, [6, 7])])
    for s, d in zip(tensors, dst, strict=True):
        assert torch.equal(s[[1, 9]], d[[6, 7]])
        assert not d[[0, 1, 2, 3, 4, 5, 8, 9]].any()
