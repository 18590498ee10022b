"""KV-cache bytes per token and per chunk, from a model's own config.json.

kvtier's connector copies one full-attention KV cache group: K and V of every layer, per KV head
(``connector/kvtier/vllm/layout.py``). Models whose cache is something else are refused here
with the reason, before an operator sizes tiers for them: MLA (DeepSeek's ``kv_lora_rank``: one
compressed latent per token), sliding-window or chunked-local attention, hybrids (some layers
sliding, linear or state-space), encoder-decoder models.

Tensor parallelism splits the KV heads over the ranks (vLLM replicates them when there are
fewer heads than ranks); every rank stores its own chunks, one object each.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvtier.format import HEADER_SIZE


class PlanError(ValueError):
    """A bad input to `kvtier plan`; the message says what to pass instead."""


DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
_DTYPE_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32"}
_HYBRID_KEYS = ("layers_block_type", "hybrid_override_pattern", "attn_layer_indices")


@dataclass(frozen=True)
class KVShape:
    """What one token of the KV cache is made of, on one TP rank and on all of them."""

    name: str
    config_path: str
    num_layers: int
    num_kv_heads: int
    head_size: int
    dtype: str
    tp_size: int

    @property
    def itemsize(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def kv_heads_per_rank(self) -> int:
        return max(1, self.num_kv_heads // self.tp_size)

    @property
    def bytes_per_token_per_rank(self) -> int:
        """K and V of every layer for this rank's heads."""
        return 2 * self.num_layers * self.kv_heads_per_rank * self.head_size * self.itemsize

    @property
    def bytes_per_token(self) -> int:
        """All ranks together (more than the model's KV when heads are replicated)."""
        return self.tp_size * self.bytes_per_token_per_rank

    def object_bytes(self, chunk_size: int) -> int:
        """One stored chunk of one rank: header + payload (what a tier's cap counts)."""
        return HEADER_SIZE + chunk_size * self.bytes_per_token_per_rank


def _hub_caches() -> list[Path]:
    dirs = [os.environ.get("HF_HUB_CACHE"), os.environ.get("HUGGINGFACE_HUB_CACHE")]
    home = os.environ.get("HF_HOME")
    dirs.append(os.path.join(home, "hub") if home else None)
    dirs.append(os.path.expanduser("~/.cache/huggingface/hub"))
    return [Path(d) for d in dirs if d]


def _from_hub_cache(model_id: str) -> Path | None:
    """config.json of ``org/name`` in a local Hugging Face cache (refs/main first), or None."""
    for cache in _hub_caches():
        repo = cache / ("models--" + model_id.replace("/", "--"))
        ref = repo / "refs" / "main"
        if ref.is_file():
            path = repo / "snapshots" / ref.read_text().strip() / "config.json"
            if path.is_file():
                return path
        found = sorted(repo.glob("snapshots/*/config.json"), key=lambda p: p.stat().st_mtime)
        if found:
            return found[-1]
    return None


def config_path(model: str) -> Path:
    """The config.json that ``model`` names: a directory, the file itself, or a hub id whose
    files are already in the local cache (nothing is downloaded)."""
    path = Path(model)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise PlanError(f"--model {model}: the directory has no config.json")
        return path / "config.json"
    if path.is_file():
        return path
    if model.count("/") == 1 and not model.startswith((".", "/")):
        cached = _from_hub_cache(model)
        if cached is not None:
            return cached
    raise PlanError(
        f"--model {model}: not a directory with a config.json, a config.json, nor a hub id "
        f"whose files are in the local cache ({', '.join(map(str, _hub_caches()))}); kvtier "
        "plan never downloads: pass the model's directory or its config.json"
    )


def _read_json(path: Path) -> dict[str, Any]:
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise PlanError(f"cannot read {path} as JSON: {exc}") from exc
    if not isinstance(doc, dict):
        raise PlanError(f"{path} is not a JSON object: is it a model's config.json?")
    text = doc.get("text_config")
    if isinstance(text, dict) and "num_hidden_layers" not in doc:
        return {**text, "_outer_model_type": doc.get("model_type")}  # multimodal: the LM
    return doc


def refusal(cfg: dict[str, Any], path: Path) -> str | None:
    """Why kvtier's connector cannot store this model's KV cache, or None."""
    layers = cfg.get("num_hidden_layers")
    if cfg.get("kv_lora_rank"):
        latent = int(cfg["kv_lora_rank"]) + int(cfg.get("qk_rope_head_dim") or 0)
        return (
            f"{path} describes an MLA model (kv_lora_rank={cfg['kv_lora_rank']}): its cache is "
            f"one compressed latent of {latent} values per token and layer ({layers} layers), "
            "not K and V per KV head; kvtier's connector stores one full-attention KV cache "
            "group only (vllm/layout.py), so it cannot serve this model: run it without "
            "kv_transfer_config"
        )
    kinds = cfg.get("layer_types")
    if isinstance(kinds, list) and any(k != "full_attention" for k in kinds):
        counts = {k: kinds.count(k) for k in dict.fromkeys(kinds)}
        return _unsupported(path, f"a hybrid model (layer_types: {counts})")
    if any(cfg.get(k) for k in _HYBRID_KEYS) or any(k.startswith("mamba_") for k in cfg):
        return _unsupported(path, "a hybrid or state-space model (Mamba layers)")
    if cfg.get("sliding_window") and cfg.get("use_sliding_window", True) is not False:
        return _unsupported(
            path, f"a sliding-window model (sliding_window={cfg['sliding_window']})"
        )
    if cfg.get("attention_chunk_size"):
        return _unsupported(path, f"chunked local attention ({cfg['attention_chunk_size']})")
    if cfg.get("is_encoder_decoder"):
        return _unsupported(path, "an encoder-decoder model (cross-attention cache)")
    return None


def _unsupported(path: Path, what: str) -> str:
    return (
        f"{path} describes {what}: vLLM gives it more than one KV cache group or a "
        "non-full-attention one, and kvtier's connector supports one full-attention group "
        "only (vllm/layout.py::expected_layout): run it without kv_transfer_config"
    )


def _int_key(cfg: dict[str, Any], path: Path, *names: str) -> int:
    for name in names:
        value = cfg.get(name)
        if isinstance(value, int) and value > 0:
            return value
    raise PlanError(
        f"{path} has no positive integer {' / '.join(repr(n) for n in names)}: is it a "
        "decoder-only transformer's config.json?"
    )


def resolve_dtype(dtype: str, cfg: dict[str, Any]) -> str:
    """``auto`` as vLLM resolves it (the config's dtype; float32 models run in bfloat16)."""
    wanted = _DTYPE_ALIASES.get(dtype, dtype)
    if wanted == "auto":
        wanted = str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16")
        return "bfloat16" if wanted == "float32" else _DTYPE_ALIASES.get(wanted, wanted)
    if wanted not in DTYPE_BYTES:
        raise PlanError(f"--dtype {dtype}: pass auto, bfloat16, float16 or float32")
    return wanted


def load_shape(model: str, dtype: str = "auto", tp_size: int = 1) -> KVShape:
    """The KV shape of ``model`` (see :func:`config_path`) served at ``dtype`` over ``tp_size``
    ranks; raises :class:`PlanError` naming what to change."""
    path = config_path(model)
    cfg = _read_json(path)
    why = refusal(cfg, path)
    if why:
        raise PlanError(why)
    layers = _int_key(cfg, path, "num_hidden_layers", "n_layer", "num_layers")
    heads = _int_key(cfg, path, "num_attention_heads", "n_head")
    kv_heads = cfg.get("num_key_value_heads") or (1 if cfg.get("multi_query") else heads)
    head_size = cfg.get("head_dim") or _int_key(cfg, path, "hidden_size", "n_embd") // heads
    if tp_size < 1:
        raise PlanError(f"--tp {tp_size}: pass a tensor-parallel size >= 1")
    if heads % tp_size or (kv_heads % tp_size if kv_heads >= tp_size else tp_size % kv_heads):
        raise PlanError(
            f"--tp {tp_size}: vLLM needs it to divide the {heads} attention heads and the "
            f"{kv_heads} KV heads (or be a multiple of them) of {path}"
        )
    resolved = resolve_dtype(dtype, cfg)
    if resolved not in DTYPE_BYTES:
        raise PlanError(f"{path} has dtype {resolved!r}: pass --dtype bfloat16 or float16")
    if not Path(model).exists():
        name = model  # a hub id
    else:
        name = path.parent.name if path.name == "config.json" else path.stem
    return KVShape(name, str(path), layers, int(kv_heads), int(head_size), resolved, tp_size)
