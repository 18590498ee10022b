"""One verification per namespace and host: a second one would purge the first one's chunks and
restart the server under it."""

from __future__ import annotations

import fcntl
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from kvtier_tools.verify.settings import VerifyError


def default_lock_dir() -> Path:
    run_lock = Path("/run/lock")
    return run_lock if os.access(run_lock, os.W_OK) else Path(tempfile.gettempdir())


@contextmanager
def exclusive(namespace: str, lock_dir: Path) -> Iterator[None]:
    """Hold the host's lock for ``namespace``: a second verification of the same namespace
    would purge its chunks and restart the server under the first one."""
    path = lock_dir / f"kvtier-verify.{namespace}.lock"
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
    except OSError as exc:
        raise VerifyError(f"cannot open the lock file {path}: {exc}") from exc
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            raise VerifyError(
                f"another kvtier verify of namespace {namespace!r} is running on this host "
                f"(pid {holder}, lock {path}); run again when it has finished"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield
    finally:
        os.close(fd)  # releases the lock
