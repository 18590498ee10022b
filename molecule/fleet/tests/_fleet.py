"""Helpers of the fleet's tests: the hosts as Ansible reaches them, their vLLM servers as clients
reach them (from this control node, over the fleet's bridge), bounded request streams, and
ansible-playbook runs of the site against the fleet's inventory."""

from __future__ import annotations

import configparser
import json
import os
import random
import subprocess
import threading
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

import testinfra
from scenario_playbook import run_playbook

from kvtier.format import CHUNK_LIST_META, decode_chunk_list, short_hash
from kvtier.keys import chunk_hashes
from kvtier_tools.completions import Completion, CompletionError, stream_completion
from kvtier_tools.server import metric_sum, parse_metrics

REPO = Path(__file__).resolve().parents[3]
SCENARIO_INVENTORY = REPO / "molecule" / "fleet" / "inventory"
#: molecule's inventory directory (links to SCENARIO_INVENTORY's files); the scenario's own
#: inventory when the tests run by hand against a converged fleet.
INVENTORY = (
    Path(os.environ["MOLECULE_INVENTORY_FILE"]).parent
    if os.environ.get("MOLECULE_INVENTORY_FILE")
    else SCENARIO_INVENTORY
)
SERVING = ("serve1", "serve2")
STORAGE = ("storage1", "storage2")


@cache
def host(name: str) -> Any:
    return testinfra.get_host(f"ansible://{name}?ansible_inventory={INVENTORY}")


@cache
def address(name: str) -> str:
    """The host's address as the inventory gives it (ansible_host)."""
    return str(host(name).ansible.get_variables()["ansible_host"])


def local_facts(name: str) -> dict[str, Any]:
    result = host(name).ansible("setup", "filter=ansible_local", check=False)
    return dict(result["ansible_facts"]["ansible_local"])


@dataclass(frozen=True)
class Server:
    """One serving host's vLLM, described by the local fact its vllm_server role wrote."""

    name: str
    fact: dict[str, Any]
    api_key: str

    @property
    def url(self) -> str:
        return str(self.fact["server_url"])

    @property
    def model(self) -> str:
        return str(self.fact["model"])

    @property
    def service(self) -> str:
        return str(self.fact["service_name"])

    @property
    def log_file(self) -> str:
        return f"/var/log/kvtier/{self.name}/{self.service}.log"

    def complete(
        self, tokens: Sequence[int], max_tokens: int = 16, namespace: str | None = None
    ) -> Completion:
        extra = {"kv_transfer_params": {"kvtier_namespace": namespace}} if namespace else None
        return stream_completion(
            self.url,
            self.model,
            tokens,
            max_tokens,
            api_key=self.api_key,
            extra_body=extra,
            timeout=120,
        )

    def started_at(self) -> float | None:
        """When the serving process started (its /metrics), None while it does not answer."""
        try:
            return self.metric("process_start_time_seconds")
        except OSError:
            return None

    def metric(self, name: str, **labels: str) -> float:
        with urllib.request.urlopen(self.url + "/metrics", timeout=10) as resp:
            return metric_sum(parse_metrics(resp.read().decode()), name, **labels)

    def log_size(self) -> int:
        return int(host(self.name).check_output(f"stat -c %s {self.log_file}"))

    def log_since(self, offset: int) -> str:
        return str(host(self.name).check_output(f"tail -c +{offset + 1} {self.log_file}"))


def server(name: str) -> Server:
    # The hosts share /etc/ansible/facts.d: each fact is named after its host's service.
    fact = local_facts(name)[f"kvtier_vllm_{name}"]
    key_file = fact["api_key_file"]
    key = host(name).file(key_file).content_string.strip() if key_file else ""
    return Server(name, fact, key)


def s3_client(serving_host: str = "serve1") -> Any:
    """boto3 against storage1's endpoint with the serving user's keys (from its AWS profile)."""
    import boto3
    from botocore.config import Config

    fact = server(serving_host).fact
    creds = configparser.ConfigParser()
    home = fact["user_home"]
    creds.read_string(host(serving_host).file(f"{home}/.aws/credentials").content_string)
    return boto3.client(
        "s3",
        endpoint_url=f"http://{address('storage1')}:7480",
        aws_access_key_id=creds.get("kvtier", "aws_access_key_id"),
        aws_secret_access_key=creds.get("kvtier", "aws_secret_access_key"),
        region_name="default",
        config=Config(
            s3={"addressing_style": "path"},
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
        ),
    )


def chunks_in_bucket(namespace: str, bucket: str = "kvtier-cache") -> set[str]:
    """Short hashes (kvtier.format.short_hash) of the chunks stored under ``namespace`` (any
    layout): an object of a run lists its chunks, any other holds its key's."""
    client = s3_client()
    found: set[str] = set()
    for page in client.get_paginator("list_objects_v2").paginate(
        Bucket=bucket, Prefix=f"kv/{namespace}/"
    ):
        for obj in page.get("Contents", []):
            meta = client.head_object(Bucket=bucket, Key=obj["Key"]).get("Metadata", {})
            listed = decode_chunk_list(meta.get(CHUNK_LIST_META)) or [short_hash(obj["Key"])]
            found.update(listed)
    return found


def chunks_of(doc: Sequence[int], chunk_size: int) -> set[str]:
    """Short hashes of a prompt's full chunks, as chunks_in_bucket lists them."""
    return {short_hash(h) for h in chunk_hashes(doc, chunk_size)}


def prompt(num_tokens: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(300, 8000) for _ in range(num_tokens)]


def supervisorctl(name: str, *args: str) -> str:
    conf = f"/etc/supervisor/kvtier-{name}/supervisord.conf"
    return str(host(name).check_output(f"supervisorctl -c {conf} {' '.join(args)}"))


@dataclass
class Stream:
    """A bounded stream of requests in a thread: at most `limit` requests, until stopped."""

    send: Callable[[int], Completion]
    limit: int = 400
    #: Checked before each request: the stream ends once it returns True.
    until: Callable[[], bool] | None = None
    completions: list[Completion] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def __enter__(self) -> Stream:
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        for i in range(self.limit):
            if self._stop.is_set() or (self.until is not None and self.until()):
                return
            try:
                self.completions.append(self.send(i))
            except CompletionError as exc:
                self.failures.append(str(exc))

    def join(self, timeout: float = 600) -> None:
        """Wait until the stream has sent its `limit` requests."""
        if self._thread is not None:
            self._thread.join(timeout=timeout)

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self.join(timeout=180)


def playbook(*args: str, timeout: float = 1500) -> subprocess.CompletedProcess[str]:
    """`ansible-playbook -i <fleet inventory> ARGS` from the bundle, as an operator runs it."""
    return run_playbook(INVENTORY, *args, timeout=timeout)


def report(name: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((REPO / "reports" / "kv_verify" / f"{name}.json").read_text())
    return data
