"""Faults of the S3 endpoint, made with real components: a private haproxy in front of the site's
S3 endpoint whose worker can be frozen (a black hole: connections are accepted, nothing ever
answers), a listener that never accepts (packets dropped once its backlog is full), the site's
own radosgw and haproxy programs stopped and started, and request streams that record TTFTs."""

from __future__ import annotations

import os
import signal
import socket
import statistics
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlparse

from _e2e import free_port

from kvtier_tools.completions import Completion, CompletionError
from kvtier_tools.server import VllmServer


class Haproxy:
    """haproxy (master-worker) on a free local port, forwarding to ``backend`` (http://h:p)."""

    def __init__(self, root: Path, backend: str) -> None:
        url = urlparse(backend)
        self.port = free_port()
        self.cfg = root / f"haproxy-{self.port}.cfg"
        self.cfg.write_text(
            "global\n    maxconn 256\n"
            "defaults\n    mode http\n    timeout connect 2s\n"
            "    timeout client 300s\n    timeout server 300s\n"
            f"frontend s3\n    bind 127.0.0.1:{self.port}\n    default_backend rgw\n"
            f"backend rgw\n    server site {url.hostname}:{url.port or 80}\n"
        )
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> Haproxy:
        self._proc = subprocess.Popen(
            ["haproxy", "-W", "-db", "-f", str(self.cfg)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", self.port)) == 0:
                    return self
            time.sleep(0.1)  # haproxy's startup: nothing to wait on but its port
        raise RuntimeError(f"haproxy did not listen on {self.port}")

    def _workers(self) -> list[int]:
        assert self._proc is not None
        out = subprocess.run(
            ["pgrep", "-P", str(self._proc.pid)], capture_output=True, text=True, check=False
        ).stdout
        return [int(p) for p in out.split()]

    def freeze(self) -> None:
        """Stop the worker: the kernel still accepts connections, nothing answers them."""
        for pid in self._workers():
            os.kill(pid, signal.SIGSTOP)

    def thaw(self) -> None:
        for pid in self._workers():
            os.kill(pid, signal.SIGCONT)

    def stop(self) -> None:
        if self._proc is not None:
            self.thaw()
            self._proc.terminate()
            self._proc.wait(timeout=10)
            self._proc = None


@contextmanager
def silent_listener() -> Iterator[str]:
    """An endpoint that listens and never accepts: once its backlog is full, the SYNs of new
    connections are dropped and they hang, as behind a partitioned network."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(0)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        sock.close()


@dataclass
class StreamResult:
    ttfts: list[float] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)

    def p(self, q: float) -> float:
        data = sorted(self.ttfts)
        if not data:
            return float("nan")
        return data[min(len(data) - 1, int(q * len(data)))]

    @property
    def median(self) -> float:
        return statistics.median(self.ttfts) if self.ttfts else float("nan")


def stream(
    send: Callable[[Sequence[int]], Completion],
    prompts: Sequence[Sequence[int]],
    concurrency: int = 1,
) -> StreamResult:
    """Send every prompt (``concurrency`` at a time); TTFT of each answer, text of each failure."""
    result = StreamResult()
    lock = threading.Lock()
    todo = list(prompts)

    def worker() -> None:
        while True:
            with lock:
                if not todo:
                    return
                tokens = todo.pop(0)
            try:
                ttft = send(tokens).ttft
                with lock:
                    result.ttfts.append(ttft)
            except CompletionError as exc:
                with lock:
                    result.failures.append(str(exc))

    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return result


def supervisorctl(*args: str) -> str:
    """The local site's supervisord (the programs the ceph_s3 fixture's deployment runs)."""
    done = subprocess.run(
        ["supervisorctl", "-c", "/etc/supervisor/supervisord.conf", *args],
        capture_output=True,
        text=True,
        check=False,
    )
    return done.stdout


def program_states(names: Sequence[str]) -> dict[str, str]:
    """Each program's state as supervisord reports it (RUNNING, STOPPED, ...)."""
    states = {}
    for line in supervisorctl("status", *names).splitlines():
        parts = line.split()
        if len(parts) >= 2:
            states[parts[0]] = parts[1]
    return states


def set_programs(state: str, names: Sequence[str]) -> None:
    """``supervisorctl stop|start`` the programs, then check that each is in that state
    (``supervisorctl`` itself says little when a name is wrong): a fault test must fail when
    its fault did not happen."""
    out = supervisorctl("stop" if state == "STOPPED" else "start", *names)
    states = program_states(names)
    assert names and all(states.get(n) == state for n in names), (
        f"supervisorctl could not set {list(names)} to {state}: {out.strip()!r}, now {states}"
    )


def endpoint_answer(url: str, timeout: float = 2.0) -> str:
    """What an HTTP endpoint answers a plain GET: its status code, "refused" or "timeout"."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return str(resp.status)
    except urllib.error.HTTPError as exc:
        return str(exc.code)
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        if isinstance(reason, ConnectionRefusedError):
            return "refused"
        if isinstance(reason, TimeoutError):
            return "timeout"
        return f"error: {reason}"


def site_programs(prefix: str) -> list[str]:
    return [
        line.split()[0] for line in supervisorctl("status").splitlines() if line.startswith(prefix)
    ]


def warnings_since(server: VllmServer, offset: int, needle: str) -> list[str]:
    text = server.log_path.read_text(errors="replace")[offset:]
    return [line for line in text.splitlines() if "WARNING" in line and needle in line]
