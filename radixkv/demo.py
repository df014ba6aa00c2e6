"""``radixkv demo``: an embedded walk-through of one scheduler cycle, printing the pools' state.

Two requests share a system prompt. The first is prefilled (extend), decodes a few tokens,
and is released into the radix tree; the second then finds the shared prefix in the tree,
reuses those KV rows, and only computes its own tokens. After every step the demo prints
where every KV slot is (free / in the tree / held by a running request) and checks the
conservation law and every structure's invariants.
"""
from __future__ import annotations

from typing import List

import numpy as np
import torch

from radixkv.allocator import TokenToKVPoolAllocator
from radixkv.cache import RadixCache
from radixkv.memory import MHATokenToKVPool, ReqToTokenPool
from radixkv.scheduler import (
    Batch,
    Req,
    alloc_for_decode,
    alloc_for_extend,
    check_conservation,
    conservation,
    release_kv_cache,
)


class _Walkthrough:
    def __init__(self, device: str, kv_tokens: int = 256, rows: int = 4, max_ctx: int = 128):
        self.device = torch.device(device)
        self.req_to_token = ReqToTokenPool(rows, max_ctx, device=self.device)
        self.kv = MHATokenToKVPool(kv_tokens, 1, torch.float32, head_num=2, head_dim=8,
                                   layer_num=2, device=self.device)
        self.allocator = TokenToKVPoolAllocator(kv_tokens, device=self.device, need_sort=True,
                                                kvcache=self.kv)
        self.tree = RadixCache(self.req_to_token, self.allocator, page_size=1)
        self.running: List[Req] = []

    def show(self, title: str) -> None:
        c = conservation(self.allocator, self.tree, self.running)
        check_conservation(self.allocator, self.tree, self.running)
        self.allocator.check_invariants()
        self.req_to_token.check_invariants()
        self.tree.check_invariants()
        print(f"\n== {title}")
        print(f"   KV slots: {c.available:4d} free | {c.evictable:4d} evictable in tree | "
              f"{c.protected:4d} protected in tree | {c.held_by_requests:4d} held by requests "
              f"| {c.pool_size} total  (conservation holds)")
        print(f"   request rows free: {self.req_to_token.available_size()}/{self.req_to_token.size}")
        for r in self.running:
            row = self.req_to_token.req_to_token[r.req_pool_idx, : r.kv_committed_len].tolist()
            print(f"   {r.rid}: row {r.req_pool_idx}, {r.kv_committed_len} tokens with KV, "
                  f"{r.prefix_len} reused from the tree; req_to_token[{r.req_pool_idx}, :8] = {row[:8]}")

    def write_kv(self, batch: Batch) -> None:
        """Stand-in for a forward pass: write each new token's K/V (its token id) into the
        KV buffers at the slots the step allocated."""
        toks = torch.cat([torch.as_tensor(r.fill_ids[int(p): int(p) + int(e)])
                          for r, p, e in zip(batch.reqs, batch.prefix_lens, batch.extend_lens)])
        val = toks.to(torch.float32).view(-1, 1, 1).expand(-1, 2, 8).to(self.device)
        for layer in range(2):
            self.kv.set_kv_buffer(layer, batch.out_cache_loc, val, val)

    def step_extend(self, reqs: List[Req]) -> None:
        batch = Batch(reqs, self.req_to_token, self.allocator, self.tree, kv_pool=self.kv)
        alloc_for_extend(batch)
        self.running += [r for r in reqs if r not in self.running]
        self.write_kv(batch)
        self.show(f"extend {[r.rid for r in reqs]}: {batch.extend_num_tokens} new KV slots, "
                  f"prefix lens {batch.prefix_lens.tolist()}")

    def step_decode(self, reqs: List[Req], rng: np.random.Generator) -> None:
        for r in reqs:
            r.append_output(int(rng.integers(1000, 2000)))
        batch = Batch(reqs, self.req_to_token, self.allocator, self.tree, kv_pool=self.kv)
        alloc_for_decode(batch)
        self.write_kv(batch)

    def release(self, req: Req) -> None:
        release_kv_cache(req, self.tree, self.req_to_token)
        self.running.remove(req)
        self.show(f"release {req.rid}: its tokens are cached in the tree")


def run_demo(device: str = "cpu") -> int:
    rng = np.random.default_rng(0)
    w = _Walkthrough(device)
    system = rng.integers(0, 1000, 40).astype(np.int32)
    a = Req("req-A", np.concatenate([system, rng.integers(0, 1000, 12).astype(np.int32)]))
    b = Req("req-B", np.concatenate([system, rng.integers(0, 1000, 20).astype(np.int32)]))
    print(f"radixkv demo on {device}: two requests share a {system.size}-token system prompt")
    w.show("start")
    w.step_extend([a])
    for _ in range(6):
        w.step_decode([a], rng)
    w.show("req-A decoded 6 tokens")
    w.release(a)
    w.step_extend([b])
    reused = w.kv.get_key_buffer(0)[b.prefix_indices][:, 0, 0].to(torch.int64).cpu().numpy()
    ok = np.array_equal(reused, b.fill_ids[: b.prefix_len])
    print(f"   req-B reads {b.prefix_len} cached K rows written by req-A: "
          f"{'they hold its prompt tokens' if ok else 'MISMATCH'}")
    for _ in range(4):
        w.step_decode([b], rng)
    w.release(b)
    evicted = w.tree.evict(10_000)
    w.show(f"evict everything unlocked: {evicted} slots back to the allocator")
    return 0 if ok else 1
