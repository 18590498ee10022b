"""What kvtier refuses at start, and says, for the KV cache vLLM describes (vLLM's own spec
classes; runs under the vLLM venv: `make test-cuda-cpu`)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec

from kvtier.vllm.connector import _refuse_unsupported_parallelism
from kvtier.vllm.layout import (
    LayoutError,
    PipelineStage,
    _kv_dtype_name,
    check_stage,
    expected_layout,
    pipeline_stages,
)


def _configs(
    cache_dtype: str = "auto",
    spec_dtype: torch.dtype = torch.bfloat16,
    non_causal: bool = False,
) -> tuple[SimpleNamespace, SimpleNamespace]:
    spec = FullAttentionSpec(
        block_size=128, num_kv_heads=2, head_size=64, dtype=spec_dtype, non_causal=non_causal
    )
    vllm_config = SimpleNamespace(
        cache_config=SimpleNamespace(cache_dtype=cache_dtype, kv_cache_layout=None),
        model_config=SimpleNamespace(dtype=torch.bfloat16),
    )
    kv_cache_config = SimpleNamespace(kv_cache_groups=[KVCacheGroupSpec(["l.0", "l.1"], spec)])
    return vllm_config, kv_cache_config


@pytest.mark.parametrize("cache_dtype", ["auto", "bfloat16"])
def test_the_models_own_dtype_is_accepted_by_name_too(cache_dtype: str) -> None:
    layout = expected_layout(*_configs(cache_dtype))
    assert layout.dtype == "bfloat16"


def test_an_fp8_kv_cache_is_refused_on_the_cpu_build_naming_both_ways_it_comes() -> None:
    # An FP8 checkpoint: vLLM resolves kv_cache_dtype from its quantization config.
    with pytest.raises(LayoutError) as err:
        expected_layout(*_configs("fp8_e4m3", torch.uint8))
    message = str(err.value)
    assert "kv_cache_dtype 'fp8_e4m3'" in message
    assert "vLLM's CPU build cannot transfer FP8 KV" in message
    assert "resolved by vLLM from the checkpoint's quantization config" in message
    assert "--kv-cache-dtype bfloat16" in message and "use --kv-cache-dtype auto" not in message


@pytest.mark.parametrize(
    ("cache_dtype", "name"),
    [("fp8", "fp8_e4m3"), ("fp8_e4m3", "fp8_e4m3"), ("fp8_e5m2", "fp8_e5m2")],
)
def test_an_fp8_kv_cache_on_cuda_is_named_in_the_layout(cache_dtype: str, name: str) -> None:
    # The CUDA branch of expected_layout needs vLLM's CUDA build; the dtype rule is shared.
    vllm_config, _ = _configs(cache_dtype, torch.uint8)
    assert _kv_dtype_name(vllm_config, torch.uint8, cuda=True) == name
    with pytest.raises(LayoutError, match="cannot transfer FP8 KV"):
        _kv_dtype_name(vllm_config, torch.uint8, cuda=False)


def test_other_kv_dtypes_are_refused_everywhere() -> None:
    with pytest.raises(LayoutError, match="stores a KV cache of the model's dtype"):
        expected_layout(*_configs("float16", torch.float16))
    vllm_config, _ = _configs("int8_per_token_head", torch.int8)
    with pytest.raises(LayoutError, match="or of fp8, fp8_e4m3, fp8_e5m2 on CUDA"):
        _kv_dtype_name(vllm_config, torch.int8, cuda=True)


def test_non_causal_attention_is_refused() -> None:
    with pytest.raises(LayoutError, match="non-causal attention"):
        expected_layout(*_configs(non_causal=True))


@pytest.mark.parametrize(
    ("setting", "message"),
    [
        ("decode_context_parallel_size", "decode_context_parallel_size=2"),
        ("prefill_context_parallel_size", "prefill_context_parallel_size=2"),
    ],
)
def test_context_parallelism_is_refused(setting: str, message: str) -> None:
    sizes = {
        "pipeline_parallel_size": 2,
        "decode_context_parallel_size": 1,
        "prefill_context_parallel_size": 1,
    }
    config = SimpleNamespace(parallel_config=SimpleNamespace(**{**sizes, setting: 2}))
    with pytest.raises(LayoutError, match=message):
        _refuse_unsupported_parallelism(config)
    _refuse_unsupported_parallelism(SimpleNamespace(parallel_config=SimpleNamespace(**sizes)))


def _stages(pp: int, layers: int) -> tuple[PipelineStage, ...]:
    return pipeline_stages(
        SimpleNamespace(
            parallel_config=SimpleNamespace(pipeline_parallel_size=pp),
            model_config=SimpleNamespace(get_total_num_hidden_layers=lambda: layers),
        )
    )


def test_pipeline_stages_follow_vllms_split() -> None:
    assert [(s.start, s.end) for s in _stages(2, 2)] == [(0, 1), (1, 2)]
    # Uneven: the remainder goes to the stages before the last, as vLLM's get_pp_indices.
    assert [(s.start, s.end) for s in _stages(2, 5)] == [(0, 3), (3, 5)]
    assert [(s.start, s.end) for s in _stages(1, 5)] == [(0, 5)]


def test_stages_of_the_same_shape_have_their_own_fingerprints() -> None:
    # The even split of a 2-layer model: both stages hold one layer of the same shape; keyed
    # by the layer count alone (the code before stages), they wrote the same keys.
    layout = expected_layout(*_configs())
    first, second = _stages(2, 2)
    fps = {layout.fingerprint("m", 256, 0, 1, 1, s).digest() for s in (first, second)}
    assert len(fps) == 2
    # Without PP the digest is the one from before stages existed: nothing stored is lost.
    (whole,) = _stages(1, 2)
    assert layout.fingerprint("m", 256, 0, 1, 1, whole) == layout.fingerprint("m", 256, 0, 1)


def test_a_stage_holding_other_layers_than_vllms_split_is_refused() -> None:
    vllm_config, _ = _configs()
    spec = FullAttentionSpec(block_size=128, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    groups = [KVCacheGroupSpec(["model.layers.1.self_attn.attn"], spec)]
    layout = expected_layout(vllm_config, SimpleNamespace(kv_cache_groups=groups))
    first, second = _stages(2, 2)
    check_stage(layout, second)
    with pytest.raises(LayoutError, match="cannot tell which layers pipeline stage 0 holds"):
        check_stage(layout, first)
