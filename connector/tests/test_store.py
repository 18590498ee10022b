"""TieredStore over real CPU and disk tiers: prefix lookup, promotion, verification, stats."""

from __future__ import annotations

import os
import pickle
import shutil
import threading
from pathlib import Path

import pytest
from _helpers import FINGERPRINT, chunks

from kvtier.config import load_config
from kvtier.format import HEADER_SIZE
from kvtier.stats import FILL_FIELDS, StoreStats, read_stats_dir, store_deltas, without_fill
from kvtier.store import TieredStore
from kvtier.tiers.cpu import CpuSlabTier, CpuTier
from kvtier.tiers.disk import DiskTier


def _store(
    tmp_path: Path, cpu: int = 64 << 20, slab_slot: int | None = None, **kw: object
) -> TieredStore:
    """CPU (``slab_slot``: a slab of such slots, as the connector's worker has) and disk."""
    return TieredStore(
        [
            CpuTier(cpu) if slab_slot is None else CpuSlabTier(cpu, slab_slot),
            DiskTier(str(tmp_path / "disk"), 256 << 20),
        ],
        FINGERPRINT,
        **kw,  # type: ignore[arg-type]
    )


def test_put_get_lookup_and_promotion(tmp_path: Path) -> None:
    data = chunks(6)
    with _store(tmp_path) as store:
        for h, p in data[:4]:
            store.put(h, p, 256)
        assert store.flush(10)
        hashes = [h for h, _ in data]
        assert store.lookup_prefix(hashes) == 4
        assert store.lookup_prefix(hashes[1:]) == 3
        assert store.get(data[0][0]) == data[0][1]
        assert store.get(data[5][0]) is None
        # drop the CPU copy: the disk tier answers, and the chunk is promoted back to CPU
        store.tiers[0].delete(store.key(data[1][0]))
        assert store.get(data[1][0]) == data[1][1]
        assert store.tiers[0].contains(store.key(data[1][0]))
        assert store.get_many([h for h, _ in data]) == [p for _, p in data[:4]] + [None, None]
        st = store.stats()
    assert st.lookups == 2 and st.lookup_chunks == 11 and st.lookup_hit_chunks == 7
    assert st.tiers["disk"].hits == 1
    assert st.tiers["disk"].puts == 4
    assert st.get_hits == 6 and st.gets == 9


def test_restart_serves_from_disk(tmp_path: Path) -> None:
    data = chunks(3)
    with _store(tmp_path) as store:
        for h, p in data:
            store.put(h, p, 256)
    with _store(tmp_path) as store:  # a new process: empty CPU tier, disk index rebuilt
        assert store.lookup_prefix([h for h, _ in data]) == 3
        assert store.get_many([h for h, _ in data]) == [p for _, p in data]
        assert store.stats().tiers["disk"].hits == 3


def test_corrupt_chunk_is_a_counted_miss_and_removed(tmp_path: Path) -> None:
    data = chunks(2)
    with _store(tmp_path) as store:
        for h, p in data:
            store.put(h, p, 256)
    disk = DiskTier(str(tmp_path / "disk"), 256 << 20)
    path = disk._path(f"default/{FINGERPRINT}/{data[0][0]}")
    with open(path, "r+b") as f:
        f.seek(HEADER_SIZE + 100)
        byte = f.read(1)
        f.seek(HEADER_SIZE + 100)
        f.write(bytes([byte[0] ^ 0xFF]))
    with _store(tmp_path) as store:
        assert store.get(data[0][0]) is None
        assert store.get(data[1][0]) == data[1][1]
        st = store.stats()
    assert st.tiers["disk"].errors == {"checksum": 1}
    assert not os.path.exists(path)


def test_checksum_switch_is_test_only_negative_control(tmp_path: Path) -> None:
    h, p = chunks(1)[0]
    with _store(tmp_path, verify_checksums=False) as store:
        store.put(h, p, 256)
        item = store.tiers[0].get(store.key(h))
        assert item is not None
        bad = bytearray(item[1])
        bad[0] ^= 0xFF
        store.tiers[0].put(store.key(h), item[0], bytes(bad))
        got = store.get(h)
    assert got is not None and got != p  # without verification corrupted KV would be served


def test_other_layout_or_namespace_is_never_read(tmp_path: Path) -> None:
    h, p = chunks(1)[0]
    disk_dir = str(tmp_path / "disk")
    with TieredStore([DiskTier(disk_dir, 1 << 30)], FINGERPRINT) as store:
        store.put(h, p, 256)
    other_fp = "f" * 32
    with TieredStore([DiskTier(disk_dir, 1 << 30)], other_fp) as store:
        assert store.lookup_prefix([h]) == 0 and store.get(h) is None
    with TieredStore([DiskTier(disk_dir, 1 << 30)], FINGERPRINT, namespace="tenant2") as store:
        assert store.get(h) is None
    # a blob copied under another layout's key is rejected by its header
    src = DiskTier(disk_dir, 1 << 30)
    item = src.get(f"default/{FINGERPRINT}/{h}")
    assert item is not None
    src.put(f"default/{other_fp}/{h}", *item)
    with TieredStore([DiskTier(disk_dir, 1 << 30)], other_fp) as store:
        assert store.get(h) is None
        assert store.stats().tiers["disk"].errors == {"layout_mismatch": 1}


def test_chunk_id_with_a_namespace_is_filed_under_it(tmp_path: Path) -> None:
    """``<namespace>/<hash>`` (a request's own namespace) lands in that namespace only."""
    h, p = chunks(1)[0]
    disk_dir = str(tmp_path / "disk")
    with TieredStore([DiskTier(disk_dir, 1 << 30)], FINGERPRINT) as store:
        store.put(f"verify/{h}", p, 256)
        assert store.flush(10)
        assert store.get(h) is None  # not in the store's own namespace
        assert store.lookup_prefix([f"verify/{h}"]) == 1
        assert store.get(f"verify/{h}") == p
    assert (Path(disk_dir) / "verify" / FINGERPRINT).is_dir()
    assert not (Path(disk_dir) / "default").exists()


def test_broken_tier_is_a_miss_not_a_crash(tmp_path: Path) -> None:
    data = chunks(2)
    store = _store(tmp_path, cpu=1)  # CPU too small: everything goes to disk only
    disk_root = tmp_path / "disk"
    shutil.rmtree(disk_root)
    disk_root.write_text("not a directory")  # every disk operation now fails with an OSError
    for h, p in data:
        store.put(h, p, 256)
    assert store.flush(10)
    assert store.lookup_prefix([h for h, _ in data]) == 0
    assert store.get(data[0][0]) is None
    st = store.stats()
    store.close()
    assert st.tiers["cpu"].errors == {"too_large": 2}
    assert sum(st.tiers["disk"].errors.values()) >= 3, st.tiers["disk"].errors


def test_stats_merge_pickle_and_file(tmp_path: Path) -> None:
    cfg = load_config(
        {
            "local_disk": str(tmp_path / "disk"),
            "max_local_disk_size": 0.1,
            "max_local_cpu_size": 0.01,
        }
    )
    data = chunks(2)
    store = TieredStore.from_config(cfg, FINGERPRINT)
    for h, p in data:
        store.put(h, p, 256)
    store.flush(10)
    store.get(data[0][0])
    a = store.stats()
    store.close()
    b = pickle.loads(pickle.dumps(a))
    total = a + b
    assert total.puts == 4 and total.tiers["cpu"].hits == 2
    assert StoreStats.from_dict(total.to_dict()) == total
    assert a.merge(StoreStats()) == a
    files = read_stats_dir(cfg.stats_path or "")
    assert len(files) == 1 and next(iter(files.values())) == a


class _HeldDisk(DiskTier):
    """A disk tier whose writes wait until the test lets them go (a slow medium)."""

    def __init__(self, path: str) -> None:
        super().__init__(path, 256 << 20)
        self.go = threading.Event()
        self.writing = 0
        self.most_at_once = 0
        self._count = threading.Lock()

    def put(self, key: str, header: bytes, payload: bytes) -> None:
        with self._count:
            self.writing += 1
            self.most_at_once = max(self.most_at_once, self.writing)
        self.go.wait(10)
        try:
            super().put(key, header, payload)
        finally:
            with self._count:
                self.writing -= 1


def test_background_writes_are_bounded(tmp_path: Path) -> None:
    """While the disk tier is stuck, at most ``max_inflight_writes`` writes wait for it: the
    others are dropped at once (counted as backpressure), never queued; the CPU tier keeps
    every chunk, and once the disk moves the waiting writes land."""
    data = chunks(50, size=4096)
    disk = _HeldDisk(str(tmp_path / "disk"))
    with TieredStore([CpuTier(64 << 20), disk], FINGERPRINT, max_inflight_writes=2) as store:
        for h, p in data:
            store.put(h, p, 256)  # returns at once: nothing waits for the stuck disk
        st = store.stats()
        assert st.dropped_writes == 48 and st.tiers["disk"].errors == {"backpressure": 48}
        assert st.tiers["cpu"].puts == 50
        disk.go.set()
        assert store.flush(10)
        st = store.stats()
    assert st.tiers["disk"].puts == 2 and disk.most_at_once <= 2


@pytest.mark.parametrize("n", [0, 1, 40, 70])
def test_lookup_windows(tmp_path: Path, n: int) -> None:
    data = chunks(70, size=128)
    disk = DiskTier(str(tmp_path / "disk"), 1 << 30)
    with TieredStore([CpuTier(1 << 20), disk], FINGERPRINT) as store:
        for h, p in data[:n]:
            store.put(h, p, 256)
        store.flush(10)
        # only on disk for the second half: lookup must combine tiers
        for h, _ in data[n // 2 : n]:
            store.tiers[0].delete(store.key(h))
        assert store.lookup_prefix([h for h, _ in data]) == n


def test_tier_fill_is_reported_whole_first_then_by_change(tmp_path: Path) -> None:
    """What `kvtier:tier_used_bytes` / `_capacity_bytes` / `_evictions_total` are built from: a
    worker's first report carries the whole fill (from `without_fill`), later ones the change;
    a lookup-only store (the scheduler's) reports none of it."""
    size = HEADER_SIZE + 64 * 1024
    cpu_cap, disk_cap = 3 * size, 256 << 20
    data = chunks(4)
    with _store(tmp_path, cpu=cpu_cap) as store:
        store.put(*data[0][:2], 256)
        assert store.flush(10)
        start = without_fill(store.stats())
        for h, p in data[1:]:
            store.put(h, p, 256)
        assert store.flush(10)
        now = store.stats()
        first = store_deltas(start, now)
        assert first["tier.cpu.used_bytes"] == 3 * size  # a 4th chunk does not fit: 1 evicted
        assert first["tier.cpu.capacity_bytes"] == cpu_cap
        assert first["tier.cpu.evictions"] == 1
        assert first["tier.disk.used_bytes"] == 4 * size
        assert first["tier.disk.capacity_bytes"] == disk_cap
        store.delete(data[3][0])
        later = store_deltas(now, store.stats())
        assert later["tier.disk.used_bytes"] == -size and "tier.disk.capacity_bytes" not in later
        lookups_only = store_deltas(start, now, include_fill=False)
        assert not [k for k in lookups_only if k.rpartition(".")[2] in FILL_FIELDS]
        assert lookups_only["tier.disk.puts"] == 3


@pytest.mark.parametrize("slab", [False, True], ids=["bytes", "slab"])
def test_a_lent_view_is_written_by_the_tiers_then_given_back(tmp_path: Path, slab: bool) -> None:
    """A save slot lent to the store (kvtier.vllm.worker): the CPU tier keeps its own copy, the
    disk tier writes from the view, and `on_done` comes once the writes have ended; the
    buffer may then be reused without changing what the tiers hold."""
    data = chunks(2)
    slot = bytearray(b"".join(p for _, p in data))
    size = len(data[0][1])
    given_back: list[bool] = []
    with _store(tmp_path, slab_slot=size if slab else None) as store:
        views = [memoryview(slot)[i * size : (i + 1) * size] for i in range(2)]
        store.put_run(
            [(h, v, 256) for (h, _), v in zip(data, views, strict=True)],
            on_done=lambda: given_back.append(True),
        )
        assert store.flush(10)
        assert given_back == [True]
        slot[:] = bytes(len(slot))  # the slot is reused
        assert store.get_many([h for h, _ in data]) == [p for _, p in data]  # the CPU copies
        store.tiers[0].delete(store.key(data[0][0]))
        assert store.get(data[0][0]) == data[0][1]  # the disk tier's, written from the view


@pytest.mark.parametrize("slab", [False, True], ids=["bytes", "slab"])
def test_a_large_lent_run_goes_into_cpu_copies_the_slot_does_not_share(
    tmp_path: Path, slab: bool
) -> None:
    """A GPU step's run (here 4 chunks of 8 MiB, copied without the GIL: kvtier.hostmem): the
    CPU tier's copies (bytes, or slots of its slab) survive the slot's reuse, and every tier's
    blob verifies."""
    data = chunks(4, size=8 << 20, seed=3)
    slot = bytearray(b"".join(p for _, p in data))
    size = len(data[0][1])
    given_back: list[bool] = []
    with _store(
        tmp_path, cpu=256 << 20, slab_slot=size if slab else None, object_chunks=4
    ) as store:
        views = [memoryview(slot)[i * size : (i + 1) * size] for i in range(4)]
        store.put_run(
            [(h, v, 256) for (h, _), v in zip(data, views, strict=True)],
            on_done=lambda: given_back.append(True),
        )
        assert store.flush(10) and given_back == [True]
        slot[:] = bytes(len(slot))  # the slot is reused
        cpu = store.tiers[0]
        kept = [cpu.get(store.key(h)) for h, _ in data]
        assert all(item is not None for item in kept)
        kinds = {type(item[1]) for item in kept if item is not None}
        assert kinds == ({memoryview} if slab else {bytes})
        assert store.get_many([h for h, _ in data]) == [p for _, p in data]  # CPU, verified
        for h, _ in data:
            cpu.delete(store.key(h))
        assert store.get_many([h for h, _ in data]) == [p for _, p in data]  # disk, verified


def test_a_lent_view_comes_back_when_its_write_is_dropped(tmp_path: Path) -> None:
    data = chunks(1)
    given_back: list[bool] = []
    with _store(tmp_path, max_backlog_bytes=1) as store:  # every background write is refused
        store.put_run(
            [(data[0][0], memoryview(bytearray(data[0][1])), 256)],
            on_done=lambda: given_back.append(True),
        )
        assert given_back == [True] and store.stats().dropped_writes == 1


@pytest.mark.parametrize("pinned", [False, True], ids=["pageable", "pinned"])
def test_a_lower_tier_hit_is_served_from_a_pinned_cpu_tier_copy(
    tmp_path: Path, pinned: bool
) -> None:
    """A chunk read from disk is promoted into the CPU tier; where that tier is pinned (a slab
    on CUDA) the read returns the CPU tier's copy, so the load needs no bounce of its own."""
    data = chunks(2)
    size = len(data[0][1])
    pin = (lambda address, nbytes: lambda: None) if pinned else None
    tiers = [CpuSlabTier(64 << 20, size, pin), DiskTier(str(tmp_path / "disk"), 256 << 20)]
    with TieredStore(tiers, FINGERPRINT) as store:
        for h, p in data:
            store.put(h, p, 256)
        assert store.flush(10)
        for h, _ in data:
            store.tiers[0].delete(store.key(h))
        got = store.get_many([h for h, _ in data])
        assert got == [p for _, p in data]
        assert [type(p) for p in got] == [memoryview if pinned else bytes] * 2
        assert all(store.tiers[0].contains(store.key(h)) for h, _ in data)  # promoted
