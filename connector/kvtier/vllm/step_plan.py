"""What the scheduler side tells the workers to do in one step: loads and saves of chunks.

Plain frozen dataclasses (no vLLM, no torch): they travel inside vLLM's connector metadata from
the scheduler process to the workers.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvtier.admission import SaveTiers


@dataclass(frozen=True)
class LoadSpec:
    """Write blocks ``first .. first+len(block_ids)`` of a stored chunk into `block_ids`. The
    remote tier holds it at ``position`` in the object of the run that starts with chunk
    ``object_hash`` ("": an object of its own). ``background``: the request waits outside the
    batch until its loads end (vLLM's asynchronous load); else the step's forward pass does."""

    req_id: str
    chunk_hash: str
    stored_blocks: int
    first: int
    block_ids: tuple[int, ...]
    num_tokens: int
    object_hash: str = ""
    position: int = 0
    background: bool = False
    #: The chunk's index in its prompt (for KV events: the blocks it covers).
    index: int = 0


@dataclass(frozen=True)
class SaveSpec:
    """Copy `block_ids` (all layers) and store them under `chunk_hash` in ``tiers``.
    Consecutive specs with the same ``object_hash`` (the run's first chunk) go to the remote
    tier as one object."""

    req_id: str
    chunk_hash: str
    block_ids: tuple[int, ...]
    num_tokens: int
    object_hash: str = ""
    #: The chunk's index in its prompt (for KV events: the blocks it covers).
    index: int = 0
    tiers: SaveTiers = "all"


@dataclass
class StepPlan:
    """What the workers do in one step (sent inside the connector metadata)."""

    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)
