"""kvtier's S3 tier and CLI against the real Ceph RGW brought up by the project's playbook.

Uses the session fixture ``ceph_s3`` (connector/tests/conftest.py). ``KVTIER_TEST_S3_CONFIG``
(a kvtier YAML with remote_url/endpoint_url/aws_profile,
with AWS_* file variables in the environment) runs the same tests against any other S3.
Every test writes under its own random prefix and deletes what it wrote.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path
from typing import Any

import pytest
from _helpers import FINGERPRINT, chunks
from _s3 import S3Env, objects

from kvtier.config import load_config
from kvtier.format import HEADER_SIZE, short_hash
from kvtier.store import ChunkRef, TieredStore
from kvtier.tiers.s3_boto3 import make_boto3_client
from kvtier_tools.admin.chunks import chunks_listed, count_chunks
from kvtier_tools.cli import main as cli_main

pytestmark = pytest.mark.integration

CLIENTS = ["boto3", "crt", "auto"]


@pytest.mark.parametrize("client", CLIENTS)
def test_chunks_survive_a_restart_through_s3(s3: tuple[S3Env, str], client: str) -> None:
    env, prefix = s3
    cfg = load_config(env.write_config(prefix, s3_client=client))
    data = chunks(5, size=700 * 1024)
    with TieredStore.from_config(cfg, FINGERPRINT) as store:
        for h, p in data:
            store.put(h, p, 256)
        assert store.flush(30)
    objs = objects(cfg)
    assert len(objs) == 5
    assert all(size == 700 * 1024 + HEADER_SIZE for size in objs.values())
    # a new process: nothing local, everything from the bucket, byte for byte
    with TieredStore.from_config(cfg, FINGERPRINT) as store:
        hashes = [h for h, _ in data]
        assert store.lookup_prefix(hashes) == 5
        assert store.lookup_prefix([*hashes[:2], "0" * 32]) == 2
        assert store.get_many(hashes) == [p for _, p in data]
        st = store.stats()
    assert st.tiers["s3"].hits == 5 and st.tiers["s3"].errors == {}


@pytest.mark.parametrize("client", CLIENTS)
def test_runs_of_chunks_are_one_object_each_found_and_read_back(
    s3: tuple[S3Env, str], client: str
) -> None:
    """Runs of 4 chunks: one object each, with the chunk list a HEAD returns; a new process
    walks them and reads each object with one GET; a second prompt that shares the first 6
    chunks finds those 6 and stores its own from chunk 6 on, leaving the first prompt's intact.
    """
    env, prefix = s3
    cfg = load_config(env.write_config(prefix, s3_client=client, remote_chunks_per_object=4))
    data = chunks(10, size=100 * 1024)
    hashes = [h for h, _ in data]
    with TieredStore.from_config(cfg, FINGERPRINT, object_chunks=4) as store:
        for first in range(0, 10, 4):
            store.put_run([(h, p, 256) for h, p in data[first : first + 4]])
        assert store.flush(30)
    objs = objects(cfg)
    assert sorted(objs.values()) == sorted(
        [4 * (100 * 1024 + HEADER_SIZE)] * 2 + [2 * (100 * 1024 + HEADER_SIZE)]
    )
    assert count_chunks(cfg, cfg.namespace) == {"s3": 10}
    with TieredStore.from_config(cfg, FINGERPRINT, object_chunks=4) as store:
        found = store.lookup_remote(hashes)
        assert found.found == 10 and found.objects == ((0, 4), (4, 4), (8, 2))
        refs = [ChunkRef(h, hashes[found.object_of(k)[0]], k % 4) for k, h in enumerate(hashes)]
        assert store.get_many(refs) == [p for _, p in data]
        other = [*data[:6], *chunks(4, size=100 * 1024, seed=7)]
        mine = [h for h, _ in other]
        assert store.lookup_remote(mine).found == 6
        store.put_run([(h, p, 256) for h, p in other[6:]])
        assert store.flush(30)
        walked = store.lookup_remote(mine)
        assert walked.found == 10 and walked.objects == ((0, 4), (4, 2), (6, 4))
        assert store.lookup_remote(hashes).found == 10
        st = store.stats()
    assert st.tiers["s3"].hits == 10 and st.tiers["s3"].errors == {}
    # Each chunk by its short hash, once: the three runs' and the new run's (kvtier bench soak).
    assert chunks_listed(cfg, cfg.namespace) == {"s3": {short_hash(h) for h in [*hashes, *mine]}}


@pytest.mark.parametrize("client", CLIENTS)
def test_objects_deleted_behind_its_back_are_misses(s3: tuple[S3Env, str], client: str) -> None:
    env, prefix = s3
    cfg = load_config(env.write_config(prefix, s3_client=client))
    data = chunks(3)
    with TieredStore.from_config(cfg, FINGERPRINT) as store:
        for h, p in data:
            store.put(h, p, 256)
        store.flush(30)
        hashes = [h for h, _ in data]
        assert store.lookup_prefix(hashes) == 3
        raw = make_boto3_client(cfg)
        raw.delete_object(Bucket=cfg.s3_bucket, Key=f"{cfg.s3_prefix}/{store.key(hashes[2])}")
        assert store.lookup_prefix(hashes) == 2  # no stale "exists" answer
        assert store.get(hashes[2]) is None
        # A hole in the middle: the search assumes presence along a prompt is monotone
        # (kvtier.prefix) and may count past it, but the hole itself reads as a miss, so the
        # load stops there and vLLM recomputes from it.
        raw.delete_object(Bucket=cfg.s3_bucket, Key=f"{cfg.s3_prefix}/{store.key(hashes[1])}")
        assert store.lookup_prefix(hashes[:2]) == 1
        assert store.get(hashes[1]) is None
        assert store.get(hashes[0]) == data[0][1]


@pytest.mark.parametrize("client", CLIENTS)
def test_corrupted_object_is_a_miss_and_removed(s3: tuple[S3Env, str], client: str) -> None:
    env, prefix = s3
    cfg = load_config(env.write_config(prefix, s3_client=client))
    ((h, p),) = chunks(1)
    raw = make_boto3_client(cfg)
    with TieredStore.from_config(cfg, FINGERPRINT) as store:
        store.put(h, p, 256)
        store.flush(30)
        key = f"{cfg.s3_prefix}/{store.key(h)}"
        blob = bytearray(raw.get_object(Bucket=cfg.s3_bucket, Key=key)["Body"].read())
        blob[HEADER_SIZE + 10] ^= 0x40
        raw.put_object(Bucket=cfg.s3_bucket, Key=key, Body=bytes(blob))
        assert store.get(h) is None
        assert store.stats().tiers["s3"].errors == {"checksum": 1}
    assert objects(cfg) == {}


def test_promotion_from_s3_into_disk_and_cpu(s3: tuple[S3Env, str], tmp_path: Path) -> None:
    env, prefix = s3
    path = env.write_config(
        prefix,
        local_cpu=True,
        max_local_cpu_size=0.1,
        local_disk=str(tmp_path / "disk"),
        max_local_disk_size=0.1,
    )
    cfg = load_config(path)
    data = chunks(3)
    with TieredStore.from_config(cfg, FINGERPRINT) as store:
        for h, p in data:
            store.put(h, p, 256)
    for f in (tmp_path / "disk").rglob("*.kvt"):  # lose the local copies
        f.unlink()
    with TieredStore.from_config(cfg, FINGERPRINT) as store:
        assert store.get_many([h for h, _ in data]) == [p for _, p in data]
        assert store.flush(30)
        st = store.stats()
        assert st.tiers["s3"].hits == 3 and st.tiers["disk"].puts == 3
        assert store.get(data[0][0]) == data[0][1]
        assert store.stats().tiers["cpu"].hits == 1
    assert len(list((tmp_path / "disk").rglob("*.kvt"))) == 3


@pytest.mark.parametrize("client", CLIENTS)
def test_unreachable_endpoint_is_a_miss_not_an_exception(
    s3: tuple[S3Env, str], client: str, capsys: pytest.CaptureFixture[str]
) -> None:
    env, prefix = s3
    path = env.write_config(
        prefix, s3_client=client, endpoint_url="http://127.0.0.1:9", blocking_timeout_secs=2
    )
    cfg = load_config(path)
    data = chunks(2)
    with TieredStore.from_config(cfg, FINGERPRINT) as store:
        for h, p in data:
            store.put(h, p, 256)
        assert store.flush(60)
        assert store.lookup_prefix([h for h, _ in data]) == 0
        assert store.get(data[0][0]) is None
        errors = store.stats().tiers["s3"].errors
    # A few real attempts, then the circuit breaker answers at once (circuit_open).
    assert errors and set(errors) <= {"connection", "timeout", "circuit_open"}, errors
    assert errors.get("connection", 0) + errors.get("timeout", 0) <= 4, errors
    assert cli_main(["doctor", "--config", str(path)]) == 1
    out = capsys.readouterr().out
    assert "[FAIL] endpoint: http://127.0.0.1:9: connection refused" in out
    assert "fix: start the S3 service" in out


def test_doctor_passes_and_diagnoses(
    s3: tuple[S3Env, str], capsys: pytest.CaptureFixture[str]
) -> None:
    env, prefix = s3
    good = env.write_config(prefix)
    assert cli_main(["doctor", "--config", str(good)]) == 0
    assert "[ok  ] probe: put/get/delete" in capsys.readouterr().out

    typo = env.write_config(prefix, aws_profile=env.profile + "x")
    assert cli_main(["doctor", "--config", str(typo)]) == 1
    out = capsys.readouterr().out
    assert f"profile '{env.profile}x' not found" in out and f"did you mean '{env.profile}'" in out

    # wrong secret: RGW answers 403; the fix names the profile's keys
    creds = env.root / "bad-credentials"
    creds.write_text(f"[{env.profile}]\naws_access_key_id = NOPE\naws_secret_access_key = nope\n")
    os.environ["AWS_SHARED_CREDENTIALS_FILE"], old = (
        str(creds),
        os.environ.get("AWS_SHARED_CREDENTIALS_FILE", ""),
    )
    try:
        assert cli_main(["doctor", "--config", str(good)]) == 1
    finally:
        os.environ["AWS_SHARED_CREDENTIALS_FILE"] = old
    out = capsys.readouterr().out
    assert "[FAIL] bucket" in out and "(401/403)" in out

    missing = env.write_config(prefix, remote_url=f"s3://kvtier-no-such-bucket/{prefix}")
    assert cli_main(["doctor", "--config", str(missing)]) == 1
    assert "create bucket kvtier-no-such-bucket" in capsys.readouterr().out

    # chunks written with 256-token chunks, read with a 128-token config: never a hit
    cfg = load_config(good)
    with TieredStore.from_config(cfg, FINGERPRINT) as store:
        for h, p in chunks(2, size=1024):
            store.put(h, p, 256)
    small = env.write_config(prefix, chunk_size=128)
    assert cli_main(["doctor", "--config", str(small)]) == 1
    out = capsys.readouterr().out
    assert "[FAIL] chunk size" in out and "set key 'chunk_size'" in out and "to 256" in out


def test_ls_stats_and_purge(
    s3: tuple[S3Env, str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    env, prefix = s3
    path = env.write_config(
        prefix, local_disk=str(tmp_path / "disk"), max_local_disk_size=0.1, namespace="tenant-a"
    )
    cfg = load_config(path)
    with TieredStore.from_config(cfg, FINGERPRINT) as store:
        for h, p in chunks(4, size=2048):
            store.put(h, p, 256)
        store.get(chunks(4, size=2048)[0][0])  # same hashes: seed 0
    assert cli_main(["ls", "--config", str(path)]) == 0
    out = capsys.readouterr().out
    assert f"tenant-a/{FINGERPRINT}\t4 chunks" in out
    # disk and s3 totals and per-layout lines (a chunk put alone is an object of its own)
    assert out.count("4 chunks") == 2 and out.count("4 objects") == 2

    assert cli_main(["stats", "--config", str(path)]) == 0
    out = capsys.readouterr().out
    assert "1 process snapshot(s)" in out and "puts 4" in out

    assert cli_main(["purge", "--config", str(path), "--namespace", "other"]) == 0
    assert "nothing to purge" in capsys.readouterr().out
    answers = iter(["n"])
    from kvtier_tools.admin.cli import cmd_purge

    args = admin_args(path)
    assert cmd_purge(args, confirm=lambda _q: next(answers)) == 1
    assert len(objects(cfg)) == 4
    assert cli_main(["purge", "--config", str(path), "--yes"]) == 0
    out = capsys.readouterr().out
    assert "disk: deleted 4 chunks" in out and "s3: deleted 4 objects" in out
    assert objects(cfg) == {}
    assert not list((tmp_path / "disk").rglob("*.kvt"))


def admin_args(path: Path) -> Any:
    from kvtier_tools.cli import build_parser

    return build_parser().parse_args(["purge", "--config", str(path)])


@pytest.mark.parametrize("size", [1, 4096, 1 << 20])
def test_a_refused_write_leaves_the_connection_usable_for_reads(
    s3: tuple[S3Env, str], size: int
) -> None:
    """A PUT that RGW refuses before reading its body (here: a missing bucket) must not spoil the
    pooled connection: behind haproxy, botocore's default ``Expect: 100-continue`` left it waiting
    for the unsent body, and the next GET on it answered MethodNotAllowed or stalled until its
    read timeout (a cache miss, and breaker failures, caused by another chunk's write)."""
    env, prefix = s3
    cfg = load_config(env.write_config(prefix))
    client = make_boto3_client(cfg, pool=1)  # one connection: the GET reuses the PUT's
    key = f"{prefix}/readable"
    client.put_object(Bucket=env.bucket, Key=key, Body=b"payload")
    missing = f"kvtier-missing-{uuid.uuid4().hex[:10]}"
    from botocore.exceptions import ClientError

    with pytest.raises(ClientError) as refused:
        client.put_object(Bucket=missing, Key="x", Body=os.urandom(size))
    assert refused.value.response["Error"]["Code"] == "NoSuchBucket"
    sent: list[str] = []
    client.meta.events.register("before-send.s3", lambda request, **_: sent.append(request.method))
    assert client.get_object(Bucket=env.bucket, Key=key)["Body"].read() == b"payload"
    # Answered at the first try: a GET on a spoiled connection stalls to its read timeout and is
    # sent again (botocore's retry), or fails with MethodNotAllowed.
    assert sent == ["GET"], "the GET was retried: its connection was spoiled"
