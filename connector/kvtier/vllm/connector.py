"""KVTierConnector: vLLM v1 KV connector over kvtier's tiered store.

Use::

    --kv-transfer-config '{"kv_connector": "KVTierConnector",
                           "kv_connector_module_path": "kvtier.vllm.connector",
                           "kv_role": "kv_both",
                           "kv_connector_extra_config": {"config_file": "/etc/kvtier/kvtier.yaml"}}'

``kv_connector_extra_config`` is given to `kvtier.config.load_config`: a ``config_file`` plus
overrides, inline keys, or nothing (then ``$KVTIER_CONFIG``).

This class only adapts vLLM's objects: planning lives in `scheduler.SchedulerSide`, data
movement in `worker.WorkerSide`, layouts in `layout`, metrics in `stats`.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvtier.admission import Admission
from kvtier.config import KvtierConfig, load_config
from kvtier.format import HEADER_SIZE, chunks_per_object
from kvtier.keys import model_identity
from kvtier.stats import StoreStats, store_deltas
from kvtier.store import TieredStore
from kvtier.vllm.blockcopy.copier import BlockCopier
from kvtier.vllm.connector_stats import KvtierConnectorStats, KvtierPromMetrics
from kvtier.vllm.events import ChunkEvents, EventPublisher, WorkerReports, events_enabled
from kvtier.vllm.identity import RequestIdentity, Uncacheable
from kvtier.vllm.layout import (
    KVLayout,
    LayoutError,
    PipelineStage,
    check_stage,
    check_tensors,
    expected_layout,
    pipeline_stages,
)
from kvtier.vllm.scheduler import CpuTierIndex, SchedulerSettings, SchedulerSide
from kvtier.vllm.step_plan import StepPlan
from kvtier.vllm.store_setup import StoreLookups, open_store
from kvtier.vllm.version import check_vllm_version
from kvtier.vllm.worker import WorkerSide

log = logging.getLogger("kvtier.vllm")

#: Key in a request's ``kv_transfer_params`` that picks one of ``request_namespaces``.
REQUEST_NAMESPACE_PARAM = "kvtier_namespace"


def _use_vllm_log_handlers() -> None:
    """Send kvtier's records (connector and store) to the server log, formatted like vLLM's."""
    ours, theirs = logging.getLogger("kvtier"), logging.getLogger("vllm")
    if not ours.handlers and theirs.handlers:
        for handler in theirs.handlers:
            ours.addHandler(handler)
        ours.setLevel(logging.INFO)
        ours.propagate = False


_SOURCES = {
    "cpu": CacheHitSource.HOST,
    "disk": CacheHitSource.DISK,
    # vLLM has no label for a remote object store.
    "s3": CacheHitSource.EXTERNAL_UNSPECIFIED,
}


@dataclass
class KvtierMetadata(KVConnectorMetadata):  # type: ignore[misc]
    plan: StepPlan = field(default_factory=StepPlan)


def _refuse_unsupported_parallelism(vllm_config: Any) -> None:
    """Fail at start, naming the setting, for parallelism kvtier's keys cannot express yet."""
    par = vllm_config.parallel_config
    for name in ("decode_context_parallel_size", "prefill_context_parallel_size"):
        size = int(getattr(par, name, 1) or 1)
        if size > 1:
            raise LayoutError(
                f"kvtier does not support context parallelism ({name}={size}): a block then "
                "spans the ranks' shards of several positions, which kvtier's chunks do not "
                f"describe. Serve with {name} 1, or without kv_transfer_config"
            )


def _tp(vllm_config: Any, role: Any) -> tuple[int, int]:
    size = int(vllm_config.parallel_config.tensor_parallel_size)
    if role != KVConnectorRole.WORKER or size == 1:
        # The scheduler looks up rank 0's keys: every rank saves the same chunks.
        return 0, size
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

    return int(get_tensor_model_parallel_rank()), size


def _stage(stages: tuple[PipelineStage, ...], role: Any) -> PipelineStage:
    """This process's pipeline stage; the scheduler's is stage 0, whose layers vLLM gives it
    (its KV cache config is the first worker's) and whose keys it looks up."""
    if role != KVConnectorRole.WORKER or len(stages) == 1:
        return stages[0]
    from vllm.distributed.parallel_state import get_pp_group

    return stages[int(get_pp_group().rank_in_group)]


def _vllm_compute_stream() -> Any:
    """vLLM's own view of the stream it computes on (its model runner sets a dedicated stream
    on its main thread; torch's thread-local default would be another one)."""
    from vllm.utils.torch_utils import current_stream

    return current_stream


class KVTierConnector(KVConnectorBase_V1):  # type: ignore[misc]
    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any) -> None:
        dist = check_vllm_version()
        _use_vllm_log_handlers()
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        _refuse_unsupported_parallelism(vllm_config)
        extra = dict(self._kv_transfer_config.kv_connector_extra_config or {})
        self.cfg: KvtierConfig = load_config(extra or None) if not extra else load_config(extra)
        self.layout: KVLayout = expected_layout(vllm_config, kv_cache_config)
        model_cfg = vllm_config.model_config
        model_dir = model_cfg.model if os.path.isdir(model_cfg.model) else None
        model_id = model_identity(str(model_cfg.served_model_name), model_dir)
        tp_rank, tp_size = _tp(vllm_config, role)
        # Pipeline parallelism: each stage holds, stores and loads only its own layers, keyed
        # by them; the scheduler looks up stage 0's keys, as it looks up TP rank 0's.
        stages = pipeline_stages(vllm_config)
        stage = _stage(stages, role)
        if len(stages) > 1:
            check_stage(self.layout, stage)
        #: vLLM blocks per chunk (the scheduler side refuses a chunk_size that is no multiple
        #: of the block size).
        self.blocks_per_chunk = self.cfg.chunk_size // self.layout.block_size
        #: Chunks per S3 object: several when the model's chunks are small (kvtier.format).
        #: Every stage cuts its runs as the scheduler plans them: from stage 0's payload.
        self.object_chunks = 1
        if self.cfg.remote_url:
            payload = stages[0].num_layers * self.blocks_per_chunk * self.layout.block_nbytes
            self.object_chunks = chunks_per_object(payload, self.cfg.remote_chunks_per_object)

        def fingerprint_of(rank: int, of_stage: PipelineStage) -> str:
            return self.layout.fingerprint(
                model_id, self.cfg.chunk_size, rank, tp_size, self.object_chunks, of_stage
            ).digest()

        self.fingerprint = fingerprint_of(tp_rank, stage)
        #: The other ranks' layouts (TP ranks of every stage): their chunks in a shared disk
        #: directory are theirs.
        self._peer_fingerprints = frozenset(
            fingerprint_of(r, s) for s in stages for r in range(tp_size)
        ) - {self.fingerprint}
        self._scheduler: SchedulerSide | None = None
        self._lookup_store: TieredStore | None = None
        self._lookups: StoreLookups | None = None
        self._last_lookup_stats = StoreStats()
        self._worker: WorkerSide | None = None
        #: KV events for routers (kvtier.vllm.events), when vLLM's are on: the scheduler's
        #: publisher and the requests whose saved chunks it describes; the worker's reports.
        self._events_on = events_enabled(vllm_config)
        self._publisher: EventPublisher | None = None
        self._event_requests: dict[str, Any] = {}
        self._reports: WorkerReports | None = None
        #: Worker processes (TP ranks of every stage): each reports its own chunks.
        self._ranks = tp_size * len(stages)
        #: What keys a request's identity beyond its tokens (scheduler side).
        self._identity = RequestIdentity(self.cfg.chunk_size, self.cfg.save_unfull_chunk)
        #: Reasons to serve a request without kvtier that were logged already (once each).
        self._uncached_logged: set[str] = set()
        log.info(
            "kvtier %s connector (%s): config %s, layout %s, fingerprint %s, tiers cpu=%s "
            "disk=%s s3=%s (%d chunks per object)",
            "scheduler"
            if role == KVConnectorRole.SCHEDULER
            else f"worker tp{tp_rank}" + (f" pp{stage.rank}" if len(stages) > 1 else ""),
            dist,
            self.cfg.source,
            self.layout.kv_layout(),
            self.fingerprint,
            self.cfg.local_cpu,
            self.cfg.local_disk,
            self.cfg.remote_url,
            self.object_chunks,
        )
        if role == KVConnectorRole.SCHEDULER:
            self._require_recompute_on_load_failure()
            self._init_scheduler()

    # ------------------------------------------------------------------ setup
    def _require_recompute_on_load_failure(self) -> None:
        """A cache miss must never fail a request: vLLM's default policy ("fail") would turn a
        corrupted or vanished chunk into an error for the user. vLLM's scheduler reads the
        policy right after creating this connector, so setting it here takes effect."""
        cfg = self._kv_transfer_config
        if cfg.kv_load_failure_policy != "recompute":
            log.info(
                "kvtier: setting kv_load_failure_policy=recompute (was %r): chunks that fail "
                "to load are recomputed, never an error",
                cfg.kv_load_failure_policy,
            )
            cfg.kv_load_failure_policy = "recompute"

    def _init_scheduler(self) -> None:
        cfg = self.cfg
        # The worker's CPU tier is not ours to see. Stats go to a subdirectory: in single-process
        # mode the worker's store has the same pid, hence the same stats file name.
        stats = os.path.join(cfg.stats_path, "scheduler") if cfg.stats_path else None
        shared = cfg.model_copy(update={"local_cpu": False, "stats_dir": stats})
        if shared.local_disk or shared.remote_url:
            # Lookups only: the disk tier is the workers' to evict.
            self._lookup_store = open_store(
                shared, self.fingerprint, "scheduler", self.object_chunks, disk_maintain=False
            )
        self._lookups = StoreLookups(self._lookup_store)
        blob = self.layout.payload_nbytes(self.blocks_per_chunk) + HEADER_SIZE
        if self._events_on:
            self._publisher = EventPublisher(
                self.layout.block_size,
                cfg.chunk_size,
                ranks=self._ranks,
                background_tiers=[
                    name for name, on in (("disk", cfg.disk_bytes), ("s3", cfg.remote_url)) if on
                ],
            )
        settings = SchedulerSettings(
            chunk_size=cfg.chunk_size,
            block_size=self.layout.block_size,
            save_unfull_chunk=cfg.save_unfull_chunk,
            object_chunks=self.object_chunks,
            background_loads=cfg.enable_async_loading,
            lookup_timeout=cfg.lookup_timeout_secs,
            admission=(
                Admission(cfg.remote_admit_after, cfg.remote_admit_window_chunks)
                if cfg.remote_url and cfg.remote_admit_after > 1
                else None
            ),
            local_tiers=cfg.cpu_bytes > 0 or cfg.disk_bytes > 0,
        )
        self._scheduler = SchedulerSide(
            settings, self._lookups, CpuTierIndex(cfg.cpu_bytes // blob)
        )

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        tensors = check_tensors(self.layout, kv_caches)
        cuda = bool(tensors) and tensors[0].device.type == "cuda"
        pin = None
        if cuda:
            from kvtier.vllm.blockcopy.pinned import pin_host_region

            pin = pin_host_region
        store = open_store(
            self.cfg,
            self.fingerprint,
            "worker",
            self.object_chunks,
            disk_peers=self._peer_fingerprints,
            remote_maintain=True,
            # The CPU tier as a slab of full chunks (kvtier.tiers.cpu), pinned on CUDA.
            cpu_slot_bytes=self.layout.payload_nbytes(self.blocks_per_chunk),
            cpu_pin=pin,
        )
        if store is None:
            return  # no tier left to use (logged): served without kvtier
        if self._events_on:
            self._reports = WorkerReports(self.cfg.namespace)
            store.report_chunks(self._reports)
        self._worker = WorkerSide(
            store,
            # CUDA: the pinned pools hold whole chunks, sized once (CPU: unused).
            BlockCopier(
                self.layout,
                tensors,
                max_blocks=self.blocks_per_chunk,
                save_buffers=self._save_slots(self.layout.payload_nbytes(self.blocks_per_chunk)),
                compute_stream=_vllm_compute_stream() if cuda else None,
            ),
            self.cfg.blocking_timeout_secs,
            save_wait_secs=self.cfg.save_wait_secs,
        )

    def _save_slots(self, chunk_bytes: int) -> int:
        """Pinned save slots (CUDA): ``save_buffer_size``, or two steps' worth of chunks."""
        if self.cfg.save_buffer_size is not None:
            return max(2, int(self.cfg.save_buffer_size * (1 << 30)) // chunk_bytes)
        step_tokens = int(self._vllm_config.scheduler_config.max_num_batched_tokens)
        # A step completes at most this many chunks (its tokens may straddle one more).
        return 2 * (-(-step_tokens // self.cfg.chunk_size) + 1)

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a cache: a dropped save is a future miss, never lost work

    # ------------------------------------------------------------------ scheduler side
    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        if self._scheduler is None:
            return 0, False
        params = getattr(request, "kv_transfer_params", None) or {}
        namespace = params.get(REQUEST_NAMESPACE_PARAM)
        if namespace == self.cfg.namespace:
            namespace = None
        # The prompt and its identity are read once per request (the scheduler keeps its keys).
        prompt: list[int] = []
        extras: list[bytes] | None = None
        if not self._scheduler.knows(request.request_id):
            try:
                if namespace is not None and namespace not in self.cfg.request_namespaces:
                    raise Uncacheable(
                        "namespace_not_allowed",
                        f"it asks for namespace {namespace!r}, which is not in "
                        f"request_namespaces {list(self.cfg.request_namespaces)} of "
                        f"{self.cfg.source}",
                    )
                extras = self._identity.chunk_extras(request)
                prompt = self._identity.prompt(request)
            except Uncacheable as exc:
                self._serve_uncached(self._scheduler, request.request_id, exc)
                return 0, False
        n = self._scheduler.num_new_matched_tokens(
            request.request_id,
            prompt,
            num_computed_tokens,
            namespace,
            extras,
        )
        if self._publisher is not None and namespace is None and n is not None:
            self._event_requests[request.request_id] = request
            gap = self._scheduler.missing_remotely(request.request_id)
            if gap is not None:  # announced in S3 before, gone now (purged, expired)
                self._publisher.missing_remotely(gap)
        background = bool(n) and self._scheduler.loads_in_background(request.request_id)
        return n, background

    def _serve_uncached(self, scheduler: SchedulerSide, req_id: str, exc: Uncacheable) -> None:
        """Fail closed: the request is served without kvtier; the reason is counted in /metrics
        (kvtier:uncached_requests_total) and logged the first time it occurs."""
        scheduler.bypass(req_id, exc.reason)
        if exc.reason not in self._uncached_logged:
            self._uncached_logged.add(exc.reason)
            log.warning(
                "kvtier: request %s is served without kvtier (nothing looked up, loaded or "
                "saved): %s. Logged once per reason; counted in "
                'kvtier:uncached_requests_total{reason="%s"}',
                req_id,
                exc,
                exc.reason,
            )

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        if self._scheduler is None or num_external_tokens <= 0:
            return
        req_id = request.request_id
        # A load in the background is planned now: the request waits outside the batch.
        background = self._scheduler.loads_in_background(req_id)
        block_ids = blocks.get_block_ids()[0] if background else None
        self._scheduler.after_alloc(req_id, num_external_tokens, block_ids)

    def get_external_cache_hit_sources(
        self, request: Any, num_external_tokens: int
    ) -> dict[CacheHitSource, int]:
        if self._scheduler is None or num_external_tokens == 0:
            return {}
        out: dict[CacheHitSource, int] = {}
        for tier, n in self._scheduler.hit_sources(request.request_id, num_external_tokens).items():
            src = _SOURCES.get(tier, CacheHitSource.EXTERNAL_UNSPECIFIED)
            out[src] = out.get(src, 0) + n
        return out

    def build_connector_meta(self, scheduler_output: Any) -> KvtierMetadata:
        sched = self._scheduler
        if sched is None:
            return KvtierMetadata()
        num_scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            sched.on_scheduled(
                new.req_id,
                block_ids=new.block_ids[0],
                replace_blocks=True,
                num_computed_tokens=new.num_computed_tokens,
                num_scheduled_tokens=num_scheduled.get(new.req_id, 0),
            )
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            new_blocks = cached.new_block_ids[i]
            sched.on_scheduled(
                req_id,
                block_ids=new_blocks[0] if new_blocks is not None else None,
                replace_blocks=req_id in cached.resumed_req_ids,
                num_computed_tokens=cached.num_computed_tokens[i],
                num_scheduled_tokens=num_scheduled.get(req_id, 0),
            )
        plan = sched.take_plan()
        if self._publisher is not None:  # what the chunks saved or loaded (and promoted) cover
            bs = self.layout.block_size
            self._publisher.expect_saves(s for s in plan.saves if s.req_id in self._event_requests)
            chunks = [(s.req_id, s.chunk_hash, s.index, s.num_tokens) for s in plan.saves]
            chunks += [(s.req_id, s.chunk_hash, s.index, s.stored_blocks * bs) for s in plan.loads]
            for req_id, digest, index, num_tokens in chunks:
                request = self._event_requests.get(req_id)
                if request is not None:
                    self._publisher.remember(digest, request, index, num_tokens)
        return KvtierMetadata(plan=plan)

    def update_connector_output(self, connector_output: Any) -> None:
        invalid = getattr(connector_output, "invalid_block_ids", None)
        if self._scheduler is not None and invalid:
            self._scheduler.loads_failed(set(invalid))
        reports = getattr(connector_output, "kv_cache_events", None)
        if self._publisher is not None and isinstance(reports, ChunkEvents):
            self._publisher.from_workers(reports.reports)

    def has_pending_push_work(self) -> bool:
        """Keep vLLM stepping while background writes of this process's saves have not
        reported (their events are published in a step; kvtier.vllm.events)."""
        return self._publisher is not None and self._publisher.waiting_for_reports()

    def take_events(self) -> list[Any]:
        """kvtier's BlockStored / BlockRemoved since the last call (vLLM publishes them with
        its own KV events)."""
        return self._publisher.take() if self._publisher is not None else []

    def request_finished(
        self, request: Any, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        if self._scheduler is not None:
            self._scheduler.finished(request.request_id)
        self._event_requests.pop(request.request_id, None)
        # Saves copy their blocks out within the step, so the blocks can be freed now.
        return False, None

    # ------------------------------------------------------------------ worker side
    def _plan(self) -> StepPlan | None:
        if self._worker is None or not self.has_connector_metadata():
            return None
        meta = self._get_connector_metadata()
        return meta.plan if isinstance(meta, KvtierMetadata) else None

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        plan = self._plan()
        if plan is not None and self._worker is not None:
            self._worker.load(plan.loads)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads complete in start_load_kv, before the forward pass

    def save_kv_layer(
        self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any
    ) -> None:
        return  # whole chunks (all layers) are copied in wait_for_save

    def wait_for_save(self) -> None:
        if self._worker is not None:
            self._worker.step_done()
        plan = self._plan()
        if plan is not None and self._worker is not None:
            self._worker.save(plan.saves)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Requests whose loads in the background ended (vLLM then schedules them); their
        failed blocks follow in get_block_ids_with_load_errors, which vLLM calls next."""
        if self._worker is None:
            return None, None
        return None, self._worker.take_finished() or None

    def get_kv_connector_kv_cache_events(self) -> ChunkEvents | None:
        """The worker's reports of chunks its tiers stored or lost since the last step (the
        scheduler side turns them into KV events)."""
        return self._reports.take() if self._reports is not None else None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.take_failed_blocks() if self._worker is not None else set()

    # ------------------------------------------------------------------ stats
    def get_kv_connector_stats(self) -> KvtierConnectorStats | None:
        if self._worker is not None:
            data: dict[str, Any] = self._worker.take_stats()
            if self._reports is not None:
                data["kv_events_dropped"] = self._reports.take_dropped()
        elif self._scheduler is not None:
            data = self._scheduler.counters.take()
            if self._publisher is not None:
                published, dropped = self._publisher.take_counts()
                data.update(kv_events_published=published, kv_events_dropped=dropped)
            if self._lookup_store is not None:
                now = self._lookup_store.stats()
                # Lookups only: the worker's store reports how full the tiers are.
                data.update(store_deltas(self._last_lookup_stats, now, include_fill=False))
                self._last_lookup_stats = now
        else:
            return None
        stats = KvtierConnectorStats(data={k: v for k, v in data.items() if v})
        return None if stats.is_empty() else stats

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KvtierConnectorStats:
        return KvtierConnectorStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KvtierPromMetrics:
        return KvtierPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        if self._worker is not None:
            log.info("kvtier: worker shutting down, flushing background writes")
            self._worker.close(self.cfg.blocking_timeout_secs)
            self._worker = None
        if self._lookups is not None:
            self._lookups.close()
            self._lookups = None
        if self._lookup_store is not None:
            self._lookup_store.close(self.cfg.blocking_timeout_secs)
            self._lookup_store = None
