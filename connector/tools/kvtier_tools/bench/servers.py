"""What the vLLM benchmarks (`kvtier bench ttft`, `kvtier bench compare`) share, so that their
numbers stay comparable: the same token-id prompts, the same server flags, the same tier settings
per scenario, and the cleanup of what a run wrote to S3.
"""

from __future__ import annotations

import random
import tempfile
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvtier_tools.server import VllmServer, kvtier_transfer_config


def random_tokens(count: int, seed: int | str) -> list[int]:
    """``count`` reproducible token ids in an ordinary vocabulary range (no tokenizer needed;
    two seeds never share a prefix in practice, so prompts only hit what they repeat)."""
    rng = random.Random(seed)
    return [rng.randrange(300, 8000) for _ in range(count)]


def random_prompts(count: int, tokens: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(300, 8000) for _ in range(tokens)] for _ in range(count)]


def batch_budget(max_prompt_tokens: int) -> int:
    """``--max-num-batched-tokens`` for every server of a run: at least the longest prompt,
    because vLLM's ExampleConnector breaks on prompts prefilled over several steps."""
    return max(max_prompt_tokens + 64, 2048)


@contextmanager
def model_or_tiny(model: str | None) -> Iterator[str]:
    """``model``, or the tiny model made in a temp dir (removed afterwards) when none is given
    (needs the vLLM venv)."""
    if model is not None:
        yield model
        return
    from kvtier_tools.model import make_tiny

    with tempfile.TemporaryDirectory(prefix="kvtier-tiny-") as tmp:
        yield str(make_tiny(Path(tmp)))


@dataclass(frozen=True)
class ServerFactory:
    """Builds the benchmark's servers: same model, port, flags and batch budget for all."""

    model: str
    port: int
    work: Path
    python: str
    budget: int

    def __call__(self, name: str, kv_transfer_config: str | None, *extra: str) -> VllmServer:
        return VllmServer(
            model=self.model,
            port=self.port,
            log_path=self.work / f"{name}.log",
            kv_transfer_config=kv_transfer_config,
            extra_args=["--max-num-batched-tokens", str(self.budget), *extra],
            python=self.python,
        )


def cpu_tier(size_gib: float = 1.0, **extra: Any) -> str:
    """kvtier with only the CPU tier (run it with vLLM's prefix cache off, else vLLM answers
    repeats before the connector is asked)."""
    return kvtier_transfer_config({"local_cpu": True, "max_local_cpu_size": size_gib, **extra})


def disk_tier(path: Path, size_gib: float = 4.0) -> str:
    """kvtier with only the disk tier at ``path`` (one fresh directory per run)."""
    return kvtier_transfer_config(
        {"local_cpu": False, "local_disk": str(path), "max_local_disk_size": size_gib}
    )


def s3_settings(config_file: str, namespace: str) -> dict[str, Any]:
    """kvtier with only the S3 tier of ``config_file``, under a namespace of the run's own (so a
    run never hits another run's chunks, and :func:`delete_namespace` removes exactly its own)."""
    return {
        "config_file": config_file,
        "local_cpu": False,
        "local_disk": None,
        "namespace": namespace,
    }


def delete_namespace(settings: Mapping[str, Any]) -> None:
    """Remove the chunks this run wrote to S3 (its own namespace). Raises TierError."""
    from kvtier.config import load_config
    from kvtier_tools.admin.chunks import purge_namespace

    cfg = load_config(dict(settings))
    purge_namespace(cfg, cfg.namespace, "s3")
