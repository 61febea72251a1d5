"""`PooledMooncakeStoreConnector`: the class vLLM loads. Role dispatch only.

    --kv-transfer-config '{"kv_connector": "PooledMooncakeStoreConnector",
                           "kv_connector_module_path": "connector", "kv_role": "kv_both",
                           "kv_connector_extra_config": {...}}'

(vLLM's kv_load_failure_policy follows the connector's on_load_failure:
connector.scheduler.load_failures.)

The module is imported by every vLLM process (API server, engine core, workers); the store
client and torch-heavy code load only in the role that needs them.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from connector.config import DEFAULT_TENANT, ConfigError, load_config
from connector.metadata import StepMetadata, WorkerReport
from connector.observability.kv_events import vllm_clears
from connector.observability.stats import PooledStoreStats
from connector.plugin import register
from connector.scheduler.load_failures import apply_policy, per_request
from connector.store.client import StoreUnavailable
from connector.store.groups import GroupError, groups_from_kv_cache_config
from connector.store.keys import KeyBuilder, check_disk_tier, layout_from_vllm, store_tp_advice

if TYPE_CHECKING:
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

logger = logging.getLogger(f"vllm.{__name__}")  # under vLLM's handler and level


def _attn_backend_names(vllm_config: Any) -> str:
    """The attention backends of this worker's layers (part of the KV layout signature)."""
    try:
        from vllm.distributed.kv_transfer.kv_connector.utils import get_current_attn_backends

        return ",".join(sorted({b.get_name() for b in get_current_attn_backends(vllm_config)}))
    except Exception:  # noqa: BLE001 - best effort: the tensor signature still applies
        logger.warning("could not determine the attention backend for the KV layout key",
                       exc_info=True)
        return ""


def _interior_order(vllm_config: Any) -> tuple[int, ...] | None:
    """How a block's KV heads, tokens and content lie in memory, from vLLM's resolved KV cache
    layout (part of what a store shard's bytes are)."""
    from connector.worker.kv_regions import interior_order

    try:
        return interior_order(vllm_config.cache_config.get_resolved_kv_cache_layout())
    except Exception:  # noqa: BLE001 - no layout API: the tensors' strides say it
        return None


def loads_need_a_fence(vllm_config: Any) -> bool:
    """Whether vLLM may hand a load a block that a step still on the device writes: batches
    overlap (async scheduling, pipeline parallelism) and vLLM does not hold freed blocks back
    a step, which it does only for a KV consumer (kv_consumer, kv_both; vllm/v1/core/sched/
    scheduler.py, defer_block_free). Then loads wait for the GPU work queued before them
    (`MooncakeStoreWorker.fence_loads`). Inside a MultiConnector vLLM reads the top-level
    kv_role, which a member cannot see: docs/migration.md."""
    ktc = vllm_config.kv_transfer_config
    return (getattr(vllm_config, "max_concurrent_batches", 1) > 1
            and not getattr(ktc, "is_kv_consumer", True))


def _spec_kinds(kv_cache_config: Any) -> tuple[tuple[str | None, int | None], ...]:
    """Per KV cache group: the spec kind and sliding window vLLM's own events carry."""
    try:
        from vllm.v1.kv_cache_interface import (
            get_kv_cache_spec_kind,
            get_kv_cache_spec_sliding_window,
        )

        return tuple((get_kv_cache_spec_kind(g.kv_cache_spec).value,
                      get_kv_cache_spec_sliding_window(g.kv_cache_spec))
                     for g in kv_cache_config.kv_cache_groups)
    except Exception:  # noqa: BLE001 - optional fields: the events stand without them
        return ()


class PooledMooncakeStoreConnector(KVConnectorBase_V1, SupportsHMA):
    """Mooncake-store KV connector with a pool of receive threads and full observability.

    SupportsHMA: vLLM keeps its hybrid KV cache manager on, so a model with sliding-window
    layers gets one block table per KV cache group and this connector stores each group as
    it needs (`connector.store.groups`)."""

    _cache_hit_source = CacheHitSource.HOST

    def __init__(self, vllm_config: Any, role: KVConnectorRole,
                 kv_cache_config: Any = None, **kwargs: Any) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        ktc = vllm_config.kv_transfer_config
        try:
            self.config = load_config(ktc.kv_connector_extra_config, kv_role=ktc.kv_role)
            self.groups = groups_from_kv_cache_config(kv_cache_config,
                                                      vllm_config.cache_config.block_size)
            tenant = self.config.store.tenant_id
            layout = layout_from_vllm(vllm_config, self.config.model_id, self.config.store_tp,
                                      latent=self.groups[0].latent,
                                      tenant="" if tenant == DEFAULT_TENANT else tenant,
                                      store_tp_field=self.config.store_tp_field)
            check_disk_tier(layout, self.config.enable_offload, self.config.store_tp_field)
        except (ConfigError, GroupError, ValueError) as e:
            # One line that names the field and the fix, above vLLM's startup trace.
            logger.error("PooledMooncakeStoreConnector: invalid configuration: %s", e)
            raise
        for note in self.config.notes:  # in-tree settings taken as their equivalents
            logger.info("PooledMooncakeStoreConnector: %s", note)
        for warning in self.config.warnings:  # settings given but ignored, as in-tree
            logger.warning("PooledMooncakeStoreConnector: %s", warning)
        self.keys = KeyBuilder(self.config.cache_prefix, layout, len(self.groups))
        self._per_request_failures = per_request(self.groups)
        self.scheduler = None
        self.worker = None
        self.kv_events: Any = None  # StoreEventLog (scheduler) or WorkerLanded (worker)
        self._reported_busy = False  # the worker's last settled state sent (gauge_refresh)
        try:
            from connector.observability.kv_event_settings import event_settings

            self._event_settings = event_settings(self.config,
                                                  getattr(vllm_config, "kv_events_config", None))
        except ConfigError as e:
            logger.error("PooledMooncakeStoreConnector: invalid configuration: %s", e)
            raise
        try:
            if role == KVConnectorRole.SCHEDULER:
                from connector.scheduler.scheduler import MooncakeStoreScheduler

                for line in apply_policy(vllm_config, self.config.on_load_failure):
                    logger.info("PooledMooncakeStoreConnector: %s", line)
                from connector.scheduler.engine_wakeup import EngineWakeup

                self._wakeup = EngineWakeup.find()  # now: it looks up the constructing loop
                self.scheduler = MooncakeStoreScheduler(
                    self.config, self.keys, vllm_config.cache_config.block_size, self.groups,
                    getattr(vllm_config.cache_config, "prefix_cache_retention_interval", 0),
                    wake=self._wakeup.wake)
                if self.config.enable_save and not self.scheduler.saves:
                    logger.warning(
                        "PooledMooncakeStoreConnector: %s %d is below the TP size "
                        "%d: a stored object holds KV heads of several ranks, which no rank "
                        "can write alone, so this engine loads from the store but saves "
                        "nothing; %s to save too", self.config.store_tp_field, layout.shards,
                        layout.tp_size, store_tp_advice(self.config.store_tp_field,
                                                        layout.tp_size))
                self._trace(self.scheduler, 0, "scheduler")
                from connector.worker.worker import shutdown_timeout_warning

                if note := shutdown_timeout_warning(vllm_config, self.config.enable_save):
                    logger.warning("PooledMooncakeStoreConnector: %s", note)
                self._scheduler_events(kv_cache_config)
            else:
                self._start_worker(vllm_config, kv_cache_config)
        except StoreUnavailable as e:
            # An outage, not a bad config: one line naming the endpoint, above vLLM's trace.
            logger.error("PooledMooncakeStoreConnector: the Mooncake store is unreachable "
                         "(on_master_unreachable=fail): %s", e)
            raise

    def _start_worker(self, vllm_config: Any, kv_cache_config: Any) -> None:
        from connector.worker.worker import MooncakeStoreWorker

        tp_size = vllm_config.parallel_config.tensor_parallel_size
        try:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            tp_rank = get_tensor_model_parallel_rank()
        except Exception:  # noqa: BLE001 - not initialised (e.g. unit tests): derive it
            tp_rank = vllm_config.parallel_config.rank % tp_size
        self.worker = MooncakeStoreWorker(
            self.config, self.keys, tp_rank, kv_cache_config.num_blocks,
            kv_on_host=getattr(vllm_config.device_config, "device_type", "cpu") == "cpu",
            zeroes_blocks=getattr(kv_cache_config, "needs_kv_cache_zeroing", False),
            groups=self.groups, layout_order=_interior_order(vllm_config))
        self.worker.fence_loads = self.config.enable_load and loads_need_a_fence(vllm_config)
        if tp_size > 1:
            from connector.worker.rank_agreement import tp_any_rank

            self.worker.any_rank = tp_any_rank()
        self._trace(self.worker, tp_rank, "worker")
        if self._event_settings is not None and self.config.enable_save:
            from connector.observability.kv_events import WorkerLanded

            self.kv_events = WorkerLanded(tp_rank, self._event_settings.queue,
                                          self.worker.recorder.count)
            self.worker.on_landed = self.kv_events.add
        logger.info("PooledMooncakeStoreConnector worker: rank %d/%d, %s receive threads, "
                    "keys %s", tp_rank, tp_size,
                    f"auto 1..{self.config.load_threads}" if self.config.load_threads_auto
                    else self.config.load_threads, self.keys.fingerprint)

    def _scheduler_events(self, kv_cache_config: Any) -> None:
        """The store's KV events (observability.kv_events), when on and this engine saves."""
        st, sched = self._event_settings, self.scheduler
        if st is None or not sched.saves:
            return
        from connector.observability.kv_event_settings import sweep_address
        from connector.observability.kv_events import StoreEventLog

        self.kv_events = sched.kv_events = StoreEventLog(
            st, self.keys.layout.tp_size, self._vllm_config.cache_config.block_size,
            lambda hashes, g: sched._keys.all_shard_keys(hashes, g), self.keys.layout.shards,
            sched.recorder.count, _spec_kinds(kv_cache_config), self._wakeup.wake,
            sweep_address(st, self.config.store, self.config.store_timeout_s))
        if st.sweep_off:
            sched.recorder.count("kv_events_sweeps", "off")
            logger.warning("PooledMooncakeStoreConnector: %s", st.sweep_off)
        self.kv_events.start()
        logger.info("PooledMooncakeStoreConnector: store KV events on (medium %s, locality %s, "
                    "%s)", st.medium, st.locality, st.sweep_note(self.keys.layout.shards))

    def _trace(self, side: Any, tp_rank: int, kind: str) -> None:
        """Add a span exporter to a side's events when tracing is on (the worker's exemplars
        come from its recorder; the scheduler traces the requests that loaded from the store)."""
        from connector.observability.sampling import TraceSampler
        from connector.observability.tracing import SpanExporter, tracing_enabled

        if tracing_enabled():
            sampler = TraceSampler.configured(self.config.trace_sample_ratio)
            if not sampler.never:
                traced = side.recorder.traced_load if kind == "worker" else None
                side.add_subscriber(SpanExporter(sampler, tp_rank, kind, on_traced=traced))

    # ---- classmethods used by vLLM at config time and in the API server -------------------
    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any = None) -> bool:
        return False  # buffers are registered once; sleep would free them under the store

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None
                                 ) -> KVConnectorStats | None:
        return PooledStoreStats(data=data) if data is not None else PooledStoreStats()

    @classmethod
    def build_prom_metrics(cls, vllm_config: Any, metric_types: dict, labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> Any:
        from connector.observability.prom import PooledStorePromMetrics

        return PooledStorePromMetrics(vllm_config, metric_types, labelnames,
                                      per_engine_labelvalues)

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a cache: losing a save never loses a request

    # ---- scheduler side --------------------------------------------------------------------
    def on_new_request(self, request: Any) -> None:
        self.scheduler.prefetch(request)

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int
                                   ) -> tuple[int | None, bool]:
        return self.scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int
                                 ) -> None:
        self.scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        if self.kv_events is not None and vllm_clears(self.scheduler.block_pool):
            self.kv_events.cleared()  # announced again right after vLLM's AllBlocksCleared
        return self.scheduler.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: Any) -> None:
        self.scheduler.update_connector_output(connector_output)
        if self.kv_events is not None:
            from connector.observability.kv_events import LandedShards

            landed = getattr(connector_output, "kv_cache_events", None)
            if isinstance(landed, LandedShards):
                self.kv_events.landed(landed.get_all_events())
            for rid in connector_output.finished_sending or ():  # after their last reports
                self.kv_events.settled(rid)

    def has_pending_push_work(self) -> bool:
        """Store events wait for vLLM's publisher, or a worker's gauges are due on /metrics
        (scheduler.gauge_refresh): an idle engine steps to hand them over."""
        if self.scheduler is None:
            return False
        return self.scheduler.gauges.due or (self.kv_events is not None
                                             and self.kv_events.pending())

    def take_events(self) -> Any:
        """The store's KV events for vLLM's publisher (connector.observability.kv_events)."""
        return self.kv_events.take() if self.scheduler is not None and self.kv_events else ()

    def request_finished(self, request: Any, block_ids: list[int]
                         ) -> tuple[bool, dict[str, Any] | None]:
        return self.scheduler.request_finished(request, block_ids)

    def request_finished_all_groups(self, request: Any, block_ids: tuple[list[int], ...]
                                    ) -> tuple[bool, dict[str, Any] | None]:
        return self.scheduler.request_finished(request, block_ids[0])

    def reset_cache(self) -> bool | None:
        """vLLM's connector cache reset: this engine stops using the store
        (`MooncakeStoreScheduler.forget_store`); the workers keep nothing to reset."""
        if self.scheduler is None:
            return None
        return self.scheduler.forget_store(
            self.kv_events is not None and vllm_clears(self.scheduler.block_pool))

    def bind_gpu_block_pool(self, gpu_block_pool: Any) -> None:
        """vLLM's block pool: sliding-window blocks under a save are pinned in it."""
        if self.scheduler is not None:
            self.scheduler.bind_block_pool(gpu_block_pool)

    # ---- worker side -----------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        self.worker.register_kv_caches(kv_caches, _attn_backend_names(self._vllm_config))

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        """Called before every step's forward, with the step's metadata."""
        assert isinstance(kv_connector_metadata, StepMetadata)
        self.worker.wait_preempted(kv_connector_metadata)
        self.worker.begin_step(kv_connector_metadata)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, StepMetadata)
        self.worker.note_free_after(meta)
        self.worker.start_load(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Loads are whole-request and asynchronous; nothing to wait for per layer."""

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any,
                      **kwargs: Any) -> None:
        """Saves happen once per step in wait_for_save."""

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, StepMetadata)
        self.worker.start_save(meta)

    def get_finished(self, finished_req_ids: set[str]
                     ) -> tuple[set[str] | None, set[str] | None]:
        return self.worker.get_finished()

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """What vLLM polls: failures per request where the model has several KV cache groups
        (connector.scheduler.load_failures), else as block ids only (a partial hit survives)."""
        sending, recving, failed = self.worker.get_transfer_results(finished_req_ids)
        return KVConnectorTransferResults(
            finished_sending=sending, finished_recving=recving,
            failed_recving=failed if self._per_request_failures else set())

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors = self.worker.get_load_errors()  # drained either way
        return set() if self._per_request_failures else errors

    def build_connector_worker_meta(self) -> WorkerReport | None:
        """For the scheduler, after the step: the registered KV layout while it asks for it
        (StepMetadata.need_layout), the step's finished loads, timed (observability.ttft), and
        the preloads read whole (worker.preload)."""
        meta, w = self._connector_metadata, self.worker
        layout = {w.tp_rank: w.kv_signature} if (isinstance(meta, StepMetadata)
                                                 and meta.need_layout and w.kv_signature) else {}
        times, ready = w.take_load_times(), w.take_preloads_ready()
        busy = not w.settled()
        unsettled = {w.tp_rank: busy} if busy != self._reported_busy else {}
        self._reported_busy = busy
        return WorkerReport(layout, times, dict.fromkeys(ready, 1), unsettled) \
            if layout or times is not None or ready or unsettled else None

    def get_kv_connector_kv_cache_events(self) -> Any:
        """This step's saved blocks, for the scheduler's store events (observability.kv_events)."""
        return self.kv_events.take() if self.worker is not None and self.kv_events else None

    # ---- both ------------------------------------------------------------------------------
    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        side = self.worker or self.scheduler
        if self.scheduler is not None and self.kv_events is not None:
            self.kv_events.counted()  # the events taken so far are in this snapshot
        return side.recorder.snapshot() if side is not None else None

    def shutdown(self) -> None:
        if self.scheduler is not None and self.kv_events is not None:
            self.kv_events.shutdown()  # the sweep stops before the store client closes
        for side in (self.worker, self.scheduler):
            if side is not None:
                side.shutdown()


# Loaded by module path (`kv_connector_module_path`), the class is still registered by name:
# MultiConnector looks its members up by class name in the API server.
register()
