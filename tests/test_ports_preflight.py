"""A port that a role binds and another process holds stops `site.yml` in preflight, naming the
variable to change and the process (pid, name, user, command line), before anything changes; the
role's own processes holding it (a re-run) pass. Each test holds the port itself: a listening
socket on a free port, which the variable is pointed at with `-e`. Only the preflight tags run."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import time
from collections.abc import Iterator

import pytest
from _ansible import assert_fails_in_preflight, run_playbook


@pytest.fixture
def port() -> Iterator[int]:
    """A port on 127.0.0.1 that this test process listens on."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _held_by_me(variable: str) -> str:
    """The message part that names this test process as the holder."""
    return (
        rf"is held by pid {os.getpid()} \(\S+, user root: .*\), listening on 127\.0\.0\.1:\d+\. "
        rf"Stop that process, or set {variable} to a free port"
    )


def test_rgw_frontend_port_taken(port: int) -> None:
    done = run_playbook(
        "site.yml", {"ceph_rgw_frontend_port": port}, "--tags", "ceph_rgw_preflight"
    )
    assert_fails_in_preflight(
        done,
        rf"ceph_rgw_frontend_port: 127\.0\.0\.1:{port} \(haproxy\) "
        + _held_by_me("ceph_rgw_frontend_port"),
    )


def test_radosgw_port_taken(port: int) -> None:
    # The second of the two instances gets the port this test holds.
    done = run_playbook(
        "site.yml", {"ceph_rgw_backend_base_port": port - 1}, "--tags", "ceph_rgw_preflight"
    )
    assert_fails_in_preflight(
        done,
        rf"ceph_rgw_backend_base_port: 127\.0\.0\.1:{port} \(radosgw instance ports "
        rf"{port - 1}\.\.{port}\) " + _held_by_me("ceph_rgw_backend_base_port"),
    )


@pytest.mark.parametrize("host", ["127.0.0.1", "0.0.0.0"])
def test_vllm_server_port_taken(port: int, host: str) -> None:
    # 0.0.0.0 takes every address, so a listener on 127.0.0.1 is in the way too.
    done = run_playbook(
        "site.yml",
        {"vllm_server_host": host, "vllm_server_port": port},
        "--tags",
        "vllm_server_preflight",
    )
    assert_fails_in_preflight(
        done,
        rf"vllm_server_port: {re.escape(host)}:{port} \(vllm_server_host:vllm_server_port\) is "
        rf"taken by another process: pid {os.getpid()} \(\S+, user root: .*\), listening on "
        rf"127\.0\.0\.1:{port}\. Stop that process, or set vllm_server_port to a free port",
    )


@pytest.mark.parametrize("variable", ["endpoint", "replay_endpoint"])
def test_vllm_server_kv_events_port_taken(port: int, variable: str) -> None:
    # vLLM binds tcp://*:PORT on every IPv4 address, the replay endpoint at its address.
    endpoint = f"tcp://*:{port}" if variable == "endpoint" else f"tcp://127.0.0.1:{port}"
    address = "0.0.0.0" if variable == "endpoint" else "127.0.0.1"
    extra_vars: dict[str, object] = {
        "vllm_server_kv_events_enabled": True,
        "vllm_server_kv_events_endpoint": f"tcp://*:{_free_port()}",
    }
    extra_vars[f"vllm_server_kv_events_{variable}"] = endpoint  # the one on the held port
    done = run_playbook("site.yml", extra_vars, "--tags", "vllm_server_preflight")
    assert_fails_in_preflight(
        done,
        r"A port vLLM binds for its KV events is taken by another process\. "
        rf"vllm_server_kv_events_{variable}: {re.escape(endpoint)} \({address}:{port}\) "
        + _held_by_me(f"vllm_server_kv_events_{variable}"),
    )


def test_s3_balancer_port_taken(port: int) -> None:
    done = run_playbook(
        "site.yml",
        {"s3_balancer_enabled": True, "s3_balancer_port": port},
        "--tags",
        "s3_balancer_preflight",
    )
    assert_fails_in_preflight(
        done,
        rf"s3_balancer_port: 127\.0\.0\.1:{port} is taken by another process: pid {os.getpid()} "
        rf"\(\S+, user root: .*\), listening on 127\.0\.0\.1:{port}\. Stop that process, or set "
        r"s3_balancer_port to a free port",
    )


def _impostor(argv0: str, port: int, *args: str, user: str = "root") -> subprocess.Popen[bytes]:
    """A process listening on `port` whose command line reads `argv0 -c CODE ARGS...`, as `ps`
    shows the role's own haproxy or vLLM server (the check goes by command line and user).
    The system interpreter: the serving user cannot run one under /root."""
    code = (
        "import socket, time; s = socket.socket(); "
        f"s.bind(('127.0.0.1', {port})); s.listen(); time.sleep(120)"
    )
    proc = subprocess.Popen(
        ["setpriv", f"--reuid={user}", f"--regid={user if user == 'root' else 'nogroup'}",
         "--clear-groups", "bash", "-c", 'exec -a "$0" "$@"',
         argv0, "/usr/bin/python3", "-c", code, *args],
    )  # fmt: skip
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        with socket.socket() as probe:
            if probe.connect_ex(("127.0.0.1", port)) == 0:
                return proc
        time.sleep(0.1)
    proc.kill()
    pytest.fail(f"the stand-in process did not listen on {port}")


# The API server binds the port before it forks the engine, which inherits the socket under
# vLLM's process title.
VLLM_OWN = {
    "API server": ("/opt/kvtier/venvs/x/bin/python", "-m", "vllm.entrypoints.openai.api_server"),
    "engine core it forked": ("VLLM::EngineCore",),
}


@pytest.mark.parametrize("vllm_argv", VLLM_OWN.values(), ids=VLLM_OWN.keys())
def test_ports_held_by_the_roles_own_processes_pass(vllm_argv: tuple[str, ...]) -> None:
    """A re-run finds haproxy and the vLLM server on their ports: that is no collision."""
    rgw_port, vllm_port = _free_port(), _free_port()
    haproxy = _impostor(
        "/usr/sbin/haproxy -W -db -f /etc/haproxy/kvtier-rgw-localhost.cfg", rgw_port
    )
    vllm = _impostor(vllm_argv[0], vllm_port, *vllm_argv[1:], user="nobody")
    try:
        done = run_playbook(
            "site.yml",
            {"ceph_rgw_frontend_port": rgw_port, "vllm_server_port": vllm_port,
             "vllm_server_user": "nobody"},
            "--tags", "ceph_rgw_preflight,vllm_server_preflight",
        )  # fmt: skip
    finally:
        haproxy.kill()
        vllm.kill()
        haproxy.wait()
        vllm.wait()
    assert done.returncode == 0, done.stdout[-3000:]
    assert "by another process:" not in done.stdout and "is held by" not in done.stdout


def test_vllm_server_run_by_another_user_is_another_process() -> None:
    vllm_port = _free_port()
    vllm = _impostor(
        "/opt/kvtier/venvs/x/bin/python", vllm_port, "-m", "vllm.entrypoints.openai.api_server",
        user="nobody",
    )  # fmt: skip
    try:
        done = run_playbook(
            "site.yml", {"vllm_server_port": vllm_port}, "--tags", "vllm_server_preflight"
        )
    finally:
        vllm.kill()
        vllm.wait()
    assert_fails_in_preflight(
        done,
        rf"vllm_server_port: 127\.0\.0\.1:{vllm_port} .* is taken by another process: "
        rf"pid {vllm.pid} \(\S+, user nobody: /opt/kvtier/venvs/x/bin/python -c .* "
        r"-m vllm\.entrypoints",
    )
