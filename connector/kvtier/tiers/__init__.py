"""Storage tiers, fastest first: CPU memory, local disk, S3 (Ceph RGW). One module each; the
tier clients are imported only when a config enables them.

Tiers are built here only: `tiers_from_config` for a server (every tier the config enables,
S3 behind its circuit breaker and cap), `persistent_tiers` for the tools (what outlives a
server, opened read-mostly, failures raised). A new tier is a `kvtier.tiers.base.Tier` in a
module of its own, built in both functions (CONTRIBUTING.md). The benchmarks that compare S3
clients build each client's tier on purpose (kvtier_tools.bench.tier_client_runs).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from kvtier.tiers.base import Tier, TierError

if TYPE_CHECKING:
    from kvtier.config import KvtierConfig
    from kvtier.tiers.cpu import PinHost

__all__ = ["Tier", "TierError", "persistent_tiers", "tiers_from_config"]


def tiers_from_config(
    cfg: KvtierConfig,
    *,
    disk_maintain: bool = True,
    disk_peers: frozenset[str] = frozenset(),
    remote_maintain: bool = False,
    cpu_slot_bytes: int | None = None,
    cpu_pin: PinHost | None = None,
) -> list[Tier]:
    """The tiers ``cfg`` enables, fastest first: CPU, disk, and S3 behind its circuit breaker.
    ``disk_maintain``, ``disk_peers``: see `kvtier.tiers.disk.DiskTier`. ``remote_maintain``:
    this process writes the S3 tier and keeps its cap (``max_remote_size``:
    `kvtier.tiers.bounded`); a server's workers do, its scheduler and the tools do not.
    ``cpu_slot_bytes``: the payload of a full chunk, where the caller knows it (the connector):
    the CPU tier is then a slab of such slots, pinned by ``cpu_pin`` (`kvtier.tiers.cpu`)."""
    tiers: list[Tier] = []
    if cfg.local_cpu and cfg.cpu_bytes > 0:
        from kvtier.tiers.cpu import CpuSlabTier, CpuTier

        tiers.append(
            CpuSlabTier(cfg.cpu_bytes, cpu_slot_bytes, cpu_pin)
            if cpu_slot_bytes is not None
            else CpuTier(cfg.cpu_bytes)
        )
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


def persistent_tiers(cfg: KvtierConfig, only: str | None = None) -> Iterator[Tier]:
    """The tiers of ``cfg`` that outlive a server (disk, S3; the CPU tier lives only inside a
    running process), as the tools open them (`kvtier ls`, `purge`, `verify`, `explain`): the
    disk without start-up maintenance (a running server's temp files are its own), S3 through
    boto3 without a circuit breaker, so that a failure is raised to the tool, not skipped.
    ``only``: one of them. The caller closes each tier."""
    if cfg.local_disk and only in (None, "disk"):
        from kvtier.tiers.disk import DiskTier

        yield DiskTier(cfg.local_disk, cfg.disk_bytes, maintain=False)
    if cfg.remote_url and only in (None, "s3"):
        from kvtier.tiers.s3_boto3 import Boto3S3Tier

        yield Boto3S3Tier.from_config(cfg)
