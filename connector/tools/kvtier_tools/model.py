"""A tiny, deterministic Qwen2-style model made locally (no hub access here).

`kvtier model make-tiny DIR` writes a config, a byte-level BPE tokenizer trained with
`tokenizers` on generated text, and real random weights (seeded, std 0.05, safetensors).
Real weights matter: vLLM's `--load-format dummy` gives uniform logits, so a wrong KV block
would go unnoticed; with these weights the greedy output depends on the whole context.

torch, safetensors and tokenizers exist only in the vLLM venv: they are imported lazily,
inside the functions that need them.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import random
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

EOS_TOKEN = "<|endoftext|>"


@dataclass(frozen=True)
class TinyModelSpec:
    """Shape of the generated model; the defaults give ~6.5 MB of bf16 weights."""

    num_layers: int = 2
    hidden_size: int = 256
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 512
    vocab_size: int = 8192
    max_position_embeddings: int = 32768
    weight_std: float = 0.05
    seed: int = 0


# Syllables for generated text: pseudo-words give the BPE trainer realistic merges and
# give tests long prompts whose every token matters.
_ONSETS = ["", "b", "c", "d", "f", "g", "h", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z"]
_ONSETS += ["br", "ch", "cl", "dr", "gr", "pl", "qu", "sh", "st", "th", "tr", "wh"]
_NUCLEI = ["a", "e", "i", "o", "u", "ai", "ea", "ee", "oo", "ou", "y"]
_CODAS = ["", "", "n", "r", "s", "t", "l", "m", "nd", "ng", "st", "ck", "rt"]


@functools.lru_cache(maxsize=4)
def _lexicon(seed: int, size: int) -> tuple[str, ...]:
    # Cached: the tokenizer's corpus draws 300 texts from the same lexicon.
    rng = random.Random(seed)
    words: set[str] = set()
    while len(words) < size:
        syllables = rng.choice((1, 1, 2, 2, 2, 3, 3, 4))
        words.add(
            "".join(
                rng.choice(_ONSETS) + rng.choice(_NUCLEI) + rng.choice(_CODAS)
                for _ in range(syllables)
            )
        )
    return tuple(sorted(words))


def sample_text(num_words: int, seed: int = 0, lexicon_seed: int = 1234) -> str:
    """Deterministic pseudo-English text of `num_words` words, with punctuation and digits.

    Different `seed`s give different texts over the same lexicon (the tokenizer's lexicon),
    so prompts tokenize compactly (~1.3 tokens per word with the tiny tokenizer).
    """
    lexicon = _lexicon(lexicon_seed, 6000)
    rng = random.Random(seed)
    out: list[str] = []
    sentence_len = 0
    for _ in range(num_words):
        word = rng.choice(lexicon)
        if sentence_len == 0:
            word = word.capitalize()
        if rng.random() < 0.02:
            word = str(rng.randint(0, 9999))
        out.append(word)
        sentence_len += 1
        if sentence_len >= rng.randint(6, 18):
            out[-1] += rng.choice((".", ".", ".", "?", "!", ";"))
            sentence_len = 0
        elif rng.random() < 0.08:
            out[-1] += ","
    return " ".join(out)


def _train_tokenizer(spec: TinyModelSpec) -> Any:
    # Single-threaded training keeps merge order (hence the file) reproducible.
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=spec.vocab_size,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    corpus = [sample_text(400, seed=spec.seed * 1000 + i) for i in range(300)]
    tokenizer.train_from_iterator(corpus, trainer=trainer)
    return tokenizer


def _config(spec: TinyModelSpec, eos_id: int, vocab_size: int) -> dict[str, Any]:
    return {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads,
        "head_dim": spec.hidden_size // spec.num_heads,
        "hidden_act": "silu",
        "max_position_embeddings": spec.max_position_embeddings,
        "max_window_layers": spec.num_layers,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "sliding_window": None,
        "use_sliding_window": False,
        "tie_word_embeddings": True,
        "torch_dtype": "bfloat16",
        "vocab_size": vocab_size,
        "bos_token_id": eos_id,
        "eos_token_id": eos_id,
        "attention_dropout": 0.0,
        "initializer_range": spec.weight_std,
        "use_cache": True,
    }


def _weights(spec: TinyModelSpec, vocab_size: int) -> dict[str, Any]:
    import torch

    gen = torch.Generator().manual_seed(spec.seed)
    head_dim = spec.hidden_size // spec.num_heads
    q_dim, kv_dim = spec.num_heads * head_dim, spec.num_kv_heads * head_dim

    def normal(*shape: int) -> Any:
        return (torch.randn(*shape, generator=gen) * spec.weight_std).to(torch.bfloat16)

    def ones(n: int) -> Any:
        return torch.ones(n, dtype=torch.bfloat16)

    h, inter = spec.hidden_size, spec.intermediate_size
    tensors: dict[str, Any] = {"model.embed_tokens.weight": normal(vocab_size, h)}
    for i in range(spec.num_layers):
        p = f"model.layers.{i}."
        tensors |= {
            p + "input_layernorm.weight": ones(h),
            p + "post_attention_layernorm.weight": ones(h),
            p + "self_attn.q_proj.weight": normal(q_dim, h),
            p + "self_attn.q_proj.bias": normal(q_dim),
            p + "self_attn.k_proj.weight": normal(kv_dim, h),
            p + "self_attn.k_proj.bias": normal(kv_dim),
            p + "self_attn.v_proj.weight": normal(kv_dim, h),
            p + "self_attn.v_proj.bias": normal(kv_dim),
            p + "self_attn.o_proj.weight": normal(h, q_dim),
            p + "mlp.gate_proj.weight": normal(inter, h),
            p + "mlp.up_proj.weight": normal(inter, h),
            p + "mlp.down_proj.weight": normal(h, inter),
        }
    tensors["model.norm.weight"] = ones(h)
    return tensors


def write_tokenizer_and_config(
    directory: str | os.PathLike[str], spec: TinyModelSpec | None = None
) -> Path:
    """Write everything of the tiny model but its weights (the tokenizer and the config files)
    into `directory`; needs only `tokenizers` (no torch). Returns its path."""
    spec = spec or TinyModelSpec()
    if spec.hidden_size % spec.num_heads or spec.num_heads % spec.num_kv_heads:
        raise ValueError(
            "hidden_size must be a multiple of num_heads, and num_heads of num_kv_heads"
        )
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = _train_tokenizer(spec)
    tokenizer.save(str(out / "tokenizer.json"))
    eos_id = tokenizer.token_to_id(EOS_TOKEN)
    vocab_size = spec.vocab_size  # embedding rows; the trained vocab may be slightly smaller
    _write_json(out / "config.json", _config(spec, eos_id, vocab_size))
    _write_json(
        out / "generation_config.json",
        {"bos_token_id": eos_id, "eos_token_id": eos_id, "do_sample": False},
    )
    _write_json(
        out / "tokenizer_config.json",
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "eos_token": EOS_TOKEN,
            "pad_token": EOS_TOKEN,
            "bos_token": None,
            "add_bos_token": False,
            "model_max_length": spec.max_position_embeddings,
            "clean_up_tokenization_spaces": False,
        },
    )
    _write_json(out / "special_tokens_map.json", {"eos_token": EOS_TOKEN, "pad_token": EOS_TOKEN})
    return out


def _write_json(path: Path, doc: dict[str, Any]) -> None:
    path.write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")


def make_tiny(directory: str | os.PathLike[str], spec: TinyModelSpec | None = None) -> Path:
    """Write the tiny model into `directory` (created if needed); returns its path.

    Same spec (seed included) gives byte-identical files.
    """
    spec = spec or TinyModelSpec()
    from safetensors.torch import save_file

    out = write_tokenizer_and_config(directory, spec)
    tensors = _weights(spec, spec.vocab_size)
    save_file(dict(sorted(tensors.items())), str(out / "model.safetensors"), {"format": "pt"})
    _write_json(out / "kvtier-tiny.json", {"generator": "kvtier model make-tiny", **asdict(spec)})
    return out


def make_tiny_lora(
    directory: str | os.PathLike[str],
    spec: TinyModelSpec | None = None,
    seed: int = 1,
    rank: int = 8,
) -> Path:
    """Write a PEFT LoRA adapter for the tiny model of ``spec`` into ``directory``: rank
    ``rank`` on q_proj and v_proj of every layer, random A and B (seeded), so that the adapter
    changes queries and values (hence the KV cache) and the greedy output."""
    import torch
    from safetensors.torch import save_file

    spec = spec or TinyModelSpec()
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    head_dim = spec.hidden_size // spec.num_heads
    dims = {"q_proj": spec.num_heads * head_dim, "v_proj": spec.num_kv_heads * head_dim}
    tensors: dict[str, Any] = {}
    for i in range(spec.num_layers):
        for module, out_dim in dims.items():
            p = f"base_model.model.model.layers.{i}.self_attn.{module}."
            tensors[p + "lora_A.weight"] = torch.randn(rank, spec.hidden_size, generator=gen) * 0.1
            tensors[p + "lora_B.weight"] = torch.randn(out_dim, rank, generator=gen) * 0.1
    save_file(tensors, str(out / "adapter_model.safetensors"), {"format": "pt"})
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": rank,
        "lora_alpha": 2 * rank,
        "lora_dropout": 0.0,
        "target_modules": sorted(dims),
        "bias": "none",
        "base_model_name_or_path": None,
    }
    _write_json(out / "adapter_config.json", config)
    return out


def directory_digest(directory: str | os.PathLike[str]) -> str:
    """SHA-256 over the names and contents of the files in `directory` (for determinism checks)."""
    digest = hashlib.sha256()
    for path in sorted(Path(directory).iterdir()):
        if path.is_file():
            digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def _cmd_make_tiny(args: Any) -> int:
    spec = TinyModelSpec(seed=args.seed)
    out = make_tiny(args.directory, spec)
    print(f"wrote {out} (sha256 of files: {directory_digest(out)})")
    return 0


def _cmd_make_tiny_lora(args: Any) -> int:
    out = make_tiny_lora(args.directory, TinyModelSpec(seed=args.model_seed), seed=args.seed)
    print(f"wrote {out} (sha256 of files: {directory_digest(out)})")
    return 0


def register(subparsers: Any) -> None:
    """Add `model` (make-tiny) to the `kvtier` CLI."""
    parser = subparsers.add_parser("model", help="make a small local model for tests/benchmarks")
    commands = parser.add_subparsers(dest="model_command", required=True)
    tiny = commands.add_parser(
        "make-tiny",
        help="write a tiny Qwen2-style model (needs torch, safetensors, tokenizers: "
        "run it from the vLLM venv)",
    )
    tiny.add_argument("directory", help="output directory (created if missing)")
    tiny.add_argument("--seed", type=int, default=0, help="same seed, same files (default 0)")
    tiny.set_defaults(func=_cmd_make_tiny)
    lora = commands.add_parser(
        "make-tiny-lora",
        help="write a LoRA adapter (rank 8, q_proj and v_proj) for the tiny model (vLLM venv)",
    )
    lora.add_argument("directory", help="output directory (created if missing)")
    lora.add_argument("--seed", type=int, default=1, help="the adapter's seed (default 1)")
    lora.add_argument("--model-seed", type=int, default=0, help="the tiny model's --seed")
    lora.set_defaults(func=_cmd_make_tiny_lora)


def main(argv: list[str] | None = None) -> int:
    """`model make-tiny DIR` without the rest of the `kvtier` command: the vllm_server role runs
    this file with the serving venv's python (torch is there; the tools are not)."""
    import argparse

    parser = argparse.ArgumentParser(prog="kvtier")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    status: int = args.func(args)
    return status


if __name__ == "__main__":
    import sys

    sys.exit(main())
