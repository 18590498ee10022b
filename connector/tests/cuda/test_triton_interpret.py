"""The Triton kernel of the CUDA copier, run by Triton's interpreter on the CPU
(``TRITON_INTERPRET=1``, in a subprocess so the GPU tests keep the compiled kernel): for every
vLLM 0.32 KVCacheLayout, gather gives the pages in the layout's page order and scatter of a
part of the payload writes exactly those blocks. Skipped without torch and Triton.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("triton")

HERE = Path(__file__).resolve().parent
SCRIPT = r"""
import sys
import torch
import vllm032_kv as vk
from kvtier.vllm.blockcopy import _triton as tc
from kvtier.vllm import layout as kvl


def caches(name):
    ts = vk.allocate_kv_caches(name, num_layers=3, num_blocks=10, num_kv_heads=4,
                               block_size=16, head_size=64, dtype=torch.bfloat16, device="cpu")
    storage = ts[0].untyped_storage()
    g = kvl.page_geometry(ts[0].shape, [t.stride() for t in ts], [t.data_ptr() for t in ts],
                          2, storage.data_ptr())
    words = torch.empty(0, dtype=torch.int32).set_(storage, 0, (storage.nbytes() // 4,), (1,))
    return ts, g, words


for name in vk.KV_CACHE_LAYOUTS:
    src, g, kv = caches(name)
    for t in src:
        t.view(torch.int16).copy_(torch.randint(-2**15, 2**15, t.shape, dtype=torch.int16))
    ids = [7, 0, 9, 3]
    payload = torch.zeros(3 * len(ids) * g.page_words, dtype=torch.int32)
    tc.launch(kv, payload, torch.tensor(g.layer_offsets), torch.tensor(ids), num_layers=3,
              num_ids=4, payload_blocks=4, payload_first=0, geometry=g, to_payload=True)
    variant = kvl.page_order(vk.layer_view_order(name))
    ref = b"".join((t[ids] if variant == "HND" else t[ids].permute(0, 2, 1, 3))
                   .contiguous().view(torch.uint8).numpy().tobytes() for t in src)
    assert payload.view(torch.uint8).numpy().tobytes() == ref, name
    dst, gd, kvd = caches(name)
    tc.launch(kvd, payload, torch.tensor(gd.layer_offsets), torch.tensor([2, 4, 6]),
              num_layers=3, num_ids=3, payload_blocks=4, payload_first=1, geometry=gd,
              to_payload=False)
    for s, d in zip(src, dst):
        assert torch.equal(s[[0, 9, 3]].view(torch.int16), d[[2, 4, 6]].view(torch.int16)), name
        assert not d[[0, 1, 3, 5, 7, 8, 9]].view(torch.int16).any(), name
    # Several chunks into one staging buffer (a step's saves): chunk c at place c of slots
    # of 4 blocks, each block at its chunk's offset, layers `blocks` pages apart.
    chunks = [[7, 0, 9], [3], [5, 1, 8, 2]]
    pw, slot = g.page_words, 3 * 4 * g.page_words
    flat = [b for c in chunks for b in c]
    base = [k * slot + j * pw for k, c in enumerate(chunks) for j in range(len(c))]
    stride = [len(c) * pw for c in chunks for _ in c]
    staging = torch.zeros(len(chunks) * slot, dtype=torch.int32)
    tc.launch_gather_many(kv, staging, torch.tensor(g.layer_offsets), torch.tensor(flat),
                          torch.tensor(base), torch.tensor(stride), num_layers=3,
                          num_ids=len(flat), geometry=g)
    raw = staging.view(torch.uint8).numpy().tobytes()
    for k, c in enumerate(chunks):
        ref = b"".join((t[c] if variant == "HND" else t[c].permute(0, 2, 1, 3))
                       .contiguous().view(torch.uint8).numpy().tobytes() for t in src)
        at = k * slot * 4
        assert raw[at : at + len(ref)] == ref, (name, k)
        assert not any(raw[at + len(ref) : at + slot * 4]), (name, k)
print("ok", len(vk.KV_CACHE_LAYOUTS))
"""


def test_kernel_in_the_triton_interpreter() -> None:
    env = dict(os.environ, TRITON_INTERPRET="1")
    env["PYTHONPATH"] = os.pathsep.join(
        [str(HERE), str(HERE.parents[1]), env.get("PYTHONPATH", "")]
    )
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert done.stdout.strip() == "ok 6"
