"""What a KV-aware router keeps from the event stream: the blocks each source holds, per medium.

A source is one publisher (one vLLM engine, or one data-parallel rank: each publishes on its
own port). A block hash already covers the tokens before it, the LoRA adapter, multimodal
inputs and the cache salt, so a prompt's hashes looked up in order tell how many of its leading
blocks a source could serve without computing them: :meth:`PrefixIndex.score`.

Semantics, as vLLM 0.32 emits the events:

- ``BlockStored`` adds its blocks to ``(source, medium)``; ``BlockRemoved`` takes them away.
  A medium of None is vLLM's GPU cache (older vLLM left it unset).
- Hybrid models keep one block per KV cache group (``group_idx``) under the same hash: a block
  is held while any group holds it; a removal naming no group removes it from all of them.
- ``AllBlocksCleared`` comes only from vLLM's GPU block pool when its prefix cache is reset, so
  it empties the source's GPU medium; what the source offloaded (CPU, DISK, S3) stays.

Pure Python: no ZMQ, no vLLM. Only what the events said since subscribing is known; blocks
stored before that (or in batches lost on the way) are not.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from kvtier_tools.kvevents.wire import (
    MEDIUM_CPU,
    MEDIUM_DISK,
    MEDIUM_GPU,
    MEDIUM_S3,
    AllBlocksCleared,
    BlockHash,
    BlockStored,
    KVEvent,
    KVEventBatch,
)

# On equal matches, the medium that loads fastest first.
_MEDIUM_ORDER = {m: i for i, m in enumerate((MEDIUM_GPU, MEDIUM_CPU, MEDIUM_DISK, MEDIUM_S3))}


class Score(NamedTuple):
    """How many leading blocks of a prefix ``source`` holds in ``medium``."""

    source: str
    medium: str
    matched_blocks: int


class PrefixIndex:
    """Per (source, medium): block hash -> the KV cache groups holding it."""

    def __init__(self) -> None:
        self._held: dict[tuple[str, str], dict[BlockHash, set[int | None]]] = {}

    def apply(self, source: str, batch: KVEventBatch) -> None:
        """Apply a batch's events in order."""
        for event in batch.events:
            self.apply_event(source, event)

    def apply_event(self, source: str, event: KVEvent) -> None:
        if isinstance(event, AllBlocksCleared):
            self._held.pop((source, MEDIUM_GPU), None)
            return
        key = (source, event.medium or MEDIUM_GPU)
        if isinstance(event, BlockStored):
            held = self._held.setdefault(key, {})
            for h in event.block_hashes:
                held.setdefault(h, set()).add(event.group_idx)
            return
        held = self._held.get(key, {})
        for h in event.block_hashes:
            groups = held.get(h)
            if groups is None:
                continue
            if event.group_idx is None:
                groups.clear()
            else:
                groups.discard(event.group_idx)
            if not groups:
                del held[h]

    def score(self, block_hashes: Sequence[BlockHash]) -> list[Score]:
        """Leading blocks of ``block_hashes`` each (source, medium) holds: longest first, then
        the faster medium; a source holding none of them is left out."""
        scores = []
        for (source, medium), held in self._held.items():
            matched = 0
            for h in block_hashes:
                if h not in held:
                    break
                matched += 1
            if matched:
                scores.append(Score(source, medium, matched))
        return sorted(
            scores,
            key=lambda s: (-s.matched_blocks, _MEDIUM_ORDER.get(s.medium, 99), s.medium, s.source),
        )

    def holds(self, source: str, medium: str, block_hash: BlockHash) -> bool:
        return block_hash in self._held.get((source, medium), {})

    def counts(self) -> dict[tuple[str, str], int]:
        """Blocks held per (source, medium), sorted; media emptied since are left out."""
        return {key: len(held) for key, held in sorted(self._held.items()) if held}

    def sources(self) -> list[str]:
        """Sources holding at least one block, sorted."""
        return sorted({source for source, _ in self.counts()})
