"""State tracking at aligned positions (``mamba_ping_pong_track_buffer``), end to end: the
reference hybrid model run through the real pools, the flow and the MambaRadixCache at page
sizes 1, 16 and 64. The request's own state sits past the last page end; the tracked state at
the last aligned position it passed is what the tree caches. Every logit produced with
reuse must equal ``forward_reference`` from scratch (fp64 1e-9, fp32 1e-5), and each case
must actually hit a cached state.
"""
import numpy as np
import pytest
import torch
from test_hybrid_end_to_end import VOCAB, Runner, toks

from radixkv.cache.hybrid.mamba_radix_cache import MambaRadixCache
from radixkv.errors import CapacityError, InvalidArgumentError, InvariantError
from radixkv.memory import HybridReqToTokenPool
from radixkv.scheduler.req import Req

PAGES = [1, 16, 64]


def test_issue_case_page16_prompt40_decode1():
    """The issue's run: extend 40 tokens, decode one, finish at 41. Untracked, nothing can
    be reused (no page end holds the state); tracked, the state at 32 is cached and the
    same prompt again gets prefix 32 with a state hit, and the same logits."""
    for track, want in ((False, 0), (True, 32)):
        rng = np.random.default_rng(0)
        run = Runner(torch.float64, 16, track=track)
        prompt = toks(40, rng)
        a = Req("a", prompt)
        run.extend([a])
        run.decode([a], rng)
        run.finish(a, rng=rng)
        b = Req("b", prompt.copy())
        batch = run.extend([b])
        assert int(batch.prefix_lens[0]) == want, track
        assert (run.tree.state_slot(b.last_node) is not None) == track
        run.decode([b], rng)
        run.finish(b, rng=rng)
        assert run.tree.metrics.snapshot().hit_tokens >= want


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("ps", PAGES)
def test_fork_and_diverge_from_unaligned_finish(ps, dtype):
    """A finishes at an unaligned position; B and C extend A's text differently in one batch,
    both hit the tracked state at A's last page end, fork it and decode together."""
    rng = np.random.default_rng(ps)
    run = Runner(dtype, ps, track=True)
    a = Req("a", toks(ps * 2 + 5 if ps > 1 else 21, rng))
    run.extend([a])
    for _ in range(3):
        run.decode([a], rng)
    fill = a.fill_ids.copy()
    run.finish(a, rng=rng)
    end = (fill.size // ps) * ps
    b = Req("b", np.concatenate([fill, toks(7, rng)]))
    c = Req("c", np.concatenate([fill, toks(12, rng)]))
    batch = run.extend([b, c])
    assert batch.prefix_lens.tolist() == [end, end]
    assert run.tree.state_slot(b.last_node) is not None
    for _ in range(4):
        run.decode([b, c], rng)
    run.finish(b, rng=rng)
    run.finish(c, rng=rng)
    assert run.checked > 0


@pytest.mark.parametrize("ps", PAGES)
def test_chunked_prefill_unaligned_chunks(ps):
    """Chunk ends off the page grid: each ``cache_unfinished_req`` caches the tracked state at
    the last page end the chunk passed; a later request hits the deepest one."""
    rng = np.random.default_rng(10 + ps)
    run = Runner(torch.float64, ps, track=True, width=256)
    n = 3 * ps + 9 if ps > 1 else 30
    a = Req("a", toks(n, rng))
    ends = [ps + 3 if ps > 1 else 7, 2 * ps + 5 if ps > 1 else 19]
    for end in ends:
        run.extend([a], fill_lens=[end])
        run.chunk_done(a)
        assert a.mamba_last_track_seqlen == end - end % ps
        assert run.tree.match_prefix(a.fill_ids[:end]).prefix_len == end - end % ps
    run.extend([a])
    run.decode([a], rng)
    d = Req("d", np.concatenate([a.origin_input_ids[:ends[1] + 1], toks(6, rng)]))
    want = ends[1] - ends[1] % ps
    assert int(run.extend([d]).prefix_lens[0]) == want > 0
    run.decode([d], rng)
    run.finish(d, rng=rng)
    run.finish(a, rng=rng)


@pytest.mark.parametrize("ps,interval", [(1, None), (16, None), (64, None), (16, 32), (1, 8)])
def test_decode_past_several_boundaries(ps, interval):
    """A short prompt decoded past several interval boundaries, cached unfinished now and
    then (a checkpoint) and finished off the grid: later requests hit the tracked state at
    the last boundary, which is a multiple of the interval."""
    rng = np.random.default_rng(ps + (interval or 0))
    iv = interval or ps
    run = Runner(torch.float64, ps, track=True, interval=interval, width=320)
    a = Req("a", toks(5, rng))
    run.extend([a])
    steps = 3 * max(iv, 8) + 3
    for i in range(steps):
        run.decode([a], rng)
        if i % 7 == 3:
            run.chunk_done(a)
        assert a.mamba_last_track_seqlen == (a.kv_committed_len // iv) * iv or a.kv_committed_len < iv
    fill = a.fill_ids.copy()
    run.finish(a, rng=rng)
    last = ((fill.size) // iv) * iv
    b = Req("b", np.concatenate([fill, toks(3, rng)]))
    got = int(run.extend([b]).prefix_lens[0])
    assert got == last and got % iv == 0 and got > 0
    run.decode([b], rng)
    run.finish(b, rng=rng)


@pytest.mark.parametrize("dtype,ps,seed", [(torch.float64, 1, 0), (torch.float64, 16, 1),
                                           (torch.float32, 16, 2), (torch.float64, 64, 3),
                                           (torch.float32, 64, 4)])
def test_seeded_stress_with_evictions(dtype, ps, seed):
    """Random prompts built from earlier requests' text, chunked or whole prefill at
    unaligned ends, batched decodes past boundaries, finishes, on pools small enough that the
    flow evicts KV and states on its own; explicit state evictions too."""
    rng = np.random.default_rng(seed)
    run = Runner(dtype, ps, kv=max(400, 16 * ps), slots=5, rows=4, width=256, track=True,
                 admission_policy=["every", "branch"][seed % 2], state_eviction_policy=["lru", "flop"][seed % 2])
    texts = [toks(int(rng.integers(8, 3 * ps + 8)), rng)]
    hits = 0
    for step in range(30):
        if len(run.running) < 3:
            src = texts[int(rng.integers(len(texts)))]
            cut = src.size if rng.random() < 0.5 else int(rng.integers(1, src.size + 1))
            r = Req(f"r{step}", np.concatenate([src[:cut], toks(int(rng.integers(1, 24)), rng)])[:200])
            chunk = int(rng.integers(2, r.seq_len)) if rng.random() < 0.3 and r.seq_len > 10 else None
            try:
                run.extend([r], fill_lens=None if chunk is None else [chunk])
            except CapacityError:
                assert r.req_pool_idx is None and r.mamba_pool_idx is None and r.mamba_ping_pong_track_buffer is None
                run.check()
                continue
            hits += int(r.prefix_len > 0)
            if chunk is not None:
                run.chunk_done(r)
                run.extend([r])
        live = [r for r in run.running if r.seq_len < 230]
        if live:
            for _ in range(int(rng.integers(1, 6))):
                run.decode(live, rng)
        if rng.random() < 0.2 and run.tree.mamba_evictable_size():
            run.tree.evict(0, 1)
            run.check()
        if run.running and rng.random() < 0.6:
            r = run.running[int(rng.integers(len(run.running)))]
            texts.append(r.fill_ids.copy())
            run.finish(r, rng=rng)
    for r in list(run.running):
        run.finish(r, rng=rng)
    assert hits > 0 and run.tree.metrics.snapshot().evictions > 0


# -- the pool's track buffer -----------------------------------------------------------------
def _pool(rows=3, slots=7, **kw):
    return HybridReqToTokenPool(rows, 32, conv_state_shape=(3, 6), temporal_state_shape=(2, 4, 4),
                                num_mamba_layers=1, mamba_size=slots, enable_mamba_extra_buffer=True, **kw)


def test_track_buffer_allocated_and_freed_with_the_row_all_or_nothing():
    pool = _pool()
    a, b, c = Req("a", [1]), Req("b", [2]), Req("c", [3])
    assert pool.alloc([a, b]) is not None  # 2 x (1 + 2) = 6 of 7 slots
    assert len(a.mamba_ping_pong_track_buffer) == 2 and a.mamba_next_track_idx == 0
    row_pair = pool.get_track_slots([a.req_pool_idx]).tolist()[0]
    assert row_pair == a.mamba_ping_pong_track_buffer
    held = {a.mamba_pool_idx, b.mamba_pool_idx, *a.mamba_ping_pong_track_buffer, *b.mamba_ping_pong_track_buffer}
    assert len(held) == 6
    pool.check_invariants([a, b])
    assert pool.alloc([c]) is None  # a row is free but 3 slots are not: nothing taken
    assert c.req_pool_idx is None and c.mamba_pool_idx is None and c.mamba_ping_pong_track_buffer is None
    assert pool.mamba_pool.available_size() == 1 and pool.available_size() == 1
    pool.free(a)
    assert a.mamba_ping_pong_track_buffer is None and pool.mamba_pool.available_size() == 4
    assert pool.alloc([c]) is not None
    pool.free(b, free_mamba_cache=False)  # the state slot stays b's, the track slots go
    assert b.mamba_pool_idx is not None and pool.mamba_pool.available_size() == 3
    pool.check_invariants([b, c])


def test_track_invariants_name_the_slots():
    pool = _pool()
    a = Req("a", [1])
    pool.alloc([a])
    pool.mamba_ping_pong_track_buffer[a.req_pool_idx, 1] = a.mamba_pool_idx
    with pytest.raises(InvariantError, match=str(a.mamba_pool_idx)):
        pool.check_invariants()


def test_interval_must_be_a_page_multiple():
    with pytest.raises(InvalidArgumentError):
        _pool(mamba_track_interval=0)
    run = Runner(torch.float64, 16, track=True, interval=24)
    with pytest.raises(InvalidArgumentError, match="multiple of the page size"):
        run.extend([Req("a", toks(20, np.random.default_rng(0)))])
    assert run.pool.available_size() == 6
    assert isinstance(run.tree, MambaRadixCache) and VOCAB


@pytest.mark.parametrize("ps", PAGES)
def test_embedded_engine_issue_case(ps):
    """The issue's run with the embedded engine, as a new user would: extend a prompt of
    2.5 pages, decode one token, finish; the same prompt again gets the last page end with a
    state hit (tracking is on by default at page sizes > 1), and its logits equal a
    from-scratch run."""
    from radixkv.demo.workers import engine_config_for
    from radixkv.engine import CacheEngine
    from radixkv.engine.protocol import DecodeItem, ExtendItem
    from radixkv.reference import HybridConfig, HybridModel, ModelCache

    mcfg = HybridConfig(vocab=VOCAB, hidden=16, num_heads=2, head_dim=8, layer_pattern="KFKK", chunk_size=8)
    model = HybridModel(mcfg)
    eng = CacheEngine(engine_config_for(mcfg, page_size=ps, kv_tokens=64 * 16, state_slots=8, request_rows=4,
                                       max_context_len=256))
    mc = ModelCache.over(eng.worker_buffers())
    s = eng.attach().session
    prompt = toks(5 * ps // 2 if ps > 1 else 40, np.random.default_rng(ps))

    def run(rid, tokens):
        (r,) = eng.alloc_extend(s, [ExtendItem(rid, tokens)])
        out = model.extend(tokens[r.start:], r.start, eng.pools.req_to_token_pool.req_to_token[
            r.req_pool_idx, :r.start].long(), r.out_cache_loc, r.mamba_slot, mc,
            track_slot=r.track_slot, track_seqlen=r.track_seqlen)
        d = eng.alloc_decode(s, [DecodeItem(rid, 7)])
        out2 = model.decode(torch.tensor([7]), d.req_pool_indices, d.seq_lens, d.out_cache_loc, d.mamba_slots, mc,
                            d.track_slots if d.track_slots.size else None)
        eng.cache_finished(s, [rid])
        eng.check_invariants()
        ref = model.forward_reference(np.concatenate([tokens, [7]]))
        assert (torch.cat([out, out2]) - ref[r.start:]).abs().max().item() <= 1e-9
        return r.prefix_len

    assert run("a", prompt) == 0
    again = np.concatenate([prompt, [7, 3]]).astype(np.int32)  # the same text, one more token
    assert run("b", again) == (prompt.size + 1) // ps * ps > 0  # page 1: 41, the state handed over
    assert eng.stats().state_evictable >= 1
