"""The worker side of ``radixkv demo``: the reference hybrid model (KDA + full attention) run
through the cache-engine protocol, reading and writing KV and states straight in the
engine's buffers, and checked against a from-scratch forward.

* :func:`demo_model_config` / :func:`engine_config_for`: the tiny fp64 model and its engine.
* :class:`TimedEngine`: any ``CacheEngineAPI`` with each call's latency recorded.
* :class:`HybridWorker`: one request: prefill chunks (``alloc_extend`` + ``extend``,
  ``cache_unfinished`` checkpoints), greedy decode steps, ``cache_finished``, then every
  logit compared with ``forward_reference``.
* :func:`worker_main`: a worker process (``spawn``): connect, attach, map, run, report.

A chunk ends at ``kv_prefix_len`` (Marconi's speculative checkpoint) and at the prompt's last
block boundary, where the next turn will hit. Why: ``docs/demo.md``, "The workers".
"""
from __future__ import annotations

import math
import time
import traceback
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
import torch

from radixkv.engine.config import EngineConfig
from radixkv.engine.protocol import DecodeItem, ExtendItem, MatchQuery, Session
from radixkv.errors import InvalidArgumentError, InvariantError
from radixkv.reference import HybridConfig, HybridModel, ModelCache

if TYPE_CHECKING:  # pragma: no cover
    from multiprocessing.queues import Queue

    from radixkv.engine.buffers import WorkerBuffers

__all__ = ["demo_model_config", "engine_config_for", "TimedEngine", "RequestReport", "HybridWorker",
           "worker_main", "TOLERANCE", "PROTOCOL_CALLS"]

#: Largest |logit - reference| accepted, per model dtype.
TOLERANCE = {torch.float64: 1e-9, torch.float32: 1e-5}
PROTOCOL_CALLS = frozenset({"attach", "heartbeat", "detach", "match", "alloc_extend", "alloc_decode",
                            "cache_unfinished", "cache_finished", "release", "evict", "stats", "flush",
                            "take_events"})


def demo_model_config(**changes: Any) -> HybridConfig:
    """The demo's model: Kimi-Linear-like ``KKKF`` (3 KDA layers per full-attention layer),
    hidden 32, 2 heads of 8, vocab 512, fp64 (so a cached run equals a fresh one to 1e-9)."""
    base: dict[str, Any] = dict(vocab=512, hidden=32, num_heads=2, head_dim=8, conv_kernel=4, layer_pattern="KKKF",
                dtype=torch.float64, seed=0, mlp_mult=2, chunk_size=16)
    base.update(changes)
    return HybridConfig(**base)


def engine_config_for(model: HybridConfig, **fields: Any) -> EngineConfig:
    """An :class:`EngineConfig` whose pools fit ``model`` (layer types, KV heads, KDA state
    shapes, dtypes); ``fields`` sets the rest (sizes, page size, device, leases...)."""
    dtype = str(model.dtype).replace("torch.", "")
    return EngineConfig(layer_types=model.layer_pattern, head_num=model.num_heads, head_dim=model.head_dim,
                        kv_dtype=dtype, conv_kernel=model.conv_kernel, kda_num_heads=model.num_heads,
                        kda_head_dim=model.head_dim, state_dtype=dtype, **fields)


class TimedEngine:
    """Wraps an engine (embedded or remote): every protocol call's wall time, in seconds, is
    appended to ``latencies`` (raising calls too). Other attributes pass through."""

    def __init__(self, engine: Any):
        self.engine = engine
        self.latencies: list[float] = []

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.engine, name)
        if name not in PROTOCOL_CALLS:
            return attr
        lat = self.latencies

        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return attr(*args, **kwargs)
            finally:
                lat.append(time.perf_counter() - t0)

        return timed


class RequestReport(NamedTuple):
    """What one request did. ``prefix_len``: prompt tokens skipped (a cached state + KV was
    forked); ``kv_prefix_len``: prompt tokens whose KV was cached (>= ``prefix_len``);
    ``computed``: tokens run through the model; ``checkpoints``: chunk ends cached with
    their state; ``max_abs_diff``: worst |logit - reference| (``nan`` when not verified)."""

    rid: str
    worker: str
    prompt_len: int
    prefix_len: int
    kv_prefix_len: int
    computed: int
    decoded: int
    checkpoints: int
    verified: bool
    max_abs_diff: float
    ok: bool


class HybridWorker:
    """Runs requests through ``engine`` (a ``CacheEngineAPI``) and ``model`` over ``buffers``
    (the engine's :class:`~radixkv.engine.buffers.WorkerBuffers`), as session ``session``.

    Args:
        block: tokens per trace block (chunk ends are planned at block boundaries).
        name: this worker's name in reports.
    """

    def __init__(self, engine: Any, session: Session, buffers: WorkerBuffers, model: HybridModel, *,
                 block: int = 16, name: str = "worker"):
        if block < 1:
            raise InvalidArgumentError(f"block must be >= 1, got {block}")
        self.engine, self.session, self.buffers, self.model = engine, session, buffers, model
        self.cache = ModelCache.over(buffers)
        self.block, self.name = int(block), name
        self.tol = TOLERANCE[model.config.dtype]

    def plan_chunks(self, prompt_len: int, prefix_len: int, kv_prefix_len: int) -> list[int]:
        """Ends of the prefill chunks (ascending, the last is ``prompt_len``). O(1)."""
        ends = {prompt_len}
        if prefix_len < kv_prefix_len < prompt_len:
            ends.add(kv_prefix_len)
        last_block = (prompt_len - 1) // self.block * self.block
        if max(prefix_len, 0) < last_block < prompt_len:
            ends.add(last_block)
        return sorted(e for e in ends if e > prefix_len)

    def run_request(self, rid: str, prompt: np.ndarray, decode_steps: int, verify: bool = True) -> RequestReport:
        """Prefill ``prompt`` (int32), decode ``decode_steps`` greedy tokens, finish (the
        request's tokens and final state go to the tree), and, with ``verify``, compare every
        logit computed with ``forward_reference``. Raises what the engine raises."""
        e, s, mc, model = self.engine, self.session, self.cache, self.model
        prompt = np.ascontiguousarray(prompt, dtype=np.int32)
        T = int(prompt.size)
        (m,) = e.match(s, [MatchQuery(prompt[:-1])])
        ends = self.plan_chunks(T, m.prefix_len, m.kv_prefix_len)
        logits: dict[int, torch.Tensor] = {}
        sent, computed = 0, 0
        prefix: int | None = None
        last: torch.Tensor | None = None
        for i, end in enumerate(ends):
            (r,) = e.alloc_extend(s, [ExtendItem(rid, prompt[sent:end])])
            sent = end
            if prefix is None:
                prefix = r.prefix_len
            row = self.buffers.req_to_token[r.req_pool_idx, :r.start].to(torch.int64)
            out = model.extend(prompt[r.start:r.seq_len], r.start, row, r.out_cache_loc, r.mamba_slot, mc,
                               track_slot=r.track_slot, track_seqlen=r.track_seqlen)
            logits.update({r.start + j: out[j] for j in range(out.shape[0])})
            computed += r.seq_len - r.start
            last = out[-1]
            if i + 1 < len(ends):
                e.cache_unfinished(s, [rid])
        if prefix is None or last is None:   # plan_chunks always ends at the prompt's end
            raise InvariantError(f"request {rid!r}: no prefill chunk was planned ({T} tokens, ends {ends})")
        tokens = [prompt]
        dev = model.device
        for _ in range(decode_steps):
            nxt = int(torch.argmax(last))
            d = e.alloc_decode(s, [DecodeItem(rid, nxt)])
            out = model.decode(torch.tensor([nxt], device=dev), d.req_pool_indices, d.seq_lens, d.out_cache_loc,
                               d.mamba_slots, mc, d.track_slots if d.track_slots.size else None)
            pos = int(d.seq_lens[0]) - 1
            logits[pos] = out[0]
            tokens.append(np.array([nxt], dtype=np.int32))
            computed += 1
            last = out[0]
        e.cache_finished(s, [rid])
        diff, ok = math.nan, True
        if verify:
            fed = np.concatenate(tokens)
            ref = model.forward_reference(fed)
            positions = sorted(logits)
            got = torch.stack([logits[p] for p in positions])
            diff = float((got - ref[positions]).abs().max())
            ok = diff <= self.tol
        return RequestReport(rid, self.name, T, int(prefix), int(m.kv_prefix_len), computed, decode_steps,
                             len(ends) - 1, bool(verify), diff, ok)


def worker_main(address: str, token: str, name: str, model_config: HybridConfig,
                jobs: Sequence[tuple[str, np.ndarray, int]], verify_every: int, block: int,
                q: Queue[tuple[str, Any]]) -> None:
    """A worker process (``multiprocessing`` spawn): connect to the manager at ``address``,
    attach, map its buffers, run ``jobs`` (``(rid, prompt, decode_steps)``) in order, and
    report through ``q``: ``("request", RequestReport dict)`` per request, then
    ``("done", {"latencies": [...]})``; on any error ``("error", traceback)``. Verifies every
    ``verify_every``-th request (1: all). Detaches before it exits."""
    try:
        torch.set_num_threads(1)
        from radixkv.service.client import connect

        with connect(address, token=token, wait_s=60, timeout_s=60) as client:
            engine = TimedEngine(client)
            info = engine.attach(name)
            buffers = client.worker_buffers(info)  # the manager's pools, mapped (shared memory / CUDA IPC)
            worker = HybridWorker(engine, info.session, buffers, HybridModel(model_config, buffers.device),
                                  block=block, name=name)
            t_start = time.time()  # wall clock: comparable across the demo's processes
            for k, (rid, prompt, steps) in enumerate(jobs):
                rep = worker.run_request(rid, prompt, steps, verify=verify_every > 0 and k % verify_every == 0)
                q.put(("request", rep._asdict()))
            t_end = time.time()
            engine.detach(info.session)
            q.put(("done", {"worker": name, "latencies": engine.latencies, "t_start": t_start, "t_end": t_end}))
    except BaseException:  # reported to the parent, which fails the demo
        q.put(("error", f"{name}: {traceback.format_exc()}"))
