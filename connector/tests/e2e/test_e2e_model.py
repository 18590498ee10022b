"""`kvtier model make-tiny` (run from the vLLM venv, where torch/tokenizers/safetensors live)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from _e2e import VLLM_PYTHON


def _digest(directory: Path) -> str:
    code = (
        "from kvtier_tools.model import directory_digest; "
        f"print(directory_digest({str(directory)!r}))"
    )
    return subprocess.run(
        [VLLM_PYTHON, "-c", code], check=True, capture_output=True, text=True
    ).stdout.strip()


def test_same_seed_gives_identical_files(tiny_model: str, scratch: Path) -> None:
    again = scratch / "again"
    subprocess.run(
        [VLLM_PYTHON, "-m", "kvtier_tools.cli", "model", "make-tiny", str(again)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    assert _digest(again) == _digest(Path(tiny_model))


def test_model_shape_and_weights(tiny_model: str) -> None:
    config = json.loads((Path(tiny_model) / "config.json").read_text())
    assert config["architectures"] == ["Qwen2ForCausalLM"]
    assert (config["num_hidden_layers"], config["hidden_size"]) == (2, 256)
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (4, 2)
    assert (config["vocab_size"], config["max_position_embeddings"]) == (8192, 32768)
    assert config["torch_dtype"] == "bfloat16"
    weights = (Path(tiny_model) / "model.safetensors").stat().st_size
    assert 6_000_000 < weights < 7_000_000
    tokenizer = json.loads((Path(tiny_model) / "tokenizer.json").read_text())
    assert tokenizer["model"]["type"] == "BPE"
    assert len(tokenizer["model"]["vocab"]) > 4000
