"""Scheduler-side planning of the vLLM connector (pure bookkeeping, no vLLM needed)."""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import pytest
from _helpers import FINGERPRINT, chunks

from kvtier.keys import chunk_hashes
from kvtier.prefix import RemotePrefix
from kvtier.store import TieredStore
from kvtier.tiers.cpu import CpuTier
from kvtier.tiers.disk import DiskTier
from kvtier.vllm import scheduler as scheduler_module
from kvtier.vllm.scheduler import CpuTierIndex, SchedulerSettings, SchedulerSide
from kvtier.vllm.store_setup import StoreLookups

CHUNK, BLOCK = 256, 128


@dataclass
class FakeLookups:
    """The store as the scheduler side sees it (`ChunkLookups`): the chunks the local tiers
    hold, the remote tier's answer to every lookup (None: no remote tier), the chunks on disk;
    the lookups counted."""

    local: set[str] = field(default_factory=set)
    remote: Future[RemotePrefix] | None = None
    disk: set[str] = field(default_factory=set)
    counted: list[tuple[int, int]] = field(default_factory=list)

    def local_prefix(self, hashes: Sequence[str]) -> int:
        n = 0
        for h in hashes:
            if h not in self.local:
                break
            n += 1
        return n

    def remote_prefix(self, hashes: Sequence[str], start: int) -> Future[RemotePrefix] | None:
        return self.remote

    def count_lookup(self, asked: int, found: int) -> None:
        self.counted.append((asked, found))

    def on_disk(self, hashes: Sequence[str]) -> list[bool]:
        return [h in self.disk for h in hashes]


def make(found: Sequence[str] = (), save_unfull: bool = False) -> SchedulerSide:
    """Local tiers that hold ``found``, no remote tier."""
    settings = SchedulerSettings(chunk_size=CHUNK, block_size=BLOCK, save_unfull_chunk=save_unfull)
    return SchedulerSide(settings, FakeLookups(local=set(found)), CpuTierIndex(0))


def _first_step(
    s: SchedulerSide, req_id: str, blocks: Sequence[int], *, computed: int, scheduled: int
) -> None:
    """The step that schedules a request first: its blocks, what vLLM computed before it (its
    prefix cache, loads), what the step computes."""
    s.on_scheduled(
        req_id,
        block_ids=blocks,
        replace_blocks=True,
        num_computed_tokens=computed,
        num_scheduled_tokens=scheduled,
    )


def test_never_offers_the_whole_prompt() -> None:
    prompt = list(range(512))  # exactly two chunks, both stored
    s = make(chunk_hashes(prompt, CHUNK))
    # 511 tokens may be loaded at most; block-aligned that is 384: vLLM computes the rest.
    assert s.num_new_matched_tokens("r", prompt, 0) == 384


def test_chunked_prefill_saves_each_chunk_when_its_last_token_is_computed() -> None:
    prompt = list(range(1000))
    s = make(save_unfull=True)
    assert s.num_new_matched_tokens("r", prompt, 0) == 0
    blocks = list(range(10, 18))  # 8 blocks of 128 tokens cover the 1000-token prompt
    saved: list[tuple[int, ...]] = []
    computed = 0
    for step, size in enumerate((300, 300, 300, 100)):
        s.on_scheduled(
            "r",
            block_ids=blocks if step == 0 else None,
            replace_blocks=step == 0,
            num_computed_tokens=computed,
            num_scheduled_tokens=size,
        )
        computed += size
        plan = s.take_plan()
        assert not plan.loads
        saved.append(tuple(len(sp.block_ids) for sp in plan.saves))
    # chunk 0 after 300 tokens, chunk 1 after 600, chunk 2 after 900, then the partial chunk
    # (232 tokens: only its one fully written block).
    assert saved == [(2,), (2,), (2,), (1,)]


def test_partial_chunk_not_saved_by_default() -> None:
    prompt = list(range(1000))
    s = make()
    s.num_new_matched_tokens("r", prompt, 0)
    _first_step(s, "r", list(range(8)), computed=0, scheduled=1000)
    assert [sp.num_tokens for sp in s.take_plan().saves] == [256, 256, 256]


def test_load_plan_skips_locally_cached_blocks_and_does_not_resave() -> None:
    prompt = list(range(1000))
    hashes = chunk_hashes(prompt, CHUNK)
    s = make(hashes[:3])
    # vLLM's own prefix cache already holds the first block (128 tokens).
    assert s.num_new_matched_tokens("r", prompt, 128) == 768 - 128
    s.after_alloc("r", 640)
    _first_step(s, "r", list(range(100, 108)), computed=768, scheduled=232)
    plan = s.take_plan()
    assert [(ld.chunk_hash, ld.first, ld.block_ids) for ld in plan.loads] == [
        (hashes[0], 1, (101,)),
        (hashes[1], 0, (102, 103)),
        (hashes[2], 0, (104, 105)),
    ]
    assert sum(ld.num_tokens for ld in plan.loads) == 640
    assert plan.saves == []  # all three full chunks are stored already
    assert s.counters.take()["hit_tokens"] == 640


def test_cpu_index_is_a_bounded_lru() -> None:
    idx = CpuTierIndex(2)
    for h in ("a", "b", "c"):
        idx.add(h)
    assert idx.leading(["a"]) == 0
    assert idx.leading(["b", "c"]) == 2


def test_chunk_size_must_be_a_multiple_of_block_size() -> None:
    with pytest.raises(ValueError, match=r"chunk_size .* multiple of vLLM's block size"):
        SchedulerSettings(chunk_size=200, block_size=128)


def test_request_namespace_prefixes_every_chunk_id() -> None:
    prompt = list(range(600))
    stored = [f"verify/{h}" for h in chunk_hashes(prompt, CHUNK)]
    s = make(stored)
    # chunks stored under the default namespace do not count for a request in "verify"
    assert make(chunk_hashes(prompt, CHUNK)).num_new_matched_tokens("r", prompt, 0, "verify") == 0
    assert s.num_new_matched_tokens("r", prompt, 0, "verify") == 512
    fresh = make()
    fresh.num_new_matched_tokens("n", prompt, 0, "verify")
    _first_step(fresh, "n", list(range(5)), computed=0, scheduled=600)
    assert [sv.chunk_hash for sv in fresh.take_plan().saves] == stored


def test_bypassed_request_is_neither_loaded_nor_saved() -> None:
    prompt = list(range(600))
    s = make(chunk_hashes(prompt, CHUNK))
    s.bypass("r", "unknown_extra_key")
    assert s.num_new_matched_tokens("r", prompt, 0) == 0
    assert s.counters.take()["uncached_requests.unknown_extra_key"] == 1
    _first_step(s, "r", list(range(5)), computed=0, scheduled=600)
    plan = s.take_plan()
    assert not plan.loads and not plan.saves


def test_a_request_never_looked_up_is_never_saved() -> None:
    """Its identity beyond the tokens was never keyed: no save under a tokens-only key."""
    s = make()
    _first_step(s, "r", list(range(5)), computed=0, scheduled=600)
    assert not s.take_plan().saves


def test_extra_keys_give_other_chunk_keys_from_the_first_differing_chunk() -> None:
    prompt = list(range(600))
    s = make()
    s.num_new_matched_tokens("plain", prompt, 0)
    s.num_new_matched_tokens("salted", prompt, 0, extras=[b"salt", b""])
    for name in ("plain", "salted"):
        _first_step(s, name, list(range(5)), computed=0, scheduled=600)
    keys: dict[str, list[str]] = {}
    for spec in s.take_plan().saves:
        keys.setdefault(spec.req_id, []).append(spec.chunk_hash)
    assert keys["plain"] == chunk_hashes(prompt, CHUNK)
    assert all(a != b for a, b in zip(keys["plain"], keys["salted"], strict=True))


def _remote(
    answer: Future[RemotePrefix], object_chunks: int = 1, background_loads: bool = False
) -> SchedulerSide:
    """Local tiers that hold nothing, a remote tier whose lookup answers ``answer``."""
    settings = SchedulerSettings(
        chunk_size=CHUNK,
        block_size=BLOCK,
        lookup_timeout=0.2,
        object_chunks=object_chunks,
        background_loads=background_loads,
    )
    return SchedulerSide(settings, FakeLookups(remote=answer), CpuTierIndex(0))


def test_a_pending_remote_lookup_answers_not_yet_then_the_hit() -> None:
    prompt = list(range(1024))  # four chunks
    answer: Future[RemotePrefix] = Future()
    s = _remote(answer)
    assert s.num_new_matched_tokens("r", prompt, 0) is None  # vLLM schedules others meanwhile
    answer.set_result(RemotePrefix(found=4))
    assert s.num_new_matched_tokens("r", prompt, 0) == 896
    assert s.counters.take()["remote_lookups"] == 1


def test_a_remote_lookup_that_does_not_answer_in_time_is_a_miss_not_a_wait(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On the scheduler's clock: "not yet" while the lookup is younger than lookup_timeout
    (0.2 s here), then served without the remote tier, counted once."""
    clock = [100.0]
    monkeypatch.setattr(scheduler_module, "time", SimpleNamespace(monotonic=lambda: clock[0]))
    prompt = list(range(1024))
    s = _remote(Future())  # never answers: a black-holed endpoint
    assert s.num_new_matched_tokens("r", prompt, 0) is None
    clock[0] += 0.19
    assert s.num_new_matched_tokens("r", prompt, 0) is None
    assert s.counters.take()["lookup_timeouts"] == 0
    clock[0] += 0.02
    assert s.num_new_matched_tokens("r", prompt, 0) == 0
    assert s.counters.take()["lookup_timeouts"] == 1


def test_a_failing_remote_lookup_is_a_miss() -> None:
    answer: Future[RemotePrefix] = Future()
    answer.set_exception(RuntimeError("boom"))
    assert _remote(answer).num_new_matched_tokens("r", list(range(1024)), 0) == 0


# ------------------------------------------------------------------ runs of chunks per S3 object
def _scheduler(
    runs: int, remote: RemotePrefix | None = None, background_loads: bool = False
) -> SchedulerSide:
    """A remote tier that holds ``remote`` (nothing: None); saves cut into ``runs``."""
    answer: Future[RemotePrefix] = Future()
    answer.set_result(remote or RemotePrefix())
    return _remote(answer, object_chunks=runs, background_loads=background_loads)


def _step(s: SchedulerSide, prompt: list[int], computed: int, scheduled: int) -> None:
    s.on_scheduled(
        "r",
        block_ids=list(range(len(prompt) // BLOCK + 1)) if computed == 0 else None,
        replace_blocks=computed == 0,
        num_computed_tokens=computed,
        num_scheduled_tokens=scheduled,
    )


def test_saves_are_runs_saved_once_their_last_chunk_is_computed() -> None:
    prompt = list(range(10 * CHUNK + 100))  # 10 full chunks and a partial one
    s = _scheduler(runs=4)
    assert s.num_new_matched_tokens("r", prompt, 0) == 0
    _step(s, prompt, 0, 2048)  # chunks 0-7 computed: runs 0-3 and 4-7
    saves = s.take_plan().saves
    hashes = chunk_hashes(prompt, CHUNK)
    assert [x.chunk_hash for x in saves] == hashes[:8]
    assert [x.object_hash for x in saves] == [hashes[0]] * 4 + [hashes[4]] * 4
    _step(s, prompt, 2048, 2048)  # 2048..4096: chunks 8, 9 (the last run, short) and the rest
    saves = s.take_plan().saves
    assert [x.chunk_hash for x in saves] == hashes[8:10]
    assert {x.object_hash for x in saves} == {hashes[8]}


def test_a_run_waits_for_its_last_chunk_across_steps() -> None:
    prompt = list(range(8 * CHUNK + 1))
    s = _scheduler(runs=8)
    s.num_new_matched_tokens("r", prompt, 0)
    _step(s, prompt, 0, 1024)  # chunks 0-3 of an 8-chunk run
    assert s.take_plan().saves == []
    _step(s, prompt, 1024, 1024)
    saves = s.take_plan().saves
    assert len(saves) == 8 and {x.object_hash for x in saves} == {saves[0].chunk_hash}
    assert saves[0].block_ids == (0, 1)  # the first chunk's blocks, still the request's


def test_loads_name_the_object_of_each_chunk_and_saves_start_where_the_tier_ends() -> None:
    prompt = list(range(12 * CHUNK + 1))
    hashes = chunk_hashes(prompt, CHUNK)
    found = RemotePrefix(found=6, objects=((0, 4), (4, 2)), requests=2)
    s = _scheduler(runs=4, remote=found)
    assert s.num_new_matched_tokens("r", prompt, 0) == 6 * CHUNK
    s.after_alloc("r", 6 * CHUNK)
    _step(s, prompt, 0, 12 * CHUNK + 1)
    plan = s.take_plan()
    assert [(x.object_hash, x.position) for x in plan.loads] == [
        (hashes[0], 0),
        (hashes[0], 1),
        (hashes[0], 2),
        (hashes[0], 3),
        (hashes[4], 0),
        (hashes[4], 1),
    ]
    # new chunks 6..11: runs of 4 from chunk 6 on, where the next walk will look for them
    assert [x.chunk_hash for x in plan.saves] == hashes[6:12]
    assert [x.object_hash for x in plan.saves] == [hashes[6]] * 4 + [hashes[10]] * 2


def test_a_load_from_s3_is_planned_in_the_background_when_asked() -> None:
    """With background loads (enable_async_loading), a hit from S3 is planned right after the
    blocks are allocated, marked for the background, into the blocks vLLM gave; without,
    it waits until the request is scheduled."""
    prompt = list(range(4 * CHUNK + 1))
    found = RemotePrefix(found=4, objects=((0, 4),), requests=1)
    s = _scheduler(runs=4, remote=found, background_loads=True)
    assert s.num_new_matched_tokens("r", prompt, 0) == 4 * CHUNK
    assert s.loads_in_background("r")
    s.after_alloc("r", 4 * CHUNK, block_ids=list(range(100, 109)))
    loads = s.take_plan().loads
    assert len(loads) == 4 and all(x.background for x in loads)
    assert loads[0].block_ids == (100, 101) and loads[3].block_ids == (106, 107)
    quiet = _scheduler(runs=4, remote=found)
    quiet.num_new_matched_tokens("r", prompt, 0)
    assert not quiet.loads_in_background("r")


def _on(s: SchedulerSide, req_id: str, prompt: list[int], blocks: int) -> None:
    """One step that computes the whole prompt of ``req_id``."""
    _first_step(s, req_id, list(range(blocks)), computed=0, scheduled=len(prompt))


@pytest.mark.parametrize("shorter_first", [True, False])
def test_a_prompt_and_its_continuation_in_flight_save_each_chunk_in_one_object(
    shorter_first: bool,
) -> None:
    """A prompt of 10 chunks and its continuation of 11, both looked up before either saved:
    the one planned second starts its run after the chunks the first planned, so no two runs
    share a first chunk (one S3 key: the shorter object, landing last, dropped the other's
    chunk 10 in kvtier bench soak)."""
    prompt = list(range(10 * CHUNK))
    longer = prompt + list(range(50_000, 50_000 + CHUNK))
    hashes = chunk_hashes(longer, CHUNK)
    s = _scheduler(runs=32)
    order = [("a", prompt), ("b", longer)] if shorter_first else [("b", longer), ("a", prompt)]
    for req_id, p in order:
        assert s.num_new_matched_tokens(req_id, p, 0) == 0
    saved: dict[str, list[tuple[str, str]]] = {}
    for req_id, p in order:
        _on(s, req_id, p, len(p) // BLOCK)
        saved[req_id] = [(x.chunk_hash, x.object_hash) for x in s.take_plan().saves]
    if shorter_first:  # a: chunks 0-9 in one object; b: only chunk 10, in an object of its own
        assert saved == {"a": [(h, hashes[0]) for h in hashes[:10]], "b": [(hashes[10],) * 2]}
    else:  # b saved all 11 in one object; a, a prefix of it, saves nothing
        assert saved == {"b": [(h, hashes[0]) for h in hashes], "a": []}


def test_a_chunk_another_request_saved_long_ago_is_saved_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Past _REMOTE_SAVE_SECS the other save has landed (a lookup finds it) or failed: a
    request that did not find the chunk saves it."""
    prompt = list(range(2 * CHUNK))
    s = _scheduler(runs=4)
    for req_id in ("a", "b"):
        s.num_new_matched_tokens(req_id, prompt, 0)
    _on(s, "a", prompt, 4)
    assert len(s.take_plan().saves) == 2
    now = scheduler_module.time.monotonic()
    monkeypatch.setattr(
        scheduler_module.time, "monotonic", lambda: now + scheduler_module._REMOTE_SAVE_SECS
    )
    _on(s, "b", prompt, 4)
    assert len(s.take_plan().saves) == 2


def test_a_chunk_whose_load_failed_is_saved_again_as_it_is_recomputed() -> None:
    """A rank that lacks a chunk the lookup found (on rank 0) reports its blocks invalid: from
    that chunk on, the recomputed chunks are saved again (by every rank), so the next request
    hits everywhere."""
    prompt = list(range(1000))
    hashes = chunk_hashes(prompt, CHUNK)
    s = make(hashes)  # all 3 full chunks found
    assert s.num_new_matched_tokens("r", prompt, 0) == 768
    s.after_alloc("r", 768)
    blocks = list(range(100, 108))
    _first_step(s, "r", blocks, computed=768, scheduled=232)
    assert not s.take_plan().saves  # stored already
    s.loads_failed({blocks[2]})  # chunk 1's first block
    # vLLM recomputes from chunk 1 (token 256) on: chunks 1 and 2 are saved again.
    s.on_scheduled(
        "r",
        block_ids=None,
        replace_blocks=False,
        num_computed_tokens=256,
        num_scheduled_tokens=744,
    )
    assert [sv.chunk_hash for sv in s.take_plan().saves] == hashes[1:]
    s.loads_failed({999})  # a block of no request: nothing changes
    assert not s.take_plan().saves


# ------------------------------------------------------------------ what the store is asked
def test_hit_sources_name_the_tier_of_each_loaded_token() -> None:
    """Chunk 0 in the worker's CPU tier (the scheduler's index of it), chunk 1 on disk, the
    rest in the remote tier; the lookup is counted once, with what all tiers hold."""
    prompt = list(range(4 * CHUNK + 1))
    hashes = chunk_hashes(prompt, CHUNK)
    answer: Future[RemotePrefix] = Future()
    answer.set_result(RemotePrefix(found=4))
    lookups = FakeLookups(local={hashes[1]}, disk={hashes[1]}, remote=answer)
    cpu = CpuTierIndex(10)
    cpu.add(hashes[0])
    s = SchedulerSide(SchedulerSettings(chunk_size=CHUNK, block_size=BLOCK), lookups, cpu)
    assert s.num_new_matched_tokens("r", prompt, 0) == 4 * CHUNK
    assert s.hit_sources("r", 4 * CHUNK) == {"cpu": CHUNK, "disk": CHUNK, "s3": 2 * CHUNK}
    assert s.num_new_matched_tokens("r", prompt, 0) == 4 * CHUNK  # looked up once
    assert lookups.counted == [(4, 4)]


def test_store_lookups_ask_the_scheduler_store(tmp_path: Path) -> None:
    """The connector's `ChunkLookups`: the local tiers and the disk tier of its store, asked
    now; no remote tier, no remote lookup. Without a store, no tier holds anything."""
    data = chunks(3, size=1024)
    hashes = [h for h, _ in data]
    disk = DiskTier(str(tmp_path / "disk"), 1 << 20)
    with TieredStore([CpuTier(1 << 20), disk], FINGERPRINT) as store:
        for h, payload in data[:2]:
            store.put(h, payload, CHUNK)
        assert store.flush(10)
        store.tiers[0].delete(store.key(hashes[0]))  # on disk only
        store.tiers[1].delete(store.key(hashes[1]))  # in the CPU tier only
        lookups = StoreLookups(store)
        assert lookups.local_prefix(hashes) == 2
        assert lookups.on_disk(hashes) == [True, False, False]
        assert lookups.remote_prefix(hashes, 2) is None
        lookups.count_lookup(3, 2)
        stats = store.stats()
        assert (stats.lookups, stats.lookup_chunks, stats.lookup_hit_chunks) == (1, 3, 2)
        lookups.close()
    nothing = StoreLookups(None)
    assert nothing.local_prefix(hashes) == 0
    assert nothing.on_disk(hashes) == [False] * 3
    assert nothing.remote_prefix(hashes, 0) is None
    nothing.count_lookup(3, 0)
    nothing.close()
