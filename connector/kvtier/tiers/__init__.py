"""Storage tiers, fastest first: CPU memory, local disk, S3 (Ceph RGW). One module each; the
tier clients are imported only when a config enables them."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvtier.tiers.base import Tier, TierError

if TYPE_CHECKING:
    from kvtier.config import KvtierConfig

__all__ = ["Tier", "TierError", "tiers_from_config"]


def tiers_from_config(
    cfg: KvtierConfig,
    *,
    disk_maintain: bool = True,
    disk_peers: frozenset[str] = frozenset(),
    remote_maintain: bool = False,
) -> list[Tier]:
    """The tiers ``cfg`` enables, fastest first: CPU, disk, and S3 behind its circuit breaker.
    ``disk_maintain``, ``disk_peers``: see `kvtier.tiers.disk.DiskTier`. ``remote_maintain``:
    this process writes the S3 tier and keeps its cap (``max_remote_size``:
    `kvtier.tiers.bounded`); a server's workers do, its scheduler and the tools do not."""
    tiers: list[Tier] = []
    if cfg.local_cpu and cfg.cpu_bytes > 0:
        from kvtier.tiers.cpu import CpuTier

        tiers.append(CpuTier(cfg.cpu_bytes))
    if cfg.local_disk:
        from kvtier.tiers.disk import DiskTier

        tiers.append(
            DiskTier(cfg.local_disk, cfg.disk_bytes, maintain=disk_maintain, peers=disk_peers)
        )
    if cfg.remote_url:
        from kvtier.tiers.guard import CircuitBreaker, GuardedTier
        from kvtier.tiers.s3 import make_s3_tier

        s3 = make_s3_tier(cfg)
        breaker = CircuitBreaker(
            s3.name,
            s3.probe,
            threshold=cfg.remote_failure_threshold,
            retry_secs=cfg.remote_retry_secs,
        )
        guarded: Tier = GuardedTier(s3, breaker)
        if remote_maintain and cfg.remote_bytes is not None:
            from kvtier.tiers.bounded import BoundedTier

            guarded = BoundedTier(
                guarded, cfg.remote_bytes, interval_secs=cfg.remote_evict_interval_secs
            )
        tiers.append(guarded)
    if not tiers:
        raise ValueError(f"no tier enabled in {cfg.source}")
    return tiers
