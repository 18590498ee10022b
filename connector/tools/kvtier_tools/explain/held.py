"""Which of a prompt's chunks the persistent tiers of a config hold now, asked read-only.

A tier key is ``<namespace>/<layout fingerprint>/<chunk hash>``. The fingerprint depends on the
layout vLLM picks at run time (model, dtype, block size, kernel, TP rank...), so it is found in
the tiers: the directories under ``<local_disk>/<namespace>/`` and the common prefixes of an S3
listing under ``<prefix>/<namespace>/``, or given (``--fingerprint``). Then each chunk key is
checked: a stat on disk (no `DiskTier` is opened: it indexes every file of the directory, and
only a few paths are asked here), on S3 (the tools' tier: `kvtier.tiers.persistent_tiers`) a
walk over the objects that hold the prompt's leading chunks (HEADs; kvtier.prefix). Nothing
is written or deleted. The CPU tier lives inside the server: not visible here.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvtier.config import KvtierConfig
from kvtier.format import short_hash
from kvtier.keys import ChunkKey
from kvtier.prefix import walk_objects
from kvtier.tiers import persistent_tiers
from kvtier.tiers.base import TierError
from kvtier.tiers.disk import chunk_path
from kvtier_tools.explain.prompts import ExplainError

_FINGERPRINT = re.compile(r"^[0-9a-f]{32}$")
MAX_FINGERPRINTS = 16


def leading(present: Sequence[bool]) -> int:
    n = 0
    while n < len(present) and present[n]:
        n += 1
    return n


@dataclass
class CacheView:
    """The disk and S3 tiers of ``cfg`` under ``namespace``, read-only."""

    cfg: KvtierConfig
    namespace: str
    errors: dict[str, str] = field(default_factory=dict)
    _s3: Any = None

    def __post_init__(self) -> None:
        self._s3 = next(persistent_tiers(self.cfg, "s3"), None)

    @property
    def tiers(self) -> list[str]:
        return (["disk"] if self.cfg.local_disk else []) + (["s3"] if self._s3 else [])

    def _disk_fingerprints(self) -> set[str]:
        root = os.path.join(self.cfg.local_disk or "", self.namespace)
        try:
            return {d for d in os.listdir(root) if _FINGERPRINT.match(d)}
        except FileNotFoundError:
            return set()
        except OSError as exc:
            self.errors["disk"] = f"cannot list {root}: {exc}"
            return set()

    def _s3_fingerprints(self) -> set[str]:
        try:
            names = self._s3.list_dirs(self.namespace)
        except TierError as exc:  # reported; the other tier still answers
            self.errors["s3"] = f"cannot list the S3 tier ({exc.cause}: {exc})"
            return set()
        return {name for name in names if _FINGERPRINT.match(name)}

    def fingerprints(self, wanted: str | None) -> list[str]:
        """The layouts stored under the namespace (those starting with ``wanted`` if given)."""
        found = self._disk_fingerprints() if self.cfg.local_disk else set()
        if self._s3 is not None:
            found |= self._s3_fingerprints()
        if wanted:
            found = {f for f in found if f.startswith(wanted)}
            if not found and _FINGERPRINT.match(wanted):
                found = {wanted}
        if len(found) > MAX_FINGERPRINTS:
            raise ExplainError(
                f"{len(found)} layouts under namespace {self.namespace!r}: pass --fingerprint "
                "(the one the server uses; `kvtier ls` lists them)"
            )
        return sorted(found)

    def held(self, fingerprint: str, hashes: Sequence[str]) -> dict[str, list[bool] | None]:
        """Per tier, whether each chunk is stored now (None: the tier could not be asked)."""
        keys = [str(ChunkKey(self.namespace, fingerprint, h)) for h in hashes]
        out: dict[str, list[bool] | None] = {}
        if self.cfg.local_disk:
            root = os.path.abspath(self.cfg.local_disk)
            out["disk"] = [os.path.exists(chunk_path(root, k)) for k in keys]
        if self._s3 is not None:
            try:
                # Objects may hold runs of chunks (kvtier.format): walk them from the first.
                shorts = [short_hash(h) for h in hashes]
                found = walk_objects(self._s3.heads, keys, shorts, span=1).found
                out["s3"] = [k < found for k in range(len(keys))]
            except TierError as exc:
                self.errors["s3"] = str(exc)
                out["s3"] = None
        return out

    def close(self) -> None:
        if self._s3 is not None:
            self._s3.close()
