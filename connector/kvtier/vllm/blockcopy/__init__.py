"""Copying whole KV blocks between vLLM's paged buffer and chunk payloads in host memory.

`copier.BlockCopier` is the one entry point: the CPU copy is in it; on CUDA it hands the
tensors to `cuda` (imported only then: the CPU build never imports CUDA code), which uses the
pinned pools of `pinned` and the Triton kernel of `_triton`. `host_buffer` holds the payload
type they all share, so nothing here imports in a circle.
"""
