"""Disk tier: one file per chunk under a directory (the NVMe mount), byte-capped LRU.

* Atomic writes: a temp file in the target directory, then ``rename``. A crash leaves either the
  old state or the whole new file (torn data after power loss is caught by the checksum).
* The index (key -> size, LRU order) is rebuilt from the files at start, oldest mtime first, so
  the cache survives restarts; a hit refreshes the file's mtime to keep that order across runs.
* A full disk (ENOSPC) evicts the least recently used files and retries once, then skips the
  write (``TierError('no_space')``); it never raises anything else into the store.
* ``contains`` stats the file, so files removed behind the tier's back are misses.

Several processes may share one directory (e.g. tensor-parallel ranks write distinct keys);
each keeps its own index and cap, so the directory can grow to the sum of the caps.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator

from kvtier.format import HEADER_SIZE
from kvtier.keys import ChunkKey
from kvtier.ratelimit import RateLimitedLog
from kvtier.tiers.base import Stored, Tier, TierError

log = logging.getLogger(__name__)
# A filesystem full below the cap is a misconfiguration the operator must hear of, even when
# the retry after eviction succeeds; once every few seconds is enough.
_warnings = RateLimitedLog(log)

_SUFFIX = ".kvt"
_TMP_SUFFIX = ".tmp"


def _touch(target: str | int) -> None:
    """Set mtime from the fine clock: the kernel's own timestamps are coarse (~4 ms), which
    would make the LRU order rebuilt at restart arbitrary among recently used files."""
    now = time.time_ns()
    os.utime(target, ns=(now, now))


def chunk_path(root: str, key: str) -> str:
    """Where the disk tier under ``root`` keeps ``key``:
    ``<root>/<namespace>/<fingerprint>/<hash[:2]>/<hash>.kvt`` (also for read-only readers,
    e.g. `kvtier explain`, which must not build a tier: its start-up evicts and cleans up)."""
    try:
        k = ChunkKey.parse(key)
    except ValueError as exc:
        raise TierError("bad_key", str(exc)) from exc
    return os.path.join(root, k.namespace, k.fingerprint, k.digest[:2], k.digest + _SUFFIX)


class DiskTier(Tier):
    name = "disk"

    def __init__(
        self,
        root: str,
        capacity_bytes: int,
        *,
        maintain: bool = True,
        peers: frozenset[str] = frozenset(),
    ) -> None:
        """``maintain=False`` opens the directory as a tool does (kvtier ls, purge, explain) or
        a scheduler that only looks up: temp files are left alone (they may be a running
        server's writes in progress) and nothing is evicted at open, whatever the cap.

        ``peers``: layout fingerprints of the other processes writing this directory (the
        other tensor-parallel ranks of the same server): their chunks are neither indexed nor
        evicted here, so each rank keeps its own chunks under its own cap (without it, every
        rank evicted the whole directory down to its cap at start, and the tier shrank at
        every restart). Chunks of any other layout (an earlier configuration) are this
        process's to evict."""
        self.root = os.path.abspath(root)
        self._maintain = maintain
        self._peers = peers
        self.capacity_bytes = capacity_bytes
        self._lock = threading.Lock()
        self._index: OrderedDict[str, int] = OrderedDict()
        self._used = 0
        self._evictions = 0
        os.makedirs(self.root, exist_ok=True)
        self._rebuild_index()

    # ---- paths: <root>/<namespace>/<fingerprint>/<hash[:2]>/<hash>.kvt
    def _path(self, key: str) -> str:
        return chunk_path(self.root, key)

    def _key(self, path: str) -> str:
        rel = os.path.relpath(path, self.root).split(os.sep)
        return str(ChunkKey(rel[0], rel[1], rel[3][: -len(_SUFFIX)]))

    def _is_peers(self, key: str) -> bool:
        return bool(self._peers) and ChunkKey.parse(key).fingerprint in self._peers

    def _rebuild_index(self) -> None:
        found: list[tuple[float, str, int]] = []
        for dirpath, _dirs, files in os.walk(self.root):
            for fname in files:
                path = os.path.join(dirpath, fname)
                if fname.endswith(_TMP_SUFFIX):  # left by a crash mid-write
                    if self._maintain:
                        self._unlink(path)
                    continue
                if not fname.endswith(_SUFFIX) or path.count(os.sep) - self.root.count(os.sep) != 4:
                    continue
                key = self._key(path)
                if self._is_peers(key):
                    continue
                try:
                    st = os.stat(path)
                except FileNotFoundError:
                    continue
                found.append((st.st_mtime, key, st.st_size))
        found.sort()
        with self._lock:
            for _, key, size in found:
                self._index[key] = size
                self._used += size
        if not self._maintain:
            return
        with self._lock:  # the cap may have shrunk since the last run
            victims = self._evict_locked(0)
        for victim in victims:
            self._unlink(victim)

    @property
    def used_bytes(self) -> int:
        return self._used

    def __len__(self) -> int:
        return len(self._index)

    @staticmethod
    def _unlink(path: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)

    def _forget_locked(self, key: str) -> None:
        size = self._index.pop(key, None)
        if size is not None:
            self._used -= size

    def _evict_locked(self, need: int) -> list[str]:
        """Drop LRU entries until ``need`` more bytes fit under the cap; return their paths."""
        victims: list[str] = []
        while self._index and self._used + need > self.capacity_bytes:
            victims.append(self._evict_one_locked())
        return victims

    def _evict_bytes_locked(self, nbytes: int) -> list[str]:
        victims: list[str] = []
        before = self._used
        while self._index and before - self._used < nbytes:
            victims.append(self._evict_one_locked())
        return victims

    def _evict_one_locked(self) -> str:
        """The LRU entry dropped from the index; its path (the caller unlinks it)."""
        key, size = self._index.popitem(last=False)
        self._used -= size
        self._evictions += 1
        if self.on_evict is not None:
            self.on_evict(key)  # a bounded append (kvtier.vllm.events), fine under the lock
        return self._path(key)

    # ---- Tier interface
    def contains(self, key: str) -> bool:
        if os.path.exists(self._path(key)):
            return True
        with self._lock:
            self._forget_locked(key)
        return False

    def get(self, key: str) -> Stored | None:
        path = self._path(key)
        try:
            with open(path, "rb", buffering=0) as f:
                header = f.read(HEADER_SIZE)
                payload = f.read()  # read straight into the bytes returned: no copy
        except FileNotFoundError:
            with self._lock:
                self._forget_locked(key)
            return None
        with self._lock:
            if key in self._index:
                self._index.move_to_end(key)
            elif not self._is_peers(key):  # written by another process sharing the directory
                self._index[key] = len(header) + len(payload)
                self._used += len(header) + len(payload)
        # evicted meanwhile or read-only: the LRU order is only a hint
        with contextlib.suppress(OSError):
            _touch(path)
        return header, payload

    def put(self, key: str, header: bytes, payload: bytes) -> None:
        size = len(header) + len(payload)
        if size > self.capacity_bytes:
            raise TierError("too_large", f"{size} bytes exceed the disk tier cap")
        path = self._path(key)
        with self._lock:
            self._forget_locked(key)
            victims = self._evict_locked(size)
        for victim in victims:
            self._unlink(victim)
        try:
            self._write_atomic(path, header, payload)
        except OSError as exc:
            if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
                raise TierError("io_error", f"cannot write {path}: {exc}") from exc
            # The filesystem is fuller than our cap says (other writers): free room and retry once.
            with self._lock:
                used = self._used
                victims = self._evict_bytes_locked(2 * size)
            _warnings.warning(
                ("disk_full", self.root),
                f"the filesystem of the disk tier {self.root} is full (No space left) with "
                f"{used} of the {self.capacity_bytes} bytes of its cap in use (another writer "
                f"on it, or a cap above its size): evicting {len(victims)} chunks",
            )
            for victim in victims:
                self._unlink(victim)
            try:
                self._write_atomic(path, header, payload)
            except OSError as exc2:
                raise TierError("no_space", f"cannot write {path}: {exc2.strerror}") from exc2
        with self._lock:
            self._forget_locked(key)
            self._index[key] = size
            self._used += size

    def _write_atomic(self, path: str, header: bytes, payload: bytes) -> None:
        directory = os.path.dirname(path)
        os.makedirs(directory, exist_ok=True)
        tmp = f"{path}.{os.getpid()}.{threading.get_ident()}{_TMP_SUFFIX}"
        size = len(header) + len(payload)
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                n = os.writev(fd, [header, payload])
                if n < size:  # short write (rare, e.g. interrupted): finish it
                    rest = memoryview(header + payload)[n:]
                    while rest:
                        rest = rest[os.write(fd, rest) :]
                _touch(fd)
            finally:
                os.close(fd)
            os.replace(tmp, path)
        except BaseException:
            self._unlink(tmp)
            raise

    def delete(self, key: str) -> None:
        path = self._path(key)
        with self._lock:
            self._forget_locked(key)
        self._unlink(path)

    def list_keys(self, prefix: str = "") -> Iterator[tuple[str, int]]:
        with self._lock:
            snapshot = [(k, s) for k, s in self._index.items() if k.startswith(prefix)]
        return iter(snapshot)

    def evictions(self) -> int:
        return self._evictions

    def usage(self) -> tuple[int, int]:
        """The bytes this process's index holds, against its cap (the files of other processes
        sharing the directory count once they are read or found at start)."""
        return self._used, self.capacity_bytes
