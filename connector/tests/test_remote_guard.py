"""A remote tier that fails: the prefix search asks few times, the circuit breaker stops asking
a dead tier and lets it back in once a probe answers, warnings do not flood, background writes
stay within their byte budget, and a tier unusable at start is served without (or refused with
remote_required). A scripted tier stands in for S3 (the real endpoint's faults are the e2e
tests' and docs/reliability.md's)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator

import pytest

from kvtier.config import KvtierConfig, load_config
from kvtier.prefix import leading_present
from kvtier.ratelimit import RateLimitedLog
from kvtier.store import TieredStore
from kvtier.tiers.base import Stored, Tier, TierError
from kvtier.tiers.cpu import CpuTier
from kvtier.tiers.guard import CircuitBreaker, GuardedTier

FP = "ab" * 16


class ScriptedTier(Tier):
    """A remote tier whose keys are a set; ``fail`` makes every call raise that cause."""

    name = "s3"
    remote = True

    def __init__(self) -> None:
        self.keys: set[str] = set()
        self.fail = ""
        self.calls = 0
        self.probes = 0
        self.stall = threading.Event()

    def _check(self) -> None:
        self.calls += 1
        if self.fail:
            raise TierError(self.fail, f"scripted {self.fail}")

    def contains(self, key: str) -> bool:
        self._check()
        return key in self.keys

    def get(self, key: str) -> Stored | None:
        self._check()
        return None

    def put(self, key: str, header: bytes, payload: bytes) -> None:
        self._check()
        self.stall.wait(5)
        self.keys.add(key)

    def delete(self, key: str) -> None:
        self.keys.discard(key)

    def list_keys(self, prefix: str = "") -> Iterator[tuple[str, int]]:
        return iter([(k, 0) for k in self.keys if k.startswith(prefix)])

    def probe(self) -> None:
        self.probes += 1
        if self.fail:
            raise TierError(self.fail, "scripted probe")


def _stored(n: int, present: int) -> tuple[list[str], set[str]]:
    keys = [f"k{i:03d}" for i in range(n)]
    return keys, set(keys[:present])


@pytest.mark.parametrize("n", [1, 2, 3, 7, 64, 200])
def test_the_prefix_search_finds_the_exact_prefix_with_few_requests(n: int) -> None:
    for present in range(n + 1):
        keys, stored = _stored(n, present)
        found, asked = leading_present(lambda ks, s=stored: [k in s for k in ks], keys)
        assert found == present
        # a full hit or a full miss: at most two requests; otherwise a log4 search
        bound = 2 if present in (0, n) else 2 + 3 * (n.bit_length() // 2 + 1)
        assert asked <= bound, (n, present, asked)


def _breaker(tier: ScriptedTier, threshold: int = 3) -> CircuitBreaker:
    return CircuitBreaker("s3", tier.probe, threshold=threshold, retry_secs=0.05)


def test_the_breaker_opens_after_the_threshold_and_fails_fast() -> None:
    tier = ScriptedTier()
    guarded = GuardedTier(tier, _breaker(tier))
    tier.fail = "timeout"
    for _ in range(3):
        with pytest.raises(TierError):
            guarded.contains("x")
    assert guarded.breaker.state == "open"
    calls = tier.calls
    with pytest.raises(TierError) as err:
        guarded.contains("x")
    assert err.value.cause == "circuit_open" and tier.calls == calls  # not asked at all


def test_a_probe_that_answers_closes_the_breaker_without_a_restart() -> None:
    tier = ScriptedTier()
    guarded = GuardedTier(tier, _breaker(tier, threshold=1))
    tier.fail = "connection"
    with pytest.raises(TierError):
        guarded.contains("x")
    assert guarded.breaker.state == "open"
    deadline = time.monotonic() + 5
    while tier.probes < 2 and time.monotonic() < deadline:
        time.sleep(0.02)  # the background probes: nothing to wait on but their count
    assert tier.probes >= 2 and guarded.breaker.state == "open"  # probes that fail keep it open
    tier.fail = ""
    deadline = time.monotonic() + 5
    while guarded.breaker.state == "open" and time.monotonic() < deadline:
        time.sleep(0.02)  # the background probe: nothing to wait on but its state
    assert guarded.breaker.state == "closed"
    assert guarded.contains("x") is False
    assert (guarded.breaker.opened, guarded.breaker.closed) == (1, 1)
    guarded.close()


def test_corrupt_data_does_not_open_the_breaker() -> None:
    tier = ScriptedTier()
    breaker = _breaker(tier, threshold=1)
    breaker.failure("checksum")
    breaker.failure("layout_mismatch")
    assert breaker.state == "closed"
    breaker.close()


def test_a_full_quota_or_a_vanished_object_does_not_open_the_breaker() -> None:
    tier = ScriptedTier()
    breaker = _breaker(tier, threshold=1)
    for cause in ("QuotaExceeded", "404", "http_404", "NoSuchKey"):
        breaker.failure(cause)
    assert breaker.state == "closed"
    breaker.failure("http_403")  # refused credentials: the tier cannot be used
    assert breaker.state == "open"
    breaker.close()


def test_the_crt_client_reports_the_s3_error_code_of_a_refused_request() -> None:
    from kvtier.tiers.s3_crt import _s3_error_code

    refused = RuntimeError("AWS_ERROR_S3_INVALID_RESPONSE_STATUS")
    refused.body = b"<?xml version='1.0'?><Error><Code>QuotaExceeded</Code></Error>"  # type: ignore[attr-defined]
    assert _s3_error_code(refused) == "QuotaExceeded"
    assert _s3_error_code(RuntimeError("no body")) is None


def test_the_store_searches_the_remote_tier_and_counts_what_it_asked() -> None:
    tier = ScriptedTier()
    store = TieredStore([GuardedTier(tier, _breaker(tier))], FP)
    hashes = [f"{i:032x}" for i in range(64)]
    tier.keys = {store.key(h) for h in hashes[:40]}
    assert store.lookup_remote(hashes).found == 40
    stats = store.stats()
    assert stats.remote_lookups == 1 and 2 < stats.remote_lookup_requests <= 12
    store.close()


def test_a_dead_remote_tier_is_one_warning_not_one_per_chunk(
    caplog: pytest.LogCaptureFixture,
) -> None:
    tier = ScriptedTier()
    store = TieredStore([CpuTier(1 << 20), GuardedTier(tier, _breaker(tier, threshold=100))], FP)
    tier.fail = "timeout"
    with caplog.at_level(logging.WARNING, logger="kvtier"):
        for i in range(50):
            store.get(f"{i:032x}")
    warnings = [r for r in caplog.records if "failed (timeout)" in r.getMessage()]
    assert len(warnings) == 1
    assert store.stats().tiers["s3"].errors["timeout"] == 50
    store.close()


def test_rate_limited_warnings_say_how_many_were_held_back(
    caplog: pytest.LogCaptureFixture,
) -> None:
    warn = RateLimitedLog(logging.getLogger("kvtier.test"), every=0.05)
    with caplog.at_level(logging.WARNING, logger="kvtier.test"):
        for _ in range(5):
            warn.warning("k", "down")
        time.sleep(0.06)
        warn.warning("k", "down")
    assert [r.getMessage() for r in caplog.records][-1].startswith("kvtier: down (4 more like")


def test_background_writes_beyond_the_byte_budget_are_dropped_not_waited_for() -> None:
    tier = ScriptedTier()  # puts block until released: a hung bucket
    store = TieredStore([CpuTier(1 << 30), tier], FP, max_backlog_bytes=300_000)
    for i in range(10):
        store.put(f"{i:032x}", b"x" * 100_000, 256)  # about 100 KB each
    # Here while the bucket still hangs: the puts did not wait for it (they would have until
    # `stall` is set), and two writes wait in the background, the rest were dropped.
    assert not tier.stall.is_set() and tier.keys == set()
    stats = store.stats()
    assert stats.dropped_writes == 8 and stats.tiers["s3"].errors["backpressure"] == 8
    tier.stall.set()
    store.close()


def _config(**extra: object) -> KvtierConfig:
    values = {"local_cpu": True, "remote_url": "s3://bkt/kv", "aws_profile": "no-such-profile"}
    return load_config({**values, **extra})


def test_a_remote_tier_that_cannot_be_built_is_served_without(
    caplog: pytest.LogCaptureFixture, tmp_path: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("boto3")
    from kvtier.vllm.store_setup import RemoteTierUnavailable, open_store

    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent")
    with caplog.at_level(logging.WARNING, logger="kvtier"):
        store = open_store(_config(), FP, "worker")
    assert store is not None and store.remote_tier is None
    assert "profile 'no-such-profile' not found" in caplog.text
    assert "Serving without it (remote_required: false)" in caplog.text
    store.close()
    with pytest.raises(RemoteTierUnavailable, match="remote_required is true: refusing to start"):
        open_store(_config(remote_required=True), FP, "worker")


def test_a_remote_tier_that_fails_its_start_check_starts_open(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    pytest.importorskip("boto3")
    import kvtier.tiers.s3 as s3
    from kvtier.vllm.store_setup import RemoteTierUnavailable, open_store

    tier = ScriptedTier()
    tier.fail = "http_403"
    monkeypatch.setattr(s3, "make_s3_tier", lambda cfg: tier)
    with caplog.at_level(logging.WARNING, logger="kvtier"):
        store = open_store(_config(), FP, "scheduler")
    assert store is not None
    remote = store.remote_tier
    assert remote is not None and remote.breaker.state == "open"
    assert "the keys of profile no-such-profile are not accepted" in caplog.text
    store.close()
    with pytest.raises(RemoteTierUnavailable, match="http_403"):
        open_store(_config(remote_required=True), FP, "scheduler")
