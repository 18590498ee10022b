"""Admission to the remote tier (``remote_admit_after``, kvtier.admission) as the scheduler side
plans it: a chunk computed before its prefix was seen often enough is saved to the local tiers
only; on the sight that admits it, a chunk the local tiers hold is saved to the remote tier from
the request's blocks (late admission), and one no tier holds is saved to every tier. Counts are
kept in a bounded table. The tiers themselves take what the plan says (`TieredStore.put_run`,
test_store.py) and the worker drops a late admission whose load failed (test_vllm_worker.py)."""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future

import pytest

from kvtier.admission import Admission, SightCounter
from kvtier.keys import chunk_hashes
from kvtier.prefix import RemotePrefix
from kvtier.vllm.scheduler import CpuTierIndex, SchedulerSettings, SchedulerSide
from kvtier.vllm.step_plan import SaveSpec

CHUNK, BLOCK = 256, 128
PROMPT = list(range(3 * CHUNK + 1))  # three full chunks and the token vLLM always computes
HASHES = chunk_hashes(PROMPT, CHUNK)


def test_sights_are_counted_for_the_most_recent_chunks_only() -> None:
    sights = SightCounter(capacity=3)
    assert sights.see(["a", "b"]) == [1, 1]
    assert sights.see(["a", "c"]) == [2, 1]
    assert sights.see(["d"]) == [1]  # "b", the least recently seen, is forgotten
    assert len(sights) == 3
    assert sights.see(["b", "a"]) == [1, 3]
    with pytest.raises(ValueError, match="at least one chunk"):
        SightCounter(0)


def test_admit_after_one_counts_nothing_and_admits_everything() -> None:
    rule = Admission(after=1, window_chunks=10)
    assert rule.see(["a", "a", "b"]) == [1, 1, 1]
    assert rule.admits(1) and not rule.admits_now(1)
    with pytest.raises(ValueError, match="remote_admit_after must be at least 1"):
        Admission(after=0, window_chunks=10)


class _RemoteOnly:
    """The store as the scheduler side sees it (`ChunkLookups`): its local tiers hold nothing,
    its remote tier answers every lookup with ``answer``."""

    def __init__(self, answer: Future[RemotePrefix]) -> None:
        self.answer = answer

    def local_prefix(self, hashes: Sequence[str]) -> int:
        return 0

    def remote_prefix(self, hashes: Sequence[str], start: int) -> Future[RemotePrefix] | None:
        return self.answer

    def count_lookup(self, asked: int, found: int) -> None:
        return

    def on_disk(self, hashes: Sequence[str]) -> list[bool]:
        return [False] * len(hashes)


def _scheduler(
    after: int = 2,
    *,
    runs: int = 1,
    remote: RemotePrefix | None = None,
    local_tiers: bool = True,
) -> SchedulerSide:
    """A CPU tier (the scheduler's index of it), and a remote tier whose lookup answers
    ``remote`` (nothing by default), admitting chunks from their ``after``-th sight."""
    answer: Future[RemotePrefix] = Future()
    answer.set_result(remote or RemotePrefix())
    settings = SchedulerSettings(
        chunk_size=CHUNK,
        block_size=BLOCK,
        object_chunks=runs,
        admission=Admission(after, window_chunks=1000),
        local_tiers=local_tiers,
    )
    return SchedulerSide(settings, _RemoteOnly(answer), CpuTierIndex(100 if local_tiers else 0))


def _serve(s: SchedulerSide, req: str, prompt: Sequence[int] = PROMPT) -> list[SaveSpec]:
    """One request, prefilled in one step (what the lookup found loaded first): its saves."""
    found = s.num_new_matched_tokens(req, prompt, 0)
    assert found is not None
    if found:
        s.after_alloc(req, found)
    s.on_scheduled(
        req,
        block_ids=list(range(len(prompt) // BLOCK + 1)),
        replace_blocks=True,
        num_computed_tokens=found,
        num_scheduled_tokens=len(prompt) - found,
    )
    s.finished(req)
    return s.take_plan().saves


def test_first_sight_stays_local_and_the_second_writes_the_held_chunks_to_the_remote() -> None:
    s = _scheduler(after=2)
    first = _serve(s, "r1")
    assert [(x.chunk_hash, x.tiers) for x in first] == [(h, "local") for h in HASHES]
    # Seen again: the CPU tier holds the chunks; they are loaded, then saved to S3 only.
    second = _serve(s, "r2")
    assert [(x.chunk_hash, x.tiers) for x in second] == [(h, "remote") for h in HASHES]
    assert [x.block_ids for x in second] == [(0, 1), (2, 3), (4, 5)]
    # A third sight: admitted already, nothing to save.
    assert _serve(s, "r3") == []
    counters = s.counters.take()
    assert counters["remote_unadmitted_chunks"] == 3
    assert counters["remote_late_admitted_chunks"] == 3


def test_a_continuation_admits_its_prefix_and_keeps_its_new_chunk_local() -> None:
    s = _scheduler(after=2, runs=4)
    _serve(s, "r1")
    longer = PROMPT[:-1] + list(range(10_000, 10_000 + CHUNK + 1))  # one more chunk
    hashes = chunk_hashes(longer, CHUNK)
    saves = _serve(s, "r2", longer)
    assert [(x.chunk_hash, x.tiers) for x in saves] == [
        (hashes[0], "remote"),
        (hashes[1], "remote"),
        (hashes[2], "remote"),
        (hashes[3], "local"),
    ]
    # The late run is one object, keyed by its first chunk.
    assert {x.object_hash for x in saves[:3]} == {hashes[0]}


def test_a_chunk_no_tier_holds_is_saved_everywhere_once_admitted() -> None:
    """The CPU tier lost the chunks seen once (another server, or evicted): the second sight
    computes them and saves them to every tier; an object holds the admitted ones only."""
    s = _scheduler(after=2, runs=4)
    _serve(s, "r1")
    s.cpu_index = CpuTierIndex(100)  # forgotten
    longer = PROMPT[:-1] + list(range(10_000, 10_000 + CHUNK + 1))
    hashes = chunk_hashes(longer, CHUNK)
    saves = _serve(s, "r2", longer)
    assert [(x.tiers, x.object_hash) for x in saves] == [("all", hashes[0])] * 3 + [
        ("local", hashes[3])
    ]


def test_chunks_the_remote_tier_was_seen_to_hold_are_not_admitted_again() -> None:
    """The CPU tier holds chunks 0-1, the remote tier's walk finds them in an object (another
    server admitted them): nothing to write up; chunk 2, computed, goes to every tier."""
    s = _scheduler(after=2, runs=4, remote=RemotePrefix(found=2, objects=((0, 2),), requests=1))
    assert s.settings.admission is not None
    s.settings.admission.see(HASHES)  # seen once before
    for h in HASHES[:2]:
        s.cpu_index.add(h)
    saves = _serve(s, "r2")
    assert [(x.chunk_hash, x.tiers) for x in saves] == [(HASHES[2], "all")]


def test_a_failed_load_cancels_the_late_admission_and_the_recompute_saves_everywhere() -> None:
    s = _scheduler(after=2)
    _serve(s, "r1")
    assert s.num_new_matched_tokens("r2", PROMPT, 0) == 3 * CHUNK
    s.after_alloc("r2", 3 * CHUNK, block_ids=list(range(7)))  # planned now (the background)
    s.take_plan()
    s.loads_failed({2})  # chunk 1's first block: chunks 1 and 2 are recomputed
    s.on_scheduled(
        "r2",
        block_ids=None,
        replace_blocks=False,
        num_computed_tokens=CHUNK,
        num_scheduled_tokens=3 * CHUNK - CHUNK + 1,
    )
    saves = s.take_plan().saves
    assert [(x.chunk_hash, x.tiers) for x in saves] == [
        (HASHES[0], "remote"),
        (HASHES[1], "all"),
        (HASHES[2], "all"),
    ]


def test_without_a_local_tier_an_unadmitted_chunk_is_not_saved_at_all() -> None:
    s = _scheduler(after=2, local_tiers=False)
    assert _serve(s, "r1") == []
    assert [x.tiers for x in _serve(s, "r2")] == ["all"] * 3
    assert s.counters.take()["remote_unadmitted_chunks"] == 3
