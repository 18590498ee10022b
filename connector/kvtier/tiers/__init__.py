"""Storage tiers, fastest first: CPU memory, local disk, S3 (Ceph RGW). One module each."""

from kvtier.tiers.base import Tier, TierError

__all__ = ["Tier", "TierError"]
