"""The shared tier's cap (``max_remote_size``, kvtier.tiers.bounded) against the real Ceph RGW:
two writers (two stores, as two servers would hold them) on one prefix, each keeping the cap.

Uses the ``s3`` fixture (connector/tests/_s3.py: a fresh prefix, emptied afterwards).
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Iterator

import pytest
from _helpers import FINGERPRINT, chunks
from _s3 import S3Env, bucket_quota_with_room, objects

from kvtier.config import load_config
from kvtier.store import TieredStore
from kvtier.tiers.s3_boto3 import make_boto3_client
from kvtier_tools.cli import main as cli_main

# Sets a quota on the shared bucket: CI runs it alone (the marker `alone`, pyproject.toml).
pytestmark = [pytest.mark.integration, pytest.mark.alone]

MIB = 1 << 20
CAP = 4 * MIB
PAYLOAD = 256 * 1024
#: What the test allows over the cap, sampled between writes: each writer's slack (5 % of the
#: cap) and what the other writer wrote since its last listing (a pass every 0.5 s, rounds of
#: 2 objects every 0.1 s: about 10 objects). Without the cap the prefix reaches 3 x the cap.
MARGIN = 2 * CAP // 20 + 10 * PAYLOAD


def _capped(env: S3Env, prefix: str, **extra: object) -> TieredStore:
    values = {"max_remote_size": CAP / (1 << 30), "remote_evict_interval_secs": 0.5, **extra}
    cfg = load_config(env.write_config(prefix, **values))
    return TieredStore.from_config(cfg, FINGERPRINT, remote_maintain=True)


def _fill(env: S3Env, prefix: str) -> int:
    return sum(objects(load_config(env.write_config(prefix))).values())


def _wait_for_pass(store: TieredStore, passes: int = 1, timeout: float = 30) -> None:
    tier = store.remote_tier
    deadline = time.monotonic() + timeout
    while getattr(tier, "passes", 0) < passes:
        assert time.monotonic() < deadline, "no pass of the cap keeper"
        time.sleep(0.05)


def test_two_writers_keep_the_prefix_under_its_cap_and_the_hot_chunks(
    s3: tuple[S3Env, str],
) -> None:
    env, prefix = s3
    hot = chunks(4, size=PAYLOAD, seed=1)
    cold = chunks(48, size=PAYLOAD, seed=2)  # 3 x the cap
    a, b = _capped(env, prefix), _capped(env, prefix)
    try:
        _two_writers(env, prefix, a, b, hot, cold)
    finally:  # closed on failure too: their passes must not outlive the test
        a.close()
        b.close()
    # The hot chunks, read at every round, were never evicted: a new process finds them all.
    with TieredStore.from_config(load_config(env.write_config(prefix)), FINGERPRINT) as fresh:
        assert fresh.lookup_prefix([h for h, _ in hot]) == len(hot)


def _two_writers(
    env: S3Env,
    prefix: str,
    a: TieredStore,
    b: TieredStore,
    hot: list[tuple[str, bytes]],
    cold: list[tuple[str, bytes]],
) -> None:
    _wait_for_pass(a)
    _wait_for_pass(b)
    for h, p in hot:
        a.put(h, p, 256)
    assert a.flush(30)
    hot_hashes = [h for h, _ in hot]
    fills = []
    for i in range(0, len(cold), 4):
        if i == len(cold) // 2:
            a.close()  # one writer down: the other keeps the prefix bounded alone
        writers = [b] if i >= len(cold) // 2 else [a, b]
        for j, (h, p) in enumerate(cold[i : i + 4]):
            writers[j % len(writers)].put(h, p, 256)
        for w in writers:
            assert w.flush(30)
            assert w.get_many(hot_hashes) == [p for _, p in hot]  # the hot set is read
        fills.append(_fill(env, prefix))
        time.sleep(0.1)
    _wait_for_pass(b, b.remote_tier.passes + 2)  # type: ignore[union-attr]
    assert max(fills) <= CAP + MARGIN, [f / MIB for f in fills]
    assert _fill(env, prefix) <= CAP
    st = b.stats().tiers["s3"]
    assert st.evictions > 0 and st.capacity_bytes == CAP


def test_a_restarted_writer_finds_the_prefix_over_its_cap_and_evicts_first(
    s3: tuple[S3Env, str], capsys: pytest.CaptureFixture[str]
) -> None:
    env, prefix = s3
    with TieredStore.from_config(load_config(env.write_config(prefix)), FINGERPRINT) as free:
        for h, p in chunks(24, size=PAYLOAD, seed=3):  # 1.5 x the cap, no cap set
            free.put(h, p, 256)
        assert free.flush(30)
    assert _fill(env, prefix) > CAP
    with _capped(env, prefix) as store:
        _wait_for_pass(store)
        assert _fill(env, prefix) <= CAP * 0.9 + PAYLOAD
        used, capacity = store.remote_tier.usage()  # type: ignore[union-attr,misc]
        assert used <= CAP and capacity == CAP
    # kvtier ls shows the fill against the cap.
    path = env.write_config(prefix, max_remote_size=CAP / (1 << 30))
    assert cli_main(["ls", "--config", str(path), "--tier", "s3"]) == 0
    assert re.search(r"\(\d+ % of max_remote_size 4\.0 MiB\)", capsys.readouterr().out)


def test_a_write_over_the_cap_is_skipped_and_counted_never_raised(
    s3: tuple[S3Env, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    env, prefix = s3
    with _capped(env, prefix) as store:
        _wait_for_pass(store)
        # Injected: listings that take 3 s (a huge bucket), so eviction cannot keep up.
        tier = store.remote_tier
        inner = tier.inner  # type: ignore[union-attr]
        listing = inner.list_objects

        def slow_listing(prefix: str = "") -> Iterator[tuple[str, int, float]]:
            time.sleep(3)
            return listing(prefix)

        monkeypatch.setattr(inner, "list_objects", slow_listing)
        for h, p in chunks(24, size=PAYLOAD, seed=4):
            store.put(h, p, 256)
        assert store.flush(30)
        errors = store.stats().tiers["s3"].errors
        # It wrote up to the cap and its slack, then skipped: the prefix never went past them.
        assert _fill(env, prefix) <= CAP + CAP // 20
    assert errors.get("over_cap", 0) > 0


@pytest.mark.skipif(
    bool(os.environ.get("KVTIER_TEST_S3_CONFIG")), reason="needs radosgw-admin of the test RGW"
)
def test_writes_refused_by_the_bucket_quota_are_counted_and_reads_go_on(
    s3: tuple[S3Env, str],
) -> None:
    """The rgw_bucket role's quota, the backstop behind kvtier's cap: a writer without a cap
    runs into it; every refused write is counted (QuotaExceeded), none raises, and the circuit
    breaker stays closed, so what the bucket holds is still read."""
    env, prefix = s3
    cfg = load_config(env.write_config(prefix))
    with bucket_quota_with_room(env.bucket, 2 * MIB, make_boto3_client(cfg)):
        data = chunks(32, size=PAYLOAD, seed=5)  # 8 MiB against 2 MiB of room
        with TieredStore.from_config(cfg, FINGERPRINT) as store:
            for h, p in data:
                store.put(h, p, 256)
            assert store.flush(60)
            st = store.stats().tiers["s3"]
            stored = [h for h, _ in data if store.get(h) is not None]
            assert st.errors.get("QuotaExceeded", 0) > 0, st.errors
            assert st.circuit_open == 0
            assert 0 < len(stored) < len(data)
