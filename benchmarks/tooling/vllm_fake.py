"""A fake vLLM engine for the connector's tests without vLLM: its scheduler and worker halves
(``SchedulerSide`` + one ``WorkerSide`` per tensor-parallel rank) and a paged KV cache per rank
in vLLM's CPU layout ``[blocks, rank's kv_heads, block_size, 2 * head_dim]``, stepped in the
connector's order (the ranks' save reports merged as vLLM aggregates them)."""
from typing import Any

import torch

from radixkv.engine.config import EngineConfig
from radixkv.integrations.vllm.config import ConnectorConfig
from radixkv.integrations.vllm.first_blocks import FirstBlockIndex, IndexFeed
from radixkv.integrations.vllm.layout import KVShape, head_shard, paged_kv_views
from radixkv.integrations.vllm.link import ManagerLink
from radixkv.integrations.vllm.scheduler_side import SchedulerSide, vllm_slots
from radixkv.integrations.vllm.worker_side import SaveReport, WorkerSide
from tooling.testing import ThreadedServer

BS, HEADS, HD, LAYERS = 4, 2, 8, 2
SHAPE = KVShape(LAYERS, HEADS, HD, "float32", BS)
LATENT = 12  # an MLA latent row's width (kv_lora_rank 8 + qk_rope_head_dim 4)
MLA_SHAPE = KVShape(LAYERS, 1, LATENT, "float32", BS, latent=True)
KEY = "vllm|test-model"


def connector_manager(cfg: EngineConfig, tmp_path_factory: Any) -> Any:
    """A started manager thread (a ``ThreadedServer``) for ``cfg`` on a Unix socket, with
    ``.cfg``: the connector's ``ConnectorConfig`` for it (its token in a temporary file). The
    caller stops it."""
    srv: Any = ThreadedServer(cfg)
    address = srv.start()
    tok = tmp_path_factory.mktemp("tok") / "token"
    tok.write_text(srv.token)
    srv.cfg = ConnectorConfig(address=address, token_file=str(tok), retry_interval_s=0.05)
    return srv


class Engine:
    """One fake vLLM engine. ``index``: give the scheduler side a first-block index, fed from
    the manager's events unless ``feed=False`` (then it is empty and ready: every request is
    an index miss). ``tp``: tensor-parallel ranks (``workers[r]`` holds rank ``r``'s heads in
    ``kvs[r]``; ``worker`` / ``kv``: rank 0's). ``mla``: an MLA model (vLLM's CPU MLA layout
    ``[blocks, 1, block_size, LATENT]``, one latent head, replicated on every rank). ``shape``:
    another model's ``KVShape`` (default ``SHAPE`` / ``MLA_SHAPE``)."""

    def __init__(self, cfg, blocks=16, seed=0, index=False, feed=True, tp=1, mla=False, shape=None):
        self.shape = shape or (MLA_SHAPE if mla else SHAPE)
        bs = self.shape.page_size
        self.index = FirstBlockIndex(bs) if index else None
        self.sched = SchedulerSide(ManagerLink(cfg, "sched"), bs, self.index)
        self.sched.link.get(force=True)  # as the connector does at engine start
        self.sched.warm()
        self.feed = None
        if self.index is not None:
            if feed:
                self.feed = IndexFeed(self.index, self.sched.link).start()
            else:  # ready for the session's manager epoch (another epoch's asks go to the manager)
                live = self.sched.link.current()
                self.index.reset(ready=True, epoch=live[1].session.epoch if live is not None else None)
        g = torch.Generator().manual_seed(seed)
        self.shards = [head_shard(self.shape.kv_heads, tp, r) for r in range(tp)]
        self.workers, self.kvs = [], []
        for r, shard in enumerate(self.shards):
            w = WorkerSide(ManagerLink(cfg, f"worker{r}", keepalive=False, background=False), self.shape, shard)
            s = self.shape
            dims = (1, bs, s.head_dim) if s.latent else (shard.num, bs, 2 * s.head_dim)
            kv = [torch.randn(blocks, *dims, generator=g) for _ in range(s.layers)]
            w.register([(f"model.layers.{i}.attn", t) for i, t in enumerate(kv)])
            self.workers.append(w)
            self.kvs.append(kv)
        self.worker, self.kv = self.workers[0], self.kvs[0]

    def step(self, scheduled, blocks_of, finish_before_report=()):
        """One step: loads, saves, the worker's report (``finish_before_report``: requests
        vLLM finishes before the report arrives). Returns (plan, failed load blocks); the
        requests the plan finishes are in ``self.sent`` (vLLM would free their blocks)."""
        plan = self.sched.build_plan(scheduled, lambda rid: blocks_of[rid])
        failed_blocks = set().union(*(w.load(plan.loads) for w in self.workers))
        reports = []
        for w in self.workers:
            reports.append(SaveReport())
            reports[-1].add(*w.save(plan.saves))
        report = reports[0]
        for other in reports[1:]:  # as vLLM aggregates the ranks' worker metadata
            report = SaveReport(*report.merged(other))
        self.sent = list(plan.finish)
        for rid in finish_before_report:
            self.sched.finished(rid)
        self.sched.on_worker_report(*report.complete(len(self.workers)))
        self.sched.check_invariants()
        return plan, failed_blocks

    def token_kv(self, blocks, n):
        """The parts (K, V; MLA: the latent) of tokens [0, n) of a request with ``blocks``:
        [layers, n, heads, head_dim] each (every head once: from the rank that writes it)."""
        return tuple(torch.cat(per_rank, dim=2) for per_rank in zip(*(
            self.rank_kv(r, blocks, n) for r, shard in enumerate(self.shards) if shard.writes), strict=True))

    def rank_kv(self, rank, blocks, n):
        """The parts of tokens [0, n) as rank ``rank`` holds them: [layers, n, its heads, head_dim]."""
        s, shard = self.shape, self.shards[rank]
        bs = s.page_size
        slots = torch.from_numpy(vllm_slots(blocks, 0, n, bs))
        views = [paged_kv_views(t, bs, shard.num, s.head_dim, latent=s.latent) for t in self.kvs[rank]]
        return tuple(torch.stack([parts[i][slots // bs, slots % bs] for parts in views])
                     for i in range(len(views[0])))

    def close(self):
        if self.feed is not None:
            self.feed.close()
        self.sched.close()


def idle(manager, *engines):
    """The manager's live requests and protected tokens, once ``engines``' queued commits
    and releases are sent."""
    for e in engines:
        e.sched.flush()
    st = manager.client().stats()
    return st.requests, st.kv_protected
