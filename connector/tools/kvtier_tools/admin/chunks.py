"""The chunks a config's persistent tiers (disk, S3) hold: listed, counted and deleted per
namespace. `kvtier ls` and `purge`, `kvtier verify` and the benchmarks' cleanup use these."""

from __future__ import annotations

from collections import defaultdict

from kvtier.config import KvtierConfig
from kvtier.format import short_hash
from kvtier.keys import ChunkKey
from kvtier.tiers import persistent_tiers
from kvtier.tiers.base import Tier


def chunks_held(tier: Tier, keys: list[str]) -> int:
    """Chunks in the objects ``keys`` of ``tier``: an object of a run lists its chunks (asked
    with a HEAD each, in parallel on a remote tier), any other holds one."""
    if not tier.remote:
        return len(keys)
    return sum(max(1, len(listed or ())) for listed in tier.heads(keys))


def chunks_listed(
    cfg: KvtierConfig, namespace: str, only: str | None = None
) -> dict[str, set[str]]:
    """The chunks stored under ``namespace`` per persistent tier, every layout together, each by
    its short hash (`kvtier.format.short_hash`): an object of a run by the chunks it lists, any
    other by its key. A chunk held twice (two objects, two layouts) is one. Raises `TierError`."""
    held: dict[str, set[str]] = {}
    for tier in persistent_tiers(cfg, only):
        try:
            keys = [k for k, _ in tier.list_keys(f"{namespace}/")]
            chunks: set[str] = set()
            # A remote object lists its chunks ([] for one chunk, None: gone since the listing).
            lists: list[list[str] | None] = tier.heads(keys) if tier.remote else [[]] * len(keys)
            for key, listed in zip(keys, lists, strict=True):
                try:
                    ChunkKey.parse(key)
                except ValueError:
                    continue  # not a chunk
                if listed is not None:
                    chunks.update(listed or (short_hash(key),))
            held[tier.name] = chunks
        finally:
            tier.close()
    return held


def count_chunks(cfg: KvtierConfig, namespace: str, only: str | None = None) -> dict[str, int]:
    """Chunks stored under ``namespace`` per persistent tier (``{"disk": n, "s3": m}``), every
    layout together (`count_chunks_by_layout`); on S3 several chunks may share an object
    (kvtier.format).

    Raises `TierError` when a tier cannot be listed.
    """
    by_layout = count_chunks_by_layout(cfg, namespace, only)
    return {tier: sum(layouts.values()) for tier, layouts in by_layout.items()}


def count_chunks_by_layout(
    cfg: KvtierConfig, namespace: str, only: str | None = None
) -> dict[str, dict[str, int]]:
    """Chunks stored under ``namespace`` per persistent tier and layout fingerprint (a server
    with tensor parallelism stores one layout per rank). Raises `TierError`."""
    counts: dict[str, dict[str, int]] = {}
    for tier in persistent_tiers(cfg, only):
        try:
            by_layout: dict[str, list[str]] = defaultdict(list)
            for key, _ in tier.list_keys(f"{namespace}/"):
                try:
                    by_layout[ChunkKey.parse(key).fingerprint].append(key)
                except ValueError:
                    continue  # not a chunk
            counts[tier.name] = {fp: chunks_held(tier, keys) for fp, keys in by_layout.items()}
        finally:
            tier.close()
    return counts


def purge_namespace(cfg: KvtierConfig, namespace: str, only: str | None = None) -> dict[str, int]:
    """Delete every chunk of ``namespace`` from the persistent tiers; chunks deleted per tier.

    Raises `TierError` when a tier cannot be listed or a delete fails.
    """
    deleted: dict[str, int] = {}
    for tier in persistent_tiers(cfg, only):
        try:
            keys = [k for k, _ in tier.list_keys(f"{namespace}/")]
            deleted[tier.name] = tier.delete_many(keys)
        finally:
            tier.close()
    return deleted
