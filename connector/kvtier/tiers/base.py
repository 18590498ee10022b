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

import bisect
import io
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from kvtier.format import encode_chunk_list

#: (header, payload) of one stored chunk.
Stored = tuple[bytes, bytes]


class ChunkReader(io.RawIOBase):
    """A seekable read-only stream over the parts of a blob (header, payload, the next chunk's
    header...), so a PUT body needs no joined copy (S3 clients read it in pieces, and seek back
    to retry)."""

    def __init__(self, *parts: bytes) -> None:
        super().__init__()
        self._parts = [memoryview(p) for p in parts]
        self._starts = [0]
        for part in self._parts:
            self._starts.append(self._starts[-1] + len(part))
        self._size = self._starts[-1]
        self._pos = 0

    def __len__(self) -> int:
        return self._size

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._size}[whence]
        self._pos = max(0, min(self._size, base + offset))
        return self._pos

    def readinto(self, buffer: Any) -> int:
        out = memoryview(buffer).cast("B")
        written = 0
        index = bisect.bisect_right(self._starts, self._pos) - 1
        while written < len(out) and self._pos < self._size:
            part, start = self._parts[index], self._pos - self._starts[index]
            n = min(len(out) - written, len(part) - start)
            out[written : written + n] = part[start : start + n]
            written += n
            self._pos += n
            if start + n == len(part):
                index += 1
        return written


class TierError(RuntimeError):
    """An expected tier failure; ``cause`` is a short label such as ``no_space`` or ``timeout``."""

    def __init__(self, cause: str, message: str) -> None:
        super().__init__(message)
        self.cause = cause


class Tier(ABC):
    """One storage medium. Implementations are thread-safe."""

    #: Short label used in stats and logs ("cpu", "disk", "s3").
    name: str = "tier"
    #: A tier over the network (S3): searched with few requests, behind a circuit breaker.
    remote: bool = False
    #: Called with the key of each chunk the tier evicts to stay under its cap (set when KV
    #: events are on: kvtier.vllm.events). It may run under the tier's lock: it must be quick,
    #: never raise and never call the tier.
    on_evict: Callable[[str], None] | None = None

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

    def delete_many(self, keys: Sequence[str]) -> int:
        """Delete ``keys``; how many were deleted (S3 tiers: 1000 per request)."""
        for key in keys:
            self.delete(key)
        return len(keys)

    def list_objects(self, prefix: str = "") -> Iterator[tuple[str, int, float]]:
        """(key, size in bytes, last modified as a Unix time) for each stored key starting with
        ``prefix``: what a cap on a shared tier needs (kvtier.tiers.bounded)."""
        raise TierError("unsupported", f"the {self.name} tier does not list modification times")

    def touch(self, key: str) -> None:
        """Make ``key``'s last-modified time now, keeping its content and metadata."""
        raise TierError("unsupported", f"the {self.name} tier cannot touch {key}")

    def heads(self, keys: Sequence[str]) -> list[list[str] | None]:
        """For each key: None when absent, else the short hashes of the chunks its object holds
        (kvtier.format's chunk list; [] for an object of one chunk that lists none). Tiers of
        one chunk per key answer from ``contains_many``."""
        return [[] if present else None for present in self.contains_many(keys)]

    def put_chunks(self, items: Sequence[tuple[str, Stored]]) -> None:
        """(key, (header, payload)) of consecutive chunks: a blob of its own for one, one
        object keyed by the first for several (:meth:`put_object`)."""
        if len(items) == 1:
            key, (header, payload) = items[0]
            self.put(key, header, payload)
            return
        parts = [part for _, item in items for part in item]
        self.put_object(items[0][0], parts, encode_chunk_list([key for key, _ in items]))

    def put_object(self, key: str, parts: Sequence[bytes], chunk_list: str) -> None:
        """Store one object of several chunks: their blobs (``parts``: header, payload, header,
        payload...) under the first chunk's key, listing them (``chunk_list``) where a HEAD
        reads it. Only remote tiers hold such objects; a local tier takes one chunk."""
        if len(parts) != 2:
            raise TierError("unsupported", f"the {self.name} tier stores one chunk per key")
        self.put(key, parts[0], parts[1])

    def probe(self) -> None:
        """Raise :class:`TierError` when the medium cannot be used now (a remote tier asks its
        endpoint; the circuit breaker of kvtier.tiers.guard calls this to see it answer again)."""
        self.contains(".kvtier-probe/0")

    def evictions(self) -> int:
        """Blobs evicted to stay under the cap since start."""
        return 0

    def usage(self) -> tuple[int, int] | None:
        """(bytes held, cap) of a tier with a cap of its own; None for one without (S3: the
        bucket's lifecycle rule decides what stays)."""
        return None

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release resources."""
