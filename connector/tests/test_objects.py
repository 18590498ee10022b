"""Runs of chunks in one remote object: the format, the walk that finds them, and the store
that writes and reads them (the scheduler's side, runs of saves and the object of each load:
test_vllm_scheduler.py). An in-memory tier that keeps objects and their chunk lists as S3 does
stands in for RGW (test_s3_integration.py runs the same on the real one)."""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence

from _helpers import FINGERPRINT, chunks

from kvtier.format import (
    HEADER_SIZE,
    FormatError,
    chunks_per_object,
    decode_chunk_list,
    encode_chunk_list,
    pack_header,
    short_hash,
    split_object,
)
from kvtier.keys import chunk_hashes
from kvtier.prefix import RemotePrefix, walk_objects
from kvtier.store import ChunkRef, TieredStore
from kvtier.tiers.base import Stored, Tier
from kvtier.tiers.cpu import CpuTier

LAYOUT = bytes.fromhex(FINGERPRINT)


class ObjectTier(Tier):
    """Objects as S3 keeps them: a body and a chunk list per key; counts GETs and HEADs."""

    name = "s3"
    remote = True

    def __init__(self) -> None:
        self.objects: dict[str, tuple[bytes, str]] = {}
        self.gets = 0
        self.heads_asked = 0

    def contains(self, key: str) -> bool:
        return key in self.objects

    def heads(self, keys: Sequence[str]) -> list[list[str] | None]:
        self.heads_asked += len(keys)
        return [decode_chunk_list(self.objects[k][1]) if k in self.objects else None for k in keys]

    def get(self, key: str) -> Stored | None:
        self.gets += 1
        if key not in self.objects:
            return None
        body = self.objects[key][0]
        return body[:HEADER_SIZE], body[HEADER_SIZE:]

    def put(self, key: str, header: bytes, payload: bytes) -> None:
        self.put_object(key, (header, payload), "")

    def put_object(self, key: str, parts: Sequence[bytes], chunk_list: str) -> None:
        self.objects[key] = (b"".join(parts), chunk_list)

    def delete(self, key: str) -> None:
        self.objects.pop(key, None)

    def list_keys(self, prefix: str = "") -> Iterator[tuple[str, int]]:
        return iter([(k, len(v[0])) for k, v in self.objects.items() if k.startswith(prefix)])


def _blob(chunk_hash: str, payload: bytes) -> list[bytes]:
    return [pack_header(LAYOUT, bytes.fromhex(chunk_hash), 256, payload), payload]


# ------------------------------------------------------------------------------------ format
def test_an_object_of_several_chunks_splits_back_into_its_blobs() -> None:
    data = chunks(3, size=1000)
    parts = [part for h, p in data for part in _blob(h, p)]
    body = b"".join(parts)
    blobs, broken = split_object(body[:HEADER_SIZE], body[HEADER_SIZE:])
    assert [b[1] for b in blobs] == [p for _, p in data] and broken is None
    one, _ = split_object(parts[0], parts[1])
    assert one[0][1] is parts[1]  # one chunk: the payload as read, no copy
    # A damaged object: the blobs before the damage, and what broke the walk.
    blobs, broken = split_object(body[:HEADER_SIZE], body[HEADER_SIZE:-1])
    assert len(blobs) == 2 and isinstance(broken, FormatError) and broken.cause == "truncated"
    blobs, broken = split_object(
        body[:HEADER_SIZE], body[HEADER_SIZE : HEADER_SIZE + 1000] + os.urandom(80)
    )
    assert len(blobs) == 1 and broken is not None and broken.cause == "bad_magic"


def test_chunk_lists_and_chunks_per_object() -> None:
    ids = [f"ns/{h}" for h in chunk_hashes(list(range(768)), 256)]
    listed = decode_chunk_list(encode_chunk_list(ids))
    assert listed == [short_hash(i) for i in ids] and len(listed[0]) == 16
    assert decode_chunk_list(None) == [] and decode_chunk_list("") == []
    # the tiny model's 256 KiB chunks: 8 MiB objects; a 7B model's 14 MiB chunk alone
    assert chunks_per_object(256 * 1024) == 32
    assert chunks_per_object(14 << 20) == 1
    assert chunks_per_object(14 << 20, configured=2) == 2
    assert chunks_per_object(100, configured=500) == 64


# ------------------------------------------------------------------------------------ walk
def _walk(tier: ObjectTier, hashes: list[str], span: int) -> RemotePrefix:
    return walk_objects(tier.heads, hashes, [short_hash(h) for h in hashes], span)


def _put(tier: ObjectTier, hashes: list[str], first: int, count: int) -> None:
    ids = hashes[first : first + count]
    tier.objects[hashes[first]] = (b"", encode_chunk_list(ids))


def test_the_walk_follows_aligned_objects_in_one_round() -> None:
    hashes = chunk_hashes(list(range(64 * 16)), 16)  # 64 chunks
    tier = ObjectTier()
    for first in range(0, 64, 16):
        _put(tier, hashes, first, 16)
    found = _walk(tier, hashes, 16)
    assert found.found == 64 and found.requests == 4
    assert found.objects == ((0, 16), (16, 16), (32, 16), (48, 16))
    assert found.object_of(37) == (32, 5) and found.object_of(48) == (48, 0)
    assert RemotePrefix(4, ((0, 4),)).object_of(6) == (6, 0)  # in no object: one of its own
    # a longer prompt with the same first 40 chunks: the third object holds 8 of ours
    longer = [*hashes[:40], *chunk_hashes(list(range(5000, 5000 + 30 * 16)), 16)]
    other = _walk(tier, longer, 16)
    assert other.found == 40 and other.objects[-1] == (32, 8)


def test_a_run_that_went_on_with_another_prompt_is_followed_by_this_prompts_own() -> None:
    """Prompt B shares A's first 6 chunks; A's object 0 holds chunks 0-7, so B stored its own
    chunks from 6 on in an object of its own: B's walk goes 0 (6 of 8 are B's), then 6."""
    a = chunk_hashes(list(range(16 * 16)), 16)
    b = [*a[:6], *chunk_hashes(list(range(9000, 9000 + 10 * 16)), 16)]
    tier = ObjectTier()
    _put(tier, a, 0, 8)
    _put(tier, a, 8, 8)
    _put(tier, b, 6, 8)
    walked = _walk(tier, b, 8)
    assert walked.found == 14 and walked.objects == ((0, 6), (6, 8))
    assert _walk(tier, a, 8).found == 16
    # nothing past an absent object; an object under our key that holds another chunk is
    # unusable
    assert _walk(ObjectTier(), b, 8) == RemotePrefix(0, (), 2)  # one round: chunks 0 and 8
    tier.objects[b[0]] = (b"", encode_chunk_list([a[7]]))
    assert _walk(tier, b, 8).found == 0


# ------------------------------------------------------------------------------------ store
def _store(tier: Tier, runs: int, cpu: int = 0) -> TieredStore:
    tiers: list[Tier] = [CpuTier(cpu)] if cpu else []
    return TieredStore([*tiers, tier], FINGERPRINT, object_chunks=runs)


def test_a_run_is_one_object_and_each_chunk_reads_back_from_it() -> None:
    tier = ObjectTier()
    data = chunks(10, size=4096)
    hashes = [h for h, _ in data]
    with _store(tier, runs=4) as store:
        for first in range(0, 10, 4):
            store.put_run([(h, p, 256) for h, p in data[first : first + 4]])
        assert store.flush(10)
        assert len(tier.objects) == 3  # 4 + 4 + 2 chunks
        found = store.lookup_remote(hashes)
        assert found.found == 10
        refs = [
            ChunkRef(h, hashes[found.object_of(k)[0]], found.object_of(k)[1])
            for k, h in enumerate(hashes)
        ]
        tier.gets = 0
        assert store.get_many(refs) == [p for _, p in data]
        assert tier.gets == 3  # one GET per object
        st = store.stats()
    assert st.tiers["s3"].hits == 10 and st.tiers["s3"].puts == 10
    assert st.tiers["s3"].errors == {}


def test_a_chunk_the_object_does_not_hold_where_the_lookup_saw_it_is_dropped() -> None:
    """Under the chunk list a lookup read, the object holds other chunks (overwritten since,
    or damaged): the first such chunk drops the object, as a blob under a wrong key would be."""
    tier = ObjectTier()
    a, b = chunks(4, size=2048, seed=1), chunks(4, size=2048, seed=2)
    with _store(tier, runs=4) as store:
        store.put_run([(h, p, 256) for h, p in a])
        store.flush(10)
        got = store.get_many([ChunkRef(a[0][0], a[0][0], 0), ChunkRef(b[1][0], a[0][0], 1)])
        st = store.stats()
    assert got == [a[0][1], None]
    assert st.tiers["s3"].errors == {"key_mismatch": 1} and tier.objects == {}


def test_a_damaged_object_is_dropped_and_counted() -> None:
    tier = ObjectTier()
    data = chunks(3, size=2048)
    with _store(tier, runs=3) as store:
        store.put_run([(h, p, 256) for h, p in data])
        store.flush(10)
        key = store.key(data[0][0])
        body, listed = tier.objects[key]
        damaged = bytearray(body)
        damaged[2 * (HEADER_SIZE + 2048) + HEADER_SIZE + 5] ^= 1  # the third chunk's payload
        tier.objects[key] = (bytes(damaged), listed)
        refs = [ChunkRef(h, data[0][0], i) for i, (h, _) in enumerate(data)]
        got = store.get_many(refs)
        st = store.stats()
    assert got == [data[0][1], data[1][1], None]
    assert st.tiers["s3"].errors == {"checksum": 1} and tier.objects == {}


def test_chunks_read_from_an_object_are_promoted_into_the_cpu_tier() -> None:
    tier = ObjectTier()
    data = chunks(4, size=2048)
    with _store(tier, runs=4, cpu=1 << 20) as store:
        store.put_run([(h, p, 256) for h, p in data])
        store.flush(10)
        store.tiers[0] = CpuTier(1 << 20)  # a restart: the CPU tier is empty
        store.get_many([ChunkRef(h, data[0][0], i) for i, (h, _) in enumerate(data)])
        gets = tier.gets
        assert store.get_many([h for h, _ in data]) == [p for _, p in data]
        assert tier.gets == gets  # the second read is local


def test_a_run_goes_to_the_tiers_its_save_names() -> None:
    """The remote tier's admission rule (kvtier.admission): "local" runs skip the remote tier,
    "remote" runs (a late admission) write it only; "all" writes both."""
    tier = ObjectTier()
    data = chunks(6, size=2048)
    with _store(tier, runs=2, cpu=1 << 20) as store:
        cpu = store.tiers[0]
        store.put_run([(h, p, 256) for h, p in data[:2]], tiers="local")
        store.put_run([(h, p, 256) for h, p in data[2:4]], tiers="remote")
        store.put_run([(h, p, 256) for h, p in data[4:]])
        assert store.flush(10)
        held = [cpu.contains(store.key(h)) for h, _ in data]
        assert held == [True, True, False, False, True, True]
        assert set(tier.objects) == {store.key(data[2][0]), store.key(data[4][0])}
