"""Slot conservation under random traffic: a Hypothesis state machine against a plain Python
model, a seeded stress of arrivals / chunked prefills / decodes / finishes / evictions, and
proof that ``check_conservation`` catches leaked, double-owned and freed-but-used slots."""
import re

import numpy as np
import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from radixkv.allocator import PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator
from radixkv.cache.kv_conservation import check_conservation, conservation
from radixkv.cache.radix_cache import RadixCache
from radixkv.errors import CapacityError, InvariantError
from radixkv.memory import ReqToTokenPool
from radixkv.scheduler.batch import Batch
from radixkv.scheduler.flow import alloc_for_decode, alloc_for_extend, release_kv_cache
from radixkv.scheduler.req import Req

PREFIXES = [np.arange(1, 1 + n, dtype=np.int32) * k for n, k in ((24, 1), (40, 3), (9, 7))]


class Sim:
    """Pools, tree, a fake KV buffer (slot -> token) and the plain model of the requests:
    rid -> (tokens, tokens that must have KV)."""

    def __init__(self, ps, slots, rows=8, width=160):
        self.ps = ps
        self.pool = ReqToTokenPool(rows, width)
        self.alloc = (TokenToKVPoolAllocator(slots) if ps == 1
                      else PagedTokenToKVPoolAllocator(slots, ps))
        self.tree = RadixCache(self.pool, self.alloc, page_size=ps, enable_kv_events=True)
        self.kv = torch.full((slots + 2 * ps,), -1, dtype=torch.int64)
        self.reqs = {}      # rid -> Req holding a row
        self.model = {}     # rid -> [tokens list, committed]
        self.prefilling = {}  # rid -> final prompt length (chunked)
        self.n_ok = self.n_refused = 0
        self.next_rid = 0

    def batch(self, reqs, fill_lens=None):
        return Batch(reqs, self.pool, self.alloc, self.tree, fill_lens=fill_lens)

    def _state(self):
        return (self.alloc.stats(), self.alloc.free_pages.tolist(), self.pool.available_size(),
                self.tree.evictable_size(), self.tree.protected_size(), self.tree.total_size(),
                [(r.req_pool_idx, r.kv_committed_len, r.cache_protected_len) for r in self.reqs.values()])

    def _attempt(self, fn):
        """Run ``fn``; a CapacityError must leave the state exactly as it was."""
        before = self._state()
        try:
            fn()
        except CapacityError:
            assert self._state() == before
            self.n_refused += 1
            return False
        self.n_ok += 1
        return True

    def arrive(self, prefix_i, tail, chunk=None):
        prompt = np.concatenate([PREFIXES[prefix_i], np.asarray(tail, dtype=np.int32)])
        req = Req(self.next_rid, prompt)
        self.next_rid += 1
        fill = [min(chunk, prompt.size)] if chunk else None

        def go():
            b = self.batch([req], fill)
            out = alloc_for_extend(b)
            self.kv[out] = torch.from_numpy(req.fill_ids[int(b.prefix_lens[0]):req.kv_committed_len].astype(np.int64))

        if self._attempt(go):
            self.reqs[req.rid] = req
            self.model[req.rid] = [prompt.tolist(), req.kv_committed_len]
            if req.kv_committed_len < prompt.size:
                self.tree.cache_unfinished_req(req)
                self.prefilling[req.rid] = prompt.size
        else:
            assert req.req_pool_idx is None and req.last_node is None

    def continue_chunk(self, rid, chunk):
        req = self.reqs[rid]
        end = min(self.prefilling[rid], req.kv_committed_len + chunk)

        def go():
            b = self.batch([req], [end])
            out = alloc_for_extend(b)
            self.kv[out] = torch.from_numpy(req.fill_ids[int(b.prefix_lens[0]):end].astype(np.int64))

        if self._attempt(go):
            self.model[rid][1] = end
            if end < self.prefilling[rid]:
                self.tree.cache_unfinished_req(req)
            else:
                del self.prefilling[rid]

    def decode(self, token):
        ready = [r for rid, r in self.reqs.items() if rid not in self.prefilling]
        if not ready:
            return
        b = self.batch(ready)
        for r in ready:
            r.append_output(token)

        def go():
            out = alloc_for_decode(b)
            self.kv[out] = torch.full((len(ready),), token, dtype=torch.int64)

        if self._attempt(go):
            for r in ready:
                self.model[r.rid][0].append(token)
                self.model[r.rid][1] += 1
        else:  # the scheduler would retract; here the token is simply dropped
            for r in ready:
                r.output_ids = r.output_ids[:-1]

    def finish(self, rid):
        req = self.reqs.pop(rid)
        self.prefilling.pop(rid, None)
        del self.model[rid]
        release_kv_cache(req, self.tree)
        assert req.req_pool_idx is None

    def check(self):
        running = list(self.reqs.values())
        check_conservation(self.alloc, self.tree, running)
        self.tree.check_invariants()
        self.alloc.check_invariants()
        self.pool.check_invariants()
        self.batch(running).check_invariants()
        assert self.pool.available_size() == self.pool.size - len(running)
        for rid, r in self.reqs.items():
            tokens, committed = self.model[rid]
            assert r.fill_ids.tolist() == tokens and r.kv_committed_len == committed
            row = self.pool.req_to_token[r.req_pool_idx, :committed].long()
            assert self.kv[row].tolist() == tokens[:committed], f"request {rid} maps to wrong KV"


class _FlowMachine(RuleBasedStateMachine):
    PS = 1
    SLOTS = 160

    @initialize()
    def setup(self):
        self.sim = Sim(self.PS, self.SLOTS)

    @precondition(lambda self: len(self.sim.reqs) < self.sim.pool.size)
    @rule(prefix_i=st.integers(0, 2), tail=st.lists(st.integers(0, 60), min_size=1, max_size=30),
          chunk=st.one_of(st.none(), st.integers(5, 40)))
    def arrive(self, prefix_i, tail, chunk):
        self.sim.arrive(prefix_i, tail, chunk)

    @precondition(lambda self: self.sim.prefilling)
    @rule(data=st.data(), chunk=st.integers(3, 40))
    def continue_chunk(self, data, chunk):
        self.sim.continue_chunk(data.draw(st.sampled_from(sorted(self.sim.prefilling))), chunk)

    @rule(token=st.integers(0, 60))
    def decode(self, token):
        self.sim.decode(token)

    @precondition(lambda self: self.sim.reqs)
    @rule(data=st.data())
    def finish(self, data):
        self.sim.finish(data.draw(st.sampled_from(sorted(self.sim.reqs))))

    @rule(n=st.integers(0, 64))
    def evict(self, n):
        self.sim.tree.evict(n)

    @invariant()
    def conserved(self):
        if hasattr(self, "sim"):
            self.sim.check()


class FlowMachinePage1(_FlowMachine):
    PS = 1


class FlowMachinePage4(_FlowMachine):
    PS = 4
    SLOTS = 192


TestFlowMachinePage1 = FlowMachinePage1.TestCase
TestFlowMachinePage1.settings = settings(max_examples=25, stateful_step_count=30, deadline=None)
TestFlowMachinePage4 = FlowMachinePage4.TestCase
TestFlowMachinePage4.settings = settings(max_examples=25, stateful_step_count=30, deadline=None)


@pytest.mark.parametrize("ps, slots", [(1, 256), (16, 512)])
def test_seeded_stress(ps, slots):
    rng = np.random.default_rng(1234 + ps)
    sim = Sim(ps, slots, rows=10, width=256)
    for _step in range(250):
        u = rng.random()
        if u < 0.3 and len(sim.reqs) < sim.pool.size:
            chunk = int(rng.integers(8, 64)) if rng.random() < 0.3 else None
            sim.arrive(int(rng.integers(0, 3)), rng.integers(0, 60, int(rng.integers(1, 60))), chunk)
        elif u < 0.4 and sim.prefilling:
            sim.continue_chunk(sorted(sim.prefilling)[int(rng.integers(0, len(sim.prefilling)))],
                               int(rng.integers(8, 64)))
        elif u < 0.85:
            sim.decode(int(rng.integers(0, 60)))
        elif sim.reqs:
            sim.finish(sorted(sim.reqs)[int(rng.integers(0, len(sim.reqs)))])
        sim.check()
    for rid in sorted(sim.reqs):
        sim.finish(rid)
        sim.check()
    c = conservation(sim.alloc, sim.tree, [])
    assert c.protected == 0 and c.held_by_requests == 0 and c.available + c.evictable == slots
    # both the success and the refusal paths were exercised
    assert sim.n_ok > 100 and sim.n_refused > 0


def _busy_sim(ps):
    sim = Sim(ps, 128)
    sim.arrive(0, list(range(5, 30)))
    sim.finish(0)
    sim.arrive(0, list(range(40, 50)))  # shares the cached prefix, holds private slots
    sim.check()
    return sim, next(iter(sim.reqs.values()))


@pytest.mark.parametrize("ps", [1, 4])
def test_detects_a_leaked_slot(ps):
    sim, _ = _busy_sim(ps)
    leaked = sim.alloc.alloc(ps)  # taken out of band, owned by nobody
    page = int(leaked[0]) // ps
    with pytest.raises(InvariantError, match=rf"leaked\): \[{page}\]"):
        check_conservation(sim.alloc, sim.tree, list(sim.reqs.values()))
    with pytest.raises(InvariantError, match=rf"off by {ps}"):
        check_conservation(sim.alloc, sim.tree, list(sim.reqs.values()), exact=False)


@pytest.mark.parametrize("ps", [1, 4])
def test_detects_a_double_owned_slot(ps):
    sim, req = _busy_sim(ps)
    tree_slot = int(sim.tree.all_values()[-1])
    sim.pool.req_to_token[req.req_pool_idx, req.kv_committed_len - 1] = tree_slot
    with pytest.raises(InvariantError, match="duplicated"):
        check_conservation(sim.alloc, sim.tree, list(sim.reqs.values()))


@pytest.mark.parametrize("ps", [1, 4])
def test_detects_a_freed_slot_still_in_use(ps):
    sim, req = _busy_sim(ps)
    slot = int(sim.pool.req_to_token[req.req_pool_idx, req.kv_committed_len - 1])
    sim.alloc.free(torch.tensor([slot]))
    with pytest.raises(InvariantError, match=re.escape(f"double-freed): [{slot // ps}]")):
        check_conservation(sim.alloc, sim.tree, list(sim.reqs.values()))


def test_detects_a_forgotten_request():
    sim, req = _busy_sim(1)
    with pytest.raises(InvariantError, match="leaked"):
        check_conservation(sim.alloc, sim.tree, [])  # its private slots are owned by nobody
