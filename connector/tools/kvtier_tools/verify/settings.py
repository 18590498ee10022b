"""What a verification run is given, and the error for inputs or an environment it cannot use."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kvtier.config import KvtierConfig


class VerifyError(Exception):
    """A problem with the inputs or the environment (not a failed check)."""


@dataclass
class Settings:
    server_url: str
    model: str
    api_key: str | None
    cfg: KvtierConfig
    namespace: str
    documents: int
    document_tokens: int
    output_tokens: int
    seed: int
    restart: Callable[[], None]
    health_timeout: float
    max_warm_cold_ratio: float
    min_s3_share: float
    channel: Callable[[], tuple[bool, str]] | None = None
    #: vLLM publishes counters with its stats interval: wait this long after a round.
    metrics_settle_secs: float = 1.5
