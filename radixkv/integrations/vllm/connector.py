"""``RadixKVConnector``: the vLLM v1 KV connector (``KVConnectorBase_V1``) over radixkv.

The only module of the package that imports vLLM (checked with vLLM 0.32.0). It maps vLLM's
hooks onto :class:`~radixkv.integrations.vllm.scheduler_side.SchedulerSide` (scheduler role)
and :class:`~radixkv.integrations.vllm.worker_side.WorkerSide` (worker role); what each hook
does: ``docs/vllm.md``, "The hooks". Loads are done before the forward that reads them (hybrid:
asynchronous to vLLM, a failure is a failed receive), saves before the step returns (a deferred
save: in a later step). Every hook catches its own failures: a manager fault never crashes it.
Tensor parallel: each rank copies its own KV heads of the manager rows (which hold all heads);
a save counts once every rank reported it. MLA: the latent rows (refused on vLLM's CPU build
unless ``mla_on_cpu``: ``MLA_ON_CPU`` says why). Hybrid models (``SupportsHMA``: full attention
+ Mamba / GDN groups, vLLM's ``mamba_cache_mode="align"``, one rank): the attention KV and the
recurrent state at whole-block positions. Quantized KV caches, pipeline and context parallel
engines, and other hybrids are refused at start-up.
"""
from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from radixkv.engine.protocol import AttachInfo
from radixkv.errors import InvalidArgumentError
from radixkv.integrations.vllm.config import ConnectorConfig
from radixkv.integrations.vllm.first_blocks import FirstBlockIndex, IndexFeed
from radixkv.integrations.vllm.layout import (
    HeadShard,
    KVShape,
    LayoutMismatchError,
    StateShape,
    dtype_name,
    head_shard,
)
from radixkv.integrations.vllm.link import ManagerClient, ManagerLink
from radixkv.integrations.vllm.scheduler_side import CopyOp, ScheduledReq, SchedulerSide, StateOp
from radixkv.integrations.vllm.worker_side import SaveReport, WorkerSide

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

__all__ = ["RadixKVConnector", "RadixKVConnectorMetadata", "RadixKVWorkerMetadata", "RadixKVStats"]

logger = logging.getLogger("radixkv.integrations.vllm")

_MAX_KEY = 1024  # radixkv's extra_key limit


@dataclass
class RadixKVConnectorMetadata(KVConnectorMetadata):
    """Scheduler -> worker, one step: the copies to do; ``finish``: requests to report
    finished sending after the saves (their kept blocks are freed); hybrid: the state copies,
    and ``unloaded``: asynchronous loads not planned, reported failed (vLLM recomputes them)."""

    loads: list[CopyOp] = field(default_factory=list)
    saves: list[CopyOp] = field(default_factory=list)
    finish: list[str] = field(default_factory=list)
    state_loads: list[StateOp] = field(default_factory=list)
    state_saves: list[StateOp] = field(default_factory=list)
    unloaded: list[str] = field(default_factory=list)


@dataclass
class RadixKVWorkerMetadata(SaveReport, KVConnectorWorkerMetadata):
    """Worker -> scheduler, one step (:class:`SaveReport`); vLLM aggregates the ranks' reports."""

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if not isinstance(other, RadixKVWorkerMetadata):
            return self
        return RadixKVWorkerMetadata(*self.merged(other))


@dataclass
class RadixKVStats(KVConnectorStats):
    """Counter increments of one interval (tokens / requests), summed across workers."""

    def reset(self) -> None:
        self.data: dict[str, Any] = {}  # vLLM's KVConnectorStats.data (counter name -> increment)

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for k, v in (other.data or {}).items():
            self.data[k] = self.data.get(k, 0) + v
        return self

    def reduce(self) -> dict[str, int | float]:
        return dict(self.data)

    def is_empty(self) -> bool:
        return not any(self.data.values())


class _Deltas:
    """Counter dicts -> increments since the last call."""

    def __init__(self) -> None:
        self._last: dict[str, int] = {}

    def take(self, *counters: dict[str, int]) -> dict[str, int]:
        now: dict[str, int] = {}
        for c in counters:
            now.update(c)
        out = {k: v - self._last.get(k, 0) for k, v in now.items() if v != self._last.get(k, 0)}
        self._last = now
        return out


#: Parallel modes refused at start, and why (tensor parallel is supported: each rank copies its heads).
_REFUSED_PARALLEL = {
    "pipeline_parallel_size": "each pipeline stage holds the KV of its own layers only, and the connector "
                              "copies every layer of a block in one worker",
    "prefill_context_parallel_size": "each rank holds part of a request's tokens, not whole blocks",
    "decode_context_parallel_size": "each rank holds part of a request's tokens, not whole blocks",
}


#: Why an MLA model is refused on vLLM's CPU build (``docs/vllm.md``, "MLA").
MLA_ON_CPU = (
    "vLLM's CPU MLA backend does not compute over a loaded prefix what it computes over the same prompt "
    "from scratch (a tiny DeepSeek-V2 with 96 of 100 prompt tokens loaded bit-exact: the first token's "
    "logprob differs by 1e-4, later ones by up to 0.29; vLLM turns its own prefix caching off for MLA on "
    "CPU), so a shared prefix would change outputs; kv_connector_extra_config mla_on_cpu=true shares it anyway")


class _Groups(NamedTuple):
    """vLLM's KV cache groups: the attention group's index and the state groups' (hybrid)."""

    attn: int
    states: tuple[int, ...]


def _groups(kv_cache_config: KVCacheConfig | None) -> _Groups:
    groups = getattr(kv_cache_config, "kv_cache_groups", None) or []
    kinds = [type(g.kv_cache_spec).__name__ for g in groups]
    attn = [i for i, k in enumerate(kinds) if k != "MambaSpec"]
    return _Groups(attn[0] if attn else 0, tuple(i for i, k in enumerate(kinds) if k == "MambaSpec"))


def _refuse_hybrid(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig | None) -> None:
    """A hybrid model is shared when its groups are one full-attention group and Mamba / GDN
    groups in vLLM's ``align`` mode (states at whole blocks: prefix caching on), at one rank."""
    mc = vllm_config.model_config
    groups = getattr(kv_cache_config, "kv_cache_groups", None) or []
    kinds = [type(g.kv_cache_spec).__name__ for g in groups]
    if kinds.count("FullAttentionSpec") != 1 or set(kinds) != {"FullAttentionSpec", "MambaSpec"}:
        raise InvalidArgumentError(f"RadixKVConnector: hybrid model {mc.model!r} has KV cache groups {sorted(kinds)}; "
                                   "only one FullAttentionSpec group with MambaSpec groups is supported")
    modes = {str(getattr(g.kv_cache_spec, "mamba_cache_mode", "none")) for g, k in zip(groups, kinds, strict=True)
             if k == "MambaSpec"}
    if modes != {"align"}:
        raise InvalidArgumentError(f"RadixKVConnector: hybrid model {mc.model!r} runs mamba_cache_mode "
                                   f"{sorted(modes)}; only 'align' keeps states at whole blocks (prefix caching on)")
    if int(vllm_config.parallel_config.tensor_parallel_size) > 1:
        raise InvalidArgumentError(f"RadixKVConnector: hybrid model {mc.model!r} at tensor_parallel_size > 1 is not "
                                   "supported (each rank holds a share of the recurrent states)")


def _refuse_unsupported(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig | None,
                        mla_on_cpu: bool = False) -> None:
    mc = vllm_config.model_config
    mla = bool(getattr(mc, "use_mla", False))
    if getattr(mc, "is_hybrid", False):
        if mla:
            raise InvalidArgumentError(f"RadixKVConnector: hybrid model {mc.model!r} with MLA is not supported")
        _refuse_hybrid(vllm_config, kv_cache_config)
    elif mla and not mla_on_cpu:
        from vllm.platforms import current_platform

        if current_platform.is_cpu():
            raise InvalidArgumentError(f"RadixKVConnector: model {mc.model!r} uses MLA on CPU: {MLA_ON_CPU}")
    groups = getattr(kv_cache_config, "kv_cache_groups", None) or []
    kinds = sorted({type(g.kv_cache_spec).__name__ for g in groups} - {"MambaSpec"})
    want = "MLAAttentionSpec" if mla else "FullAttentionSpec"
    if kinds and kinds != [want]:
        raise InvalidArgumentError(f"RadixKVConnector: KV cache groups {kinds}; only {want} "
                                   "(full attention in every layer) is supported")
    pc = vllm_config.parallel_config
    for key, why in _REFUSED_PARALLEL.items():
        if int(getattr(pc, key, 1) or 1) > 1:
            raise InvalidArgumentError(f"RadixKVConnector: {key}={getattr(pc, key)} is not supported: {why}")
    # the heads split over the ranks (MLA: one latent head, on every rank)
    head_shard(1 if mla else int(mc.get_total_num_kv_heads()), int(pc.tensor_parallel_size), 0)
    cache_dtype = vllm_config.cache_config.cache_dtype
    if cache_dtype not in ("auto", None):
        raise InvalidArgumentError(f"RadixKVConnector: kv_cache_dtype {cache_dtype!r} is not supported "
                                   "(use 'auto': the model dtype)")


def _defer_misses(cfg: ConnectorConfig) -> bool:
    """``defer_miss_saves``; ``"auto"``: when vLLM's engine core runs its own loop (it steps
    again at once to finish a deferred save; an in-process ``LLM`` only at its next call)."""
    if cfg.defer_miss_saves != "auto":
        return bool(cfg.defer_miss_saves)
    import vllm.envs as envs

    return bool(envs.VLLM_ENABLE_V1_MULTIPROCESSING)


def _state_shape(kv_cache_config: KVCacheConfig | None, groups: _Groups) -> tuple[int, StateShape] | None:
    """A hybrid model's attention layer count and :class:`StateShape` (from vLLM's groups)."""
    if not groups.states or kv_cache_config is None:
        return None
    from vllm.model_executor.models.utils import extract_layer_index

    gs = kv_cache_config.kv_cache_groups
    kind = {extract_layer_index(n): "F" for n in gs[groups.attn].layer_names}
    specs = {(tuple(map(tuple, gs[i].kv_cache_spec.shapes)), tuple(map(dtype_name, gs[i].kv_cache_spec.dtypes)))
             for i in groups.states}
    if len(specs) != 1 or len(next(iter(specs))[0]) != 2:
        raise InvalidArgumentError(f"RadixKVConnector: state layers of shapes/dtypes {sorted(specs)}; one (conv, "
                                   "temporal) shape for every state layer is supported")
    (conv, temporal), (conv_dt, temporal_dt) = specs.pop()
    for i in groups.states:
        kind.update({extract_layer_index(n): "K" for n in gs[i].layer_names})
    pattern = "".join(kind[i] for i in sorted(kind))
    return len(gs[groups.attn].layer_names), StateShape(pattern, conv, temporal, conv_dt, temporal_dt)


def _kv_shape(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig | None = None) -> KVShape:
    """The model's KV shape with all its KV heads (what the manager's rows hold at any TP);
    MLA: one latent head of ``kv_lora_rank + qk_rope_head_dim``; hybrid: its attention layers
    and state shapes."""
    mc, pc = vllm_config.model_config, vllm_config.parallel_config
    layers, dtype, block = int(mc.get_num_layers(pc)), dtype_name(mc.dtype), int(vllm_config.cache_config.block_size)
    hybrid = _state_shape(kv_cache_config, _groups(kv_cache_config))
    if hybrid is not None:
        return KVShape(hybrid[0], int(mc.get_total_num_kv_heads()), int(mc.get_head_size()), dtype, block,
                       state=hybrid[1])
    if getattr(mc, "use_mla", False):
        hf = mc.hf_text_config
        return KVShape(layers, 1, int(hf.kv_lora_rank) + int(hf.qk_rope_head_dim), dtype, block, latent=True)
    return KVShape(layers, int(mc.get_total_num_kv_heads()), int(mc.get_head_size()), dtype, block)


def _own_heads(vllm_config: VllmConfig, shape: KVShape) -> HeadShard:
    """This worker's KV heads (its tensor-parallel rank's share)."""
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

    tp = int(vllm_config.parallel_config.tensor_parallel_size)
    return head_shard(shape.kv_heads, tp, int(get_tensor_model_parallel_rank()) if tp > 1 else 0)


class RadixKVConnector(KVConnectorBase_V1, SupportsHMA):
    """vLLM engines share one radixkv cache manager (see the module doc and ``docs/vllm.md``)."""

    _cache_hit_source = CacheHitSource.HOST  # the manager's pool is host (or device) memory

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig | None = None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        tc = self._kv_transfer_config
        self._cfg = ConnectorConfig.from_extra(tc.kv_connector_extra_config)
        _refuse_unsupported(vllm_config, kv_cache_config, self._cfg.mla_on_cpu)
        if self._cfg.recompute_load_failures and tc.kv_load_failure_policy != "recompute":
            tc.kv_load_failure_policy = "recompute"  # a cache: a lost entry is recomputed, not an error
        self._groups = _groups(kv_cache_config)
        self._shape = _kv_shape(vllm_config, kv_cache_config)
        self._world_size = int(vllm_config.parallel_config.world_size)  # workers reporting each step
        self._namespace = self._cfg.namespace or str(vllm_config.model_config.model)
        self._deltas = _Deltas()
        self._sched: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        self._feed: IndexFeed | None = None
        self._load_errors: set[int] = set()
        self._report = RadixKVWorkerMetadata()
        self._sent: set[str] = set()
        self._recved: set[str] = set()  # hybrid: requests whose asynchronous load was done ...
        self._failed_recv: set[str] = set()  # ... or failed (vLLM recomputes them)
        self._async_loads: dict[str, Request] = {}  # hybrid: loads accepted, planned at the next meta
        if role == KVConnectorRole.SCHEDULER:
            link = ManagerLink(self._cfg, "vllm-scheduler", validate=self._check_manager)
            hybrid = self._shape.state is not None
            index = FirstBlockIndex(self._shape.page_size) if _defer_misses(self._cfg) and not hybrid else None
            self._sched = SchedulerSide(link, self._shape.page_size, index, hybrid)
            link.get(force=True)  # connect now (a shape mismatch raises here)
            if isinstance(link.last_error, LayoutMismatchError):
                raise link.last_error
            self._sched.warm()
            if index is not None:
                self._feed = IndexFeed(index, link).start()
        else:
            shard = _own_heads(vllm_config, self._shape)
            link = ManagerLink(self._cfg, f"vllm-worker-heads{shard.first}", keepalive=False, background=False)
            self._worker = WorkerSide(link, self._shape, shard, self._cfg.copy_threads)

    def _check_manager(self, client: ManagerClient, info: AttachInfo) -> None:
        from radixkv.integrations.vllm.layout import check_same_shape, manager_kv_shape

        check_same_shape(self._shape, manager_kv_shape(info.layout["config"]))

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a cache: a dropped save is a later miss

    # ================================================================= worker
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from vllm.model_executor.models.utils import extract_layer_index

        assert self._worker is not None
        layers: list[tuple[str, torch.Tensor]] = sorted(kv_caches.items(), key=lambda kv: extract_layer_index(kv[0]))
        group_of: dict[str, int] = {}
        if self._groups.states and self._kv_cache_config is not None:
            gs = self._kv_cache_config.kv_cache_groups
            group_of = {n: k for k, i in enumerate(self._groups.states) for n in gs[i].layer_names}
        self._worker.register([(n, t) for n, t in layers if n not in group_of],
                              [(n, group_of[n], t) for n, t in layers if n in group_of])

    # The Any below are vLLM's KVConnectorBase_V1 signatures (vLLM is an optional import mypy cannot see).
    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._connector_metadata
        if self._worker is None or not isinstance(meta, RadixKVConnectorMetadata):
            return
        self._failed_recv.update(meta.unloaded)
        if not meta.loads:
            return
        if self._groups.states:  # asynchronous to vLLM (done here): reported by request, not block
            self._failed_recv |= self._worker.load_requests(meta.loads, meta.state_loads)
            self._recved.update(op.req_id for op in meta.loads)
            return
        self._load_errors |= self._worker.load(meta.loads)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads are done in start_load_kv, before the forward

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return  # saves are done in wait_for_save, one copy per layer for the whole step

    def wait_for_save(self) -> None:
        meta = self._connector_metadata
        if self._worker is None or not isinstance(meta, RadixKVConnectorMetadata):
            return
        if meta.saves:
            self._report.add(*self._worker.save(meta.saves))
        if meta.state_saves:  # a state not saved: its request is released, never committed
            self._report.add({}, self._worker.copy_states(meta.state_saves, to_vllm=False))
        self._sent.update(meta.finish)  # saved or failed: vLLM may free their blocks now

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        out, self._sent = self._sent, set()
        recved, self._recved = self._recved, set()
        return out or None, recved or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """``get_finished`` and the failed asynchronous loads (also among the finished ones, as
        vLLM wants): vLLM recomputes those requests whole."""
        sent, recved = self.get_finished(finished_req_ids)
        failed, self._failed_recv = self._failed_recv, set()
        return KVConnectorTransferResults(set(sent or ()), set(recved or ()) | failed, failed)

    def get_block_ids_with_load_errors(self) -> set[int]:
        out, self._load_errors = self._load_errors, set()
        return out

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        if not self._report.saved and not self._report.failed:
            return None
        out, self._report = self._report, RadixKVWorkerMetadata()
        return out

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        side = self._worker or self._sched
        if side is None:
            return None
        d = self._deltas.take({f"{'worker' if self._worker else 'scheduler'}_{k}": v
                               for k, v in {**side.counters, **side.link.counters}.items()})
        return RadixKVStats(data=d) if d else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return RadixKVStats(data=dict(data or {}))

    # ================================================================= scheduler
    def _extra_key(self, request: Request) -> str:
        key = f"vllm|{self._namespace}"
        lora = getattr(request, "lora_request", None)
        if lora is not None:
            key += f"|lora={lora.lora_name}#{lora.lora_int_id}"
        salt = getattr(request, "cache_salt", None)
        if salt:
            key += f"|salt={salt}"
        if len(key) > _MAX_KEY:
            key = "vllm|sha256=" + hashlib.sha256(key.encode()).hexdigest()
        return key

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self._sched is not None
        try:
            prompt = request.prompt_token_ids
            cacheable = prompt is not None and not request.mm_features and request.prompt_embeds is None
            n = self._sched.num_new_matched_tokens(request.request_id, prompt or [], num_computed_tokens,
                                                   self._extra_key(request), cacheable)
        except Exception:
            logger.exception("radixkv: match failed for %s; computing it", request.request_id)
            n = 0
        # a hybrid model's load is asynchronous: vLLM takes a failed one by request only (several groups)
        return n, bool(self._groups.states) and n > 0

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        assert self._sched is not None
        if self._groups.states and num_external_tokens > 0:  # waits (unscheduled) for its load's report
            self._async_loads[request.request_id] = request
        self._sched.after_alloc(request.request_id, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self._sched is not None
        so = scheduler_output
        blocks: dict[str, list[int]] = {}
        all_blocks: dict[str, tuple[list[int], ...]] = {}
        scheduled: list[ScheduledReq] = []
        g = self._groups
        for r in so.scheduled_new_reqs:
            blocks[r.req_id] = list(r.block_ids[g.attn])
            all_blocks[r.req_id] = tuple(r.block_ids)
            scheduled.append(ScheduledReq(r.req_id, r.num_computed_tokens, so.num_scheduled_tokens[r.req_id]))
        c = so.scheduled_cached_reqs
        for i, rid in enumerate(c.req_ids):
            scheduled.append(ScheduledReq(rid, c.num_computed_tokens[i], so.num_scheduled_tokens[rid]))
        loading, self._async_loads = self._async_loads, {}
        scheduled += [ScheduledReq(rid, int(r.num_computed_tokens), 0) for rid, r in loading.items()]

        def block_ids_of(rid: str) -> list[int]:
            if rid not in blocks:
                assert self._kv_cache_manager is not None
                blocks[rid] = list(self._kv_cache_manager.get_block_ids(rid)[g.attn])
            return blocks[rid]

        def state_blocks_of(rid: str) -> list[list[int]]:
            if rid not in all_blocks:
                assert self._kv_cache_manager is not None
                all_blocks[rid] = tuple(self._kv_cache_manager.get_block_ids(rid))
            return [list(all_blocks[rid][i]) for i in g.states]

        try:
            plan = self._sched.build_plan(scheduled, block_ids_of, state_blocks_of if g.states else None)
        except Exception:
            logger.exception("radixkv: planning the step's copies failed; no copies this step")
            # kept blocks never leak, waiting loads never hang
            return RadixKVConnectorMetadata(finish=self._sched.take_finish(), unloaded=list(loading))
        planned = {op.req_id for op in plan.loads}
        return RadixKVConnectorMetadata(plan.loads, plan.saves, plan.finish, list(plan.state_loads),
                                        list(plan.state_saves), [r for r in loading if r not in planned])

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        assert self._sched is not None
        meta = connector_output.kv_connector_worker_meta
        try:
            if isinstance(meta, RadixKVWorkerMetadata):
                self._sched.on_worker_report(*meta.complete(self._world_size))
            else:
                self._sched.on_worker_report({})
        except Exception:
            logger.exception("radixkv: commit failed")

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        if self._sched is not None:
            try:
                return self._sched.finished(request.request_id, block_ids), None
            except Exception:
                logger.exception("radixkv: release of %s failed", request.request_id)
        return False, None

    def request_finished_all_groups(self, request: Request,
                                    block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        """``SupportsHMA``: as ``request_finished`` with the attention group's blocks (a hybrid
        request's state is saved in the step that computed it, never from the finished blocks)."""
        return self.request_finished(request, list(block_ids[self._groups.attn]) if block_ids else [])

    def shutdown(self) -> None:
        side = self._sched or self._worker
        if side is not None:
            logger.info("radixkv connector counters: %s", {**side.counters, **side.link.counters})
        if self._feed is not None:
            self._feed.close()
        if self._sched is not None:
            self._sched.close()
        elif self._worker is not None:
            self._worker.link.close()
