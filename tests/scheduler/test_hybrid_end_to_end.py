"""End to end: the reference hybrid model (KDA + full attention) run through the REAL pools
(HybridReqToTokenPool + MambaPool + HybridLinearKVPool over MHATokenToKVPool + the KV
allocator), the scheduler flow and the MambaRadixCache. Every logit produced with cache
reuse (prefix hit + state fork, chunked prefill, decode, after full and state evictions,
page sizes 1 and 16, requests sharing a prefix and diverging) must equal
``forward_reference`` from scratch: fp64 within 1e-9, fp32 within 1e-5.

Each logit is recorded at its token position; since the model is causal, one
``forward_reference`` over a request's final tokens checks all of them at once.
"""
import numpy as np
import pytest
import torch

from radixkv.allocator import PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator
from radixkv.cache.hybrid.mamba_radix_cache import MambaRadixCache
from radixkv.cache.kv_conservation import check_conservation
from radixkv.errors import CapacityError
from radixkv.memory import HybridLinearKVPool, HybridReqToTokenPool, MambaPool, MHATokenToKVPool
from radixkv.reference import HybridConfig, HybridModel, ModelCache
from radixkv.scheduler.batch import Batch
from radixkv.scheduler.flow import alloc_for_decode, alloc_for_extend, release_kv_cache
from radixkv.scheduler.req import Req

TOL = {torch.float64: 1e-9, torch.float32: 1e-5}
VOCAB = 40
MODELS = {}


def model(dtype, device):
    key = (dtype, str(device))
    if key not in MODELS:
        cfg = HybridConfig(vocab=VOCAB, hidden=16, num_heads=2, head_dim=8, layer_pattern="KFKK",
                           dtype=dtype, chunk_size=8, seed=3)
        MODELS[key] = HybridModel(cfg, device)
    return MODELS[key]


def toks(n, rng):
    return rng.integers(0, VOCAB, n).astype(np.int32)


class Runner:
    """Pools + tree + model; records every logit by (request, position) and checks them."""

    def __init__(self, dtype=torch.float64, ps=1, kv=512, slots=8, rows=6, width=160, device="cpu",
                 track=False, interval=None, **tree_kw):
        """``track``: the request pool's ``mamba_ping_pong_track_buffer`` (two more slots per
        row, added to ``slots``), every ``interval`` tokens (default: the page size)."""
        self.model, self.dtype, self.ps, self.dev = model(dtype, device), dtype, ps, torch.device(device)
        cfg = self.model.config
        self.kv = MHATokenToKVPool(kv, ps, dtype, cfg.num_heads, cfg.head_dim, len(cfg.full_layer_ids), device)
        slots += 2 * rows if track else 0
        self.mamba = MambaPool(slots, cfg.conv_state_shape, cfg.temporal_state_shape, len(cfg.kda_layer_ids), dtype,
                               device)
        self.hkv = HybridLinearKVPool(self.kv, list(cfg.full_layer_ids), self.mamba)
        self.pool = HybridReqToTokenPool(rows, width, mamba_pool=self.mamba, device=device,
                                         enable_mamba_extra_buffer=track, mamba_track_interval=interval)
        self.alloc = (TokenToKVPoolAllocator(kv, device) if ps == 1
                      else PagedTokenToKVPoolAllocator(kv, ps, device))
        self.tree = MambaRadixCache(self.pool, self.alloc, page_size=ps, **tree_kw)
        self.pools = ModelCache(self.hkv, self.hkv.mamba2_layer_cache, self.pool.req_to_token)
        self.running, self.logits, self.checked = [], {}, 0

    def extend(self, reqs, fill_lens=None):
        b = Batch(reqs, self.pool, self.alloc, self.tree, fill_lens=fill_lens, kv_pool=self.hkv)
        alloc_for_extend(b)
        for i, r in enumerate(reqs):
            p, s = int(b.prefix_lens[i]), int(b.seq_lens_cpu[i])
            row = self.pool.req_to_token[r.req_pool_idx, :s].long()
            tr = {} if b.mamba_track_indices is None else dict(
                track_slot=int(b.mamba_track_indices[i]), track_seqlen=int(b.mamba_track_seqlens[i]))
            out = self.model.extend(r.fill_ids[p:s], p, row[:p], row[p:s], r.mamba_pool_idx, self.pools, **tr)
            self.logits.setdefault(r.rid, {}).update({p + j: out[j] for j in range(s - p)})
            if r not in self.running:
                self.running.append(r)
        self.check()
        return b

    def decode(self, reqs, rng):
        for r in reqs:
            r.append_output(int(rng.integers(0, VOCAB)))
        b = Batch(reqs, self.pool, self.alloc, self.tree, kv_pool=self.hkv)
        out_loc = alloc_for_decode(b)
        last = torch.tensor([int(r.fill_ids[r.seq_len - 1]) for r in reqs], device=self.dev)
        out = self.model.decode(last, b.req_pool_indices, b.seq_lens, out_loc,
                                torch.tensor([r.mamba_pool_idx for r in reqs], device=self.dev), self.pools,
                                b.mamba_track_indices)
        for r, lg in zip(reqs, out):
            self.logits[r.rid][r.seq_len - 1] = lg
        self.check()

    def chunk_done(self, r):
        self.tree.cache_unfinished_req(r)
        self.check()

    def finish(self, r, final_token=True, rng=None):
        self.verify(r)
        if final_token:  # the token the last step produced: no KV, no state
            r.append_output(int((rng or np.random.default_rng(0)).integers(0, VOCAB)))
        release_kv_cache(r, self.tree)
        self.running.remove(r)
        self.check()

    def verify(self, r):
        got = self.logits[r.rid]
        n = max(got) + 1
        ref = self.model.forward_reference(r.fill_ids[:n])
        pos = sorted(got)
        diff = (torch.stack([got[p] for p in pos]) - ref[pos]).abs().max().item()
        assert diff <= TOL[self.dtype], f"request {r.rid}: logits differ by {diff:.3g} from scratch"
        self.checked += len(pos)

    def check(self):
        self.tree.check_invariants(self.running)
        check_conservation(self.alloc, self.tree, self.running)
        self.pool.check_invariants(self.running)
        self.alloc.check_invariants()

    def slot_state(self, slot):
        return self.mamba.conv_state[:, slot].clone(), self.mamba.temporal_state[:, slot].clone()


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("ps", [1, 16])
def test_shared_prefix_fork_and_diverge(ps, dtype, device):
    """A finishes at a page-aligned position and hands its state to the tree; B and C extend
    A's text differently in one batch: both hit A's state, fork it, decode together. The
    cached state is never mutated by them."""
    rng = np.random.default_rng(1)
    run = Runner(dtype, ps, device=device)
    a = Req("a", toks(29, rng))
    run.extend([a])
    for _ in range(3):
        run.decode([a], rng)  # committed 32: A's state sits at a page end
    fill_a = a.fill_ids.copy()
    run.finish(a, rng=rng)
    assert run.tree.mamba_total_size() == 1 and a.mamba_pool_idx is None  # slot handed over, no copy
    b = Req("b", np.concatenate([fill_a, toks(7, rng)]))
    c = Req("c", np.concatenate([fill_a, toks(12, rng)]))
    batch = run.extend([b, c])
    assert batch.prefix_lens.tolist() == [32, 32]
    assert b.last_node is c.last_node and run.tree.state_slot(b.last_node) is not None
    cached = run.tree.state_slot(b.last_node)
    before = run.slot_state(cached)
    for _ in range(4):
        run.decode([b, c], rng)
    after = run.slot_state(cached)
    assert torch.equal(before[0], after[0]) and torch.equal(before[1], after[1])
    run.finish(b, rng=rng)
    run.finish(c, rng=rng)
    assert run.checked > 0


@pytest.mark.parametrize("ps", [1, 16])
def test_chunked_prefill_states_at_chunk_ends(ps):
    """Chunked prefill: chunk ends that are page ends get a state (a fork, the request keeps
    writing its own slot); unaligned ones leave a tombstone. A later request hits the
    deepest chunk-end state and reproduces the logits."""
    rng = np.random.default_rng(2)
    run = Runner(torch.float64, ps)
    a = Req("a", toks(58, rng))
    for end in (20, 32, 50):
        run.extend([a], fill_lens=[end])
        if end < 58:
            run.chunk_done(a)
            slot = run.tree.state_slot(a.last_node)
            aligned = end - end % ps
            assert a.cache_protected_len == aligned
            assert (slot is not None) == (aligned == end), (end, slot)
            assert slot != a.mamba_pool_idx
    run.extend([a])  # the rest of the prompt
    run.decode([a], rng)
    d = Req("d", np.concatenate([a.origin_input_ids[:45], toks(6, rng)]))
    b = run.extend([d])
    assert int(b.prefix_lens[0]) == 32  # the chunk end at 32 is the deepest state on d's path
    e = Req("e", np.concatenate([a.origin_input_ids[:24], toks(5, rng)]))
    b = run.extend([e])  # page 16: the node at 16 is a tombstone (the state there was at 20)
    assert int(b.prefix_lens[0]) == (20 if ps == 1 else 0)
    run.finish(e, rng=rng)
    run.finish(a, rng=rng)
    run.decode([d], rng)
    run.finish(d, rng=rng)


def test_branch_admission_skips_leaf_chunk_ends():
    """``branch``: a chunk end on a fresh leaf gets no state; one at a branch point (a
    node with children, reached by ending the chunk at kv_prefix_len) does."""
    rng = np.random.default_rng(3)
    run = Runner(torch.float64, 1, admission_policy="branch")
    a = Req("a", toks(30, rng))
    run.extend([a], fill_lens=[12])
    run.chunk_done(a)
    assert run.tree.state_slot(a.last_node) is None  # a leaf: not admitted
    run.extend([a])
    run.finish(a, rng=rng)
    m = run.tree.match_prefix(a.origin_input_ids[:20])
    assert m.prefix_len == 0 and m.kv_prefix_len == 20  # KV there, no state: a branch point
    e = Req("e", np.concatenate([a.origin_input_ids[:20], toks(9, rng)]))
    run.extend([e], fill_lens=[m.kv_prefix_len])  # Marconi: checkpoint at the branch point
    run.chunk_done(e)
    assert run.tree.state_slot(e.last_node) is not None
    run.extend([e])
    run.finish(e, rng=rng)
    f = Req("f", np.concatenate([a.origin_input_ids[:20], toks(5, rng)]))
    assert int(run.extend([f]).prefix_lens[0]) == 20
    run.finish(f, rng=rng)


@pytest.mark.parametrize("ps", [1, 16])
def test_reuse_after_full_and_state_evictions(ps):
    """States evicted (tombstones, or whole unlocked leaves), then all KV: later requests
    fall back to the nearest surviving state (never a tombstone) and still match the
    reference."""
    rng = np.random.default_rng(4)
    run = Runner(torch.float64, ps)
    base = toks(48, rng)
    for i in range(3):
        r = Req(f"w{i}", np.concatenate([base[:16 * (i + 1)], toks(15, rng)]))
        run.extend([r], fill_lens=[16 * (i + 1)])
        run.chunk_done(r)  # states at 16, 32, 48
        run.extend([r])
        run.finish(r, rng=rng)
    probe = np.concatenate([base, toks(5, rng)])
    m = run.tree.match_prefix(probe)
    assert m.prefix_len == 48
    deepest = m.last_node
    run.tree.match_prefix(base[:40])  # 16 and 32 are now more recent than 48
    while run.tree.state_slot(deepest) is not None:
        assert run.tree.evict(0, 1).num_states == 1
        run.check()
    m = run.tree.match_prefix(probe)
    assert m.prefix_len < 48 and m.kv_prefix_len >= m.prefix_len
    assert m.prefix_len == 0 or run.tree.state_slot(m.last_node) is not None
    g = Req("g", probe)
    assert int(run.extend([g]).prefix_lens[0]) == m.prefix_len
    run.decode([g], rng)
    run.finish(g, rng=rng)
    res = run.tree.evict(run.tree.evictable_size())  # everything unlocked goes, states with it
    assert run.tree.total_size() == 0 and run.tree.mamba_total_size() == 0 and res.num_states >= 1
    run.check()
    h = Req("h", probe)
    assert int(run.extend([h]).prefix_lens[0]) == 0
    run.finish(h, rng=rng)


@pytest.mark.parametrize("dtype,ps,seed", [(torch.float64, 1, 0), (torch.float64, 16, 1),
                                           (torch.float32, 1, 2), (torch.float32, 16, 3)])
def test_seeded_stress(dtype, ps, seed, device):
    """Random prompts built from earlier requests' text (shared prefixes, divergences),
    chunked or whole prefill, batched decodes, finishes, on pools small enough that the flow
    evicts KV and states on its own."""
    rng = np.random.default_rng(seed)
    run = Runner(dtype, ps, kv=400, slots=5, rows=4, width=128, device=device,
                 admission_policy=["every", "branch"][seed % 2], state_eviction_policy=["lru", "flop"][seed % 2])
    texts = [toks(int(rng.integers(8, 40)), rng)]
    hits = refused = 0
    for step in range(40):
        if len(run.running) < 3:
            src = texts[int(rng.integers(len(texts)))]
            cut = src.size if rng.random() < 0.4 else int(rng.integers(1, src.size + 1))  # next turn / fork
            r = Req(f"r{step}", np.concatenate([src[:cut], toks(int(rng.integers(1, 24)), rng)])[:90])
            m = run.tree.match_prefix(r.fill_ids[:-1])
            if m.prefix_len < m.kv_prefix_len and rng.random() < 0.7:
                chunk = m.kv_prefix_len  # checkpoint the state where the KV match ends (Marconi)
            elif rng.random() < 0.3 and r.seq_len > 10:
                chunk = int(rng.integers(2, r.seq_len))
            else:
                chunk = None
            want = run.tree.match_prefix(r.fill_ids[:(chunk or r.seq_len) - 1]).prefix_len
            try:
                run.extend([r], fill_lens=None if chunk is None else [chunk])
            except CapacityError:  # every slot is a running request's or pinned: all or nothing
                assert r.req_pool_idx is None and r.mamba_pool_idx is None and r.last_node is None
                run.check()
                refused += 1
                continue
            assert r.prefix_len == want
            hits += int(r.prefix_len > 0)
            if chunk is not None:
                run.chunk_done(r)
                run.extend([r])
        live = [r for r in run.running if r.seq_len < 110]
        if live:
            for _ in range(int(rng.integers(1, 4))):
                run.decode(live, rng)
        if run.running and rng.random() < 0.6:
            r = run.running[int(rng.integers(len(run.running)))]
            texts.append(r.fill_ids.copy())
            run.finish(r, rng=rng)
    for r in list(run.running):
        run.finish(r, rng=rng)
    print(f"hits {hits}, refused {refused}, {run.tree.metrics.snapshot()}")
    assert hits > 0 and run.tree.metrics.snapshot().evictions > 0
