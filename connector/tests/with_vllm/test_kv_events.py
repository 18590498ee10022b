"""kvtier's KV events (kvtier.vllm.events) for vLLM's own Request objects and block hashes
(runs under the vLLM venv: `make test-cuda-cpu`): a chunk's BlockStored carries exactly the
block hashes, parent, tokens and extra keys vLLM publishes for the same blocks; with tensor
parallelism it comes once every rank stored its part; a removal only for a medium announced;
everything bounded and counted."""

from __future__ import annotations

import time

import pytest
from test_identity import BLOCK, CHUNK, TOKENS, _request  # vLLM Requests with its block hasher
from vllm import SamplingParams
from vllm.distributed.kv_events import BlockRemoved, BlockStored
from vllm.lora.request import LoRARequest
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash
from vllm.v1.request import Request

from kvtier.vllm import events as events_module
from kvtier.vllm.events import ChunkEvents, EventPublisher, WorkerReports
from kvtier.vllm.step_plan import SaveSpec


def test_a_stored_chunk_names_vllms_own_blocks() -> None:
    request = _request(salt="tenant-a", lora=LoRARequest("ad", 1, "/adapters/ad"))
    pub = EventPublisher(BLOCK, CHUNK, ranks=1)
    pub.remember("d0", request, 0, CHUNK)
    pub.remember("d1", request, 1, CHUNK)
    pub.from_workers([("stored", "s3", "d1"), ("stored", "cpu", "d0")])
    s3, cpu = pub.take()
    assert isinstance(s3, BlockStored) and isinstance(cpu, BlockStored)
    assert s3.medium == "S3" and cpu.medium == "CPU"
    assert s3.block_hashes == [maybe_convert_block_hash(h) for h in request.block_hashes[4:8]]
    assert s3.parent_block_hash == maybe_convert_block_hash(request.block_hashes[3])
    assert cpu.parent_block_hash is None
    assert s3.token_ids == TOKENS[CHUNK : 2 * CHUNK] and s3.block_size == BLOCK
    assert s3.lora_name == "ad" and s3.lora_id == 1
    # vLLM's untagged extra keys: the adapter on every block, the salt on the first only.
    assert cpu.extra_keys is not None and cpu.extra_keys[0] == ("ad", "tenant-a")
    assert s3.extra_keys == [("ad",)] * 4
    assert pub.take_counts() == (2, 0)


def test_with_two_ranks_a_chunk_is_stored_once_both_wrote_it() -> None:
    pub = EventPublisher(BLOCK, CHUNK, ranks=2)
    pub.remember("d0", _request(), 0, CHUNK)
    pub.from_workers([("stored", "disk", "d0")])
    assert pub.take() == []  # one rank's part only
    pub.from_workers([("stored", "disk", "d0")])
    (event,) = pub.take()
    assert isinstance(event, BlockStored) and event.medium == "DISK"


def test_a_removal_follows_only_what_was_announced_there() -> None:
    pub = EventPublisher(BLOCK, CHUNK, ranks=1)
    request = _request()
    pub.remember("d0", request, 0, CHUNK)
    pub.from_workers([("removed", "cpu", "d0")])  # never announced in CPU
    pub.missing_remotely("d0")
    assert pub.take() == []
    pub.from_workers([("stored", "cpu", "d0"), ("stored", "s3", "d0")])
    pub.take()
    pub.from_workers([("removed", "cpu", "d0")])
    pub.missing_remotely("d0")
    cpu, s3 = pub.take()
    assert isinstance(cpu, BlockRemoved) and cpu.medium == "CPU"
    assert isinstance(s3, BlockRemoved) and s3.medium == "S3"
    assert cpu.block_hashes == [maybe_convert_block_hash(h) for h in request.block_hashes[:4]]
    pub.missing_remotely("d0")  # already removed there
    assert pub.take() == []


def test_unknown_chunks_and_overflow_are_dropped_and_counted(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(events_module, "MAX_PENDING", 2)
    pub = EventPublisher(BLOCK, CHUNK, ranks=1)
    pub.from_workers([("stored", "s3", "never-planned")])
    pub.remember("d0", _request(), 0, CHUNK)
    pub.from_workers([("stored", t, "d0") for t in ("cpu", "disk", "s3")])
    assert len(pub.take()) == 2
    assert pub.take_counts() == (2, 2)


def test_a_worker_reports_its_own_namespaces_chunks_bounded() -> None:
    reports = WorkerReports("default", limit=2)
    reports("stored", "s3", "default/0123abcd/d0")
    reports("stored", "cpu", "kv-verify/0123abcd/d1")  # a request's own namespace: not published
    reports("stored", "cpu", ".kvtier-doctor-probe")  # not a chunk key
    reports("removed", "disk", "default/0123abcd/d2")
    reports("stored", "disk", "default/0123abcd/d3")  # over the limit
    taken = reports.take()
    assert isinstance(taken, ChunkEvents)
    assert taken.get_all_events() == [("stored", "s3", "d0"), ("removed", "disk", "d2")]
    assert reports.take_dropped() == 1 and reports.take() is None
    # vLLM merges the workers' reports into the first one's
    taken.add_events([("stored", "s3", "d9")])
    taken.increment_workers(1)
    assert taken.get_number_of_workers() == 2 and len(taken.aggregate().get_all_events()) == 3


def test_a_chunk_without_vllm_block_hashes_is_not_published() -> None:
    """vLLM computes block hashes only with prefix caching on; without them there is nothing a
    router could match, and nothing is published."""
    request = Request(
        request_id="r",
        prompt_token_ids=TOKENS,
        sampling_params=SamplingParams(max_tokens=1),
        pooling_params=None,
    )
    pub = EventPublisher(BLOCK, CHUNK, ranks=1)
    pub.remember("d0", request, 0, CHUNK)
    pub.from_workers([("stored", "cpu", "d0")])
    assert pub.take() == [] and pub.take_counts() == (0, 1)


def test_the_engine_keeps_stepping_until_the_background_writes_reported(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """vLLM publishes events only in its steps: while a save's disk and S3 writes have not
    reported, the connector asks for steps (has_pending_push_work), and not beyond a bound."""
    pub = EventPublisher(BLOCK, CHUNK, ranks=2, background_tiers={"disk", "s3"})
    pub.remember("d0", _request(), 0, CHUNK)
    assert not pub.waiting_for_reports()
    pub.expect_saves([SaveSpec("r", "d0", (0, 1), CHUNK)])  # 2 ranks x (disk, S3)
    pub.from_workers([("stored", "cpu", "d0"), ("stored", "disk", "d0")])
    pub.from_workers([("stored", "disk", "d0"), ("failed", "s3", "d0")])
    assert pub.waiting_for_reports()
    pub.from_workers([("stored", "s3", "d0")])
    assert not pub.waiting_for_reports()
    # A save of the local tiers only (the remote tier does not admit it yet): disk reports.
    pub.expect_saves([SaveSpec("r", "d0", (0, 1), CHUNK, tiers="local")])
    pub.from_workers([("stored", "disk", "d0")] * 2)
    assert not pub.waiting_for_reports()
    monkeypatch.setattr(events_module, "REPORT_WAIT_SECS", 0.0)
    pub.expect_saves([SaveSpec("r", "d0", (0, 1), CHUNK)])  # reports that never come: the
    # wait ends at the bound
    time.sleep(0.01)
    assert not pub.waiting_for_reports()
