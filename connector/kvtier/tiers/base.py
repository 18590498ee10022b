"""The one small interface every tier implements.

A tier stores chunks as (header, payload) under string keys of the form
``<namespace>/<layout fingerprint>/<chunk hash>``; on the medium they are one blob, header first
(kvtier.format). Keeping the two apart in memory lets tiers hand back the payload as read, with
no copy to strip the header. Tiers do not interpret them; the store verifies them.

A tier reports an expected failure by raising :class:`TierError` with a short ``cause`` (a
counter label); the store turns every failure into a miss, counts it and logs it. Tiers never
cache existence: ``contains`` asks the medium, so objects deleted behind a tier's back are misses.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence

#: (header, payload) of one stored chunk.
Stored = tuple[bytes, bytes]


class TierError(RuntimeError):
    """An expected tier failure; ``cause`` is a short label such as ``no_space`` or ``timeout``."""

    def __init__(self, cause: str, message: str) -> None:
        super().__init__(message)
        self.cause = cause


class Tier(ABC):
    """One storage medium. Implementations are thread-safe."""

    #: Short label used in stats and logs ("cpu", "disk", "s3").
    name: str = "tier"

    @abstractmethod
    def contains(self, key: str) -> bool:
        """Whether ``key`` is stored now (asks the medium; no cached answer)."""

    def contains_many(self, keys: Sequence[str]) -> list[bool]:
        """Presence of each key; remote tiers override this to ask in parallel."""
        return [self.contains(k) for k in keys]

    @abstractmethod
    def get(self, key: str) -> Stored | None:
        """The stored (header, payload), or ``None`` when absent.

        ``header`` is the blob's first ``HEADER_SIZE`` bytes (fewer if it is short), ``payload``
        the rest.
        """

    @abstractmethod
    def put(self, key: str, header: bytes, payload: bytes) -> None:
        """Store header + payload (replacing any previous blob); raise :class:`TierError` if
        skipped."""

    @abstractmethod
    def delete(self, key: str) -> None:
        """Remove ``key`` if present."""

    @abstractmethod
    def list_keys(self, prefix: str = "") -> Iterator[tuple[str, int]]:
        """(key, size in bytes) for each stored key starting with ``prefix``."""

    def evictions(self) -> int:
        """Blobs evicted to stay under the cap since start."""
        return 0

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release resources."""
