"""A fake vLLM engine for the connector's tests without vLLM: its scheduler and worker halves
(``SchedulerSide`` + ``WorkerSide``) and a paged KV cache in vLLM's CPU layout
``[blocks, kv_heads, block_size, 2 * head_dim]``, stepped in the connector's order."""
import torch

from radixkv.integrations.vllm.first_blocks import FirstBlockIndex, IndexFeed
from radixkv.integrations.vllm.layout import KVShape, paged_kv_views
from radixkv.integrations.vllm.link import ManagerLink
from radixkv.integrations.vllm.scheduler_side import SchedulerSide, vllm_slots
from radixkv.integrations.vllm.worker_side import WorkerSide

BS, HEADS, HD, LAYERS = 4, 2, 8, 2
SHAPE = KVShape(LAYERS, HEADS, HD, "float32", BS)
KEY = "vllm|test-model"


class Engine:
    """One fake vLLM engine. ``index``: give the scheduler side a first-block index, fed from
    the manager's events unless ``feed=False`` (then it is empty and ready: every request is
    an index miss)."""

    def __init__(self, cfg, blocks=16, seed=0, index=False, feed=True):
        self.index = FirstBlockIndex(BS) if index else None
        self.sched = SchedulerSide(ManagerLink(cfg, "sched"), BS, self.index)
        self.sched.link.get(force=True)  # as the connector does at engine start
        self.feed = None
        if self.index is not None:
            if feed:
                self.feed = IndexFeed(self.index, self.sched.link).start()
            else:
                self.index.reset(ready=True)
        self.worker = WorkerSide(ManagerLink(cfg, "worker", keepalive=False, background=False), SHAPE)
        g = torch.Generator().manual_seed(seed)
        self.kv = [torch.randn(blocks, HEADS, BS, 2 * HD, generator=g) for _ in range(LAYERS)]
        self.worker.register([(f"model.layers.{i}.attn", t) for i, t in enumerate(self.kv)])

    def step(self, scheduled, blocks_of, finish_before_report=()):
        """One step: loads, saves, the worker's report (``finish_before_report``: requests
        vLLM finishes before the report arrives). Returns (plan, failed load blocks); the
        requests the plan finishes are in ``self.sent`` (vLLM would free their blocks)."""
        plan = self.sched.build_plan(scheduled, lambda rid: blocks_of[rid])
        failed_blocks = self.worker.load(plan.loads)
        saved, failed = self.worker.save(plan.saves)
        self.sent = list(plan.finish)
        for rid in finish_before_report:
            self.sched.finished(rid)
        self.sched.on_worker_report(saved, failed)
        self.sched.check_invariants()
        return plan, failed_blocks

    def token_kv(self, blocks, n):
        """K/V of tokens [0, n) of a request with ``blocks``: [layers, n, heads, hd] each."""
        slots = torch.from_numpy(vllm_slots(blocks, 0, n, BS))
        ks, vs = [], []
        for t in self.kv:
            k, v = paged_kv_views(t, BS, HEADS, HD)
            ks.append(k[slots // BS, slots % BS])
            vs.append(v[slots // BS, slots % BS])
        return torch.stack(ks), torch.stack(vs)

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
