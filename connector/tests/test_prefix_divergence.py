"""Prompts that diverge from an earlier one: the scheduler side logs and counts them.

Real chunk hashes, the real scheduler side and its CPU-tier index: request A is looked up,
prefilled and saved (its chunks land in the index), then request B is looked up against what A
left. Only B's lookup stopping where B's own prompt changed is a divergence.
"""

from __future__ import annotations

import logging
import random

import pytest

from kvtier.keys import chunk_hashes
from kvtier.vllm.divergence import PrefixHistory
from kvtier.vllm.scheduler import CpuTierIndex, SchedulerSettings, SchedulerSide
from kvtier.vllm.store_setup import StoreLookups

CHUNK, BLOCK = 256, 128
SYSTEM = 600  # tokens before the changing line: chunks 0 and 1 hold only the system prompt


def _tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(300, 8000) for _ in range(n)]


def _stamped(stamp: int, document: list[int]) -> list[int]:
    """System prompt, a "Current time" line of 8 tokens, then the document."""
    return [*_tokens(SYSTEM, 1), 7, 7, stamp, stamp, stamp, 9, 9, 9, *document]


def _scheduler(cpu_chunks: int = 10_000) -> SchedulerSide:
    # No store: only the CPU-tier index holds chunks.
    settings = SchedulerSettings(chunk_size=CHUNK, block_size=BLOCK)
    return SchedulerSide(settings, StoreLookups(None), CpuTierIndex(cpu_chunks))


def _serve(s: SchedulerSide, req_id: str, prompt: list[int]) -> int | None:
    """One request as vLLM drives it: lookup, then the whole prompt computed in one step (every
    full chunk not found is saved, hence in the CPU-tier index), then finished. The lookup's
    answer in tokens."""
    matched = s.num_new_matched_tokens(req_id, prompt, 0)
    blocks = list(range(-(-len(prompt) // BLOCK)))
    s.on_scheduled(
        req_id,
        block_ids=blocks,
        replace_blocks=True,
        num_computed_tokens=0,
        num_scheduled_tokens=len(prompt),
    )
    s.take_plan()
    s.finished(req_id)
    return matched


def test_a_changed_line_after_the_first_chunks_is_logged_with_its_chunk_and_counted(
    caplog: pytest.LogCaptureFixture,
) -> None:
    document = _tokens(3000, 2)
    s = _scheduler()
    caplog.set_level(logging.WARNING, logger="kvtier.vllm.scheduler")
    _serve(s, "a", _stamped(11, document))
    assert s.counters.take()["prefix_divergences"] == 0  # nothing earlier to differ from

    matched = _serve(s, "b", _stamped(12, document))  # the same, one minute later
    assert matched == 2 * CHUNK  # chunks 0 and 1: the system prompt only
    assert s.counters.take()["prefix_divergences"] == 1
    chunks = len(_stamped(12, document)) // CHUNK
    line = next(r.getMessage() for r in caplog.records if "diverges" in r.getMessage())
    assert line.startswith(
        "kvtier: request b: its prompt diverges from an earlier request's at chunk 2 "
        f"(tokens 512-767): 2 of its {chunks} chunks shared, the other {chunks - 2} computed "
        f"again (the earlier request had {chunks})."
    )
    assert "(a timestamp, a request id)" in line and "`kvtier explain`" in line


def test_an_unchanged_repeat_and_a_longer_turn_are_not_divergences() -> None:
    first_turn = _stamped(11, _tokens(2000, 3))
    s = _scheduler()
    _serve(s, "a", first_turn)
    assert _serve(s, "again", first_turn) == (len(first_turn) // CHUNK) * CHUNK
    next_turn = first_turn + _tokens(700, 4)  # the conversation goes on: it extends the first
    _serve(s, "turn-2", next_turn)
    assert s.counters.take()["prefix_divergences"] == 0


def test_chunks_lost_to_eviction_are_not_a_divergence() -> None:
    prompt = _stamped(11, _tokens(3000, 5))
    s = _scheduler(cpu_chunks=4)  # the index keeps A's last 4 chunks only: chunk 0 is gone
    _serve(s, "a", prompt)
    assert _serve(s, "b", prompt) == 0  # found nothing, yet the prompt is A's own
    assert s.counters.take()["prefix_divergences"] == 0


def test_chunks_found_from_another_prompt_are_not_this_divergence() -> None:
    document = _tokens(3000, 6)
    s = _scheduler()
    _serve(s, "a", _stamped(11, document))
    _serve(s, "b", _stamped(12, document))  # diverges from A at chunk 2 (counted once)
    s.counters.take()
    # Stamp 11 again: B is the earlier request now, and C differs from it at chunk 2, but C's
    # lookup finds all of A's chunks: nothing was lost to a divergence.
    _serve(s, "c", _stamped(11, document))
    assert s.counters.take()["prefix_divergences"] == 0


def test_a_request_namespace_keeps_its_own_history() -> None:
    document = _tokens(3000, 7)
    s = _scheduler()
    _serve(s, "a", _stamped(11, document))
    # Another tenant's first request with the same text: its chunk ids differ from A's.
    s.num_new_matched_tokens("t", _stamped(12, document), 0, "tenant-b")
    assert s.counters.take()["prefix_divergences"] == 0


def test_history_memory_is_bounded() -> None:
    history = PrefixHistory(max_prompts=3, max_chunks=4)
    for seed in range(10):
        history.observe(chunk_hashes(_tokens(256 * 20, seed), CHUNK), found=0)
    assert len(history) == 3
    # A divergence past the chunks kept is not reported (its hashes are not kept); one within
    # them is.
    prompt = _tokens(256 * 20, 99)
    history.observe(chunk_hashes(prompt, CHUNK), found=0)
    late = [*prompt[: 256 * 6], 1, *prompt[256 * 6 + 1 :]]
    assert history.observe(chunk_hashes(late, CHUNK), found=6) is None
    early = [*prompt[: 256 * 2], 1, *prompt[256 * 2 + 1 :]]
    divergence = history.observe(chunk_hashes(early, CHUNK), found=2)
    assert divergence is not None and divergence.chunk == 2


def test_bad_bounds_are_refused() -> None:
    with pytest.raises(ValueError, match=r"max_prompts \(0\) and max_chunks \(4\) must be >= 1"):
        PrefixHistory(max_prompts=0, max_chunks=4)
