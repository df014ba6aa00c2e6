"""Hybrid models (KDA + full attention) through the protocol: requests also hold a Mamba
state slot; a prefix hit forks the cached state into the request's own slot (a copy: the
cached state never changes); the state law (available + evictable + protected + held ==
capacity) holds after every call, raising or not.

The states are read and written through the worker buffers (shared memory for the remote
engine), so "the fork holds the cached state" is checked on the data, not only on the
bookkeeping. States are positional: one cached at a request's end is usable only when that
end is page-aligned; an unaligned end leaves its KV with no state (a tombstone), and a chunk
that ends on a page boundary checkpoints the state there.
"""
import numpy as np
import pytest
import torch
from conformance_util import (
    Checked,
    assert_law,
    expect_unchanged,
    fingerprint,
    read_token_kv,
    same,
    toks,
    write_token_kv,
)

from radixkv.engine.protocol import CacheResult, DecodeItem, EvictResult, ExtendItem, MatchQuery
from radixkv.errors import CapacityError, StaleSessionError

# mamba_track_interval=0: these tests pin down the untracked behaviour; state tracking (the
# default at page sizes > 1) is tested at the end of this file
HYBRID = dict(layer_types="KKKF" * 2, kda_num_heads=2, kda_head_dim=8, conv_kernel=4, state_slots=16,
              request_rows=8, kv_tokens=512, max_context_len=128, mamba_track_interval=0)
KDA_LAYERS = [i for i, c in enumerate(HYBRID["layer_types"]) if c == "K"]


def _engine(engine_factory, ps=1, **kw):
    cfg = dict(HYBRID, page_size=ps)
    cfg.update(kw)
    raw = engine_factory(**cfg)
    info = raw.attach("hybrid")
    return Checked(raw), info.session, engine_factory.buffers(raw, info)


def write_state(buf, slot: int, value: float) -> None:
    """Play the model: fill slot ``slot`` of every KDA layer with ``value + layer``."""
    for lid in KDA_LAYERS:
        c = buf.mamba2_layer_cache(lid)
        c.conv[0][slot] = value + lid
        c.temporal[slot] = value + lid


def read_state(buf, slot: int) -> torch.Tensor:
    """Slot ``slot`` of every KDA layer, flattened into one CPU tensor."""
    parts = []
    for lid in KDA_LAYERS:
        c = buf.mamba2_layer_cache(lid)
        parts += [c.conv[0][slot].flatten(), c.temporal[slot].flatten()]
    return torch.cat(parts).cpu().clone()


def prefix_tag(tokens: np.ndarray) -> float:
    """A fingerprint of a token prefix, exact in float32 (< 2**24): what the stress's fake
    model stores as "the state after these tokens"."""
    h = 0
    for t in tokens.tolist():
        h = (h * 131 + int(t) + 1) % 1_000_003
    return float(h)


def state_is(buf, slot: int, value: float) -> bool:
    return all(bool((buf.mamba2_layer_cache(lid).conv[0][slot] == value + lid).all())
               and bool((buf.mamba2_layer_cache(lid).temporal[slot] == value + lid).all())
               for lid in KDA_LAYERS)


@pytest.mark.parametrize("ps", [1, 16])
def test_hybrid_life_cycle_and_state_fork(engine_factory, ps):
    e, s, buf = _engine(engine_factory, ps)
    st = e.stats()
    assert st.state_capacity == 16 and st.state_available == 16
    p = toks(np.arange(1, 48))  # 47 tokens + 1 decode = 48 committed: a page end for 1 and 16
    (a,) = e.alloc_extend(s, [ExtendItem("a", p)])
    assert a.mamba_slot >= 1 and a.prefix_len == 0 and a.start == 0
    assert bool((read_state(buf, a.mamba_slot) == 0).all())  # a fresh start: zeros
    write_state(buf, a.mamba_slot, 100.0)  # the state after the prompt
    d = e.alloc_decode(s, [DecodeItem("a", 3)])
    assert d.mamba_slots.tolist() == [a.mamba_slot] and d.seq_lens.tolist() == [48]
    write_state(buf, a.mamba_slot, 200.0)  # the state after the decode step
    st = e.stats()
    assert st.state_held == 1 and st.state_available == 15
    (c,) = e.cache_finished(s, ["a"])
    assert c == CacheResult("a", 48)
    st = e.stats()
    assert st.requests == 0 and st.state_held == 0 and st.state_evictable == 1 and st.state_available == 15
    assert_law(st)
    full = np.concatenate([p, toks([3, 9, 9])])
    (m,) = e.match(s, [MatchQuery(full)])
    assert m.prefix_len == m.kv_prefix_len == 48
    (b,) = e.alloc_extend(s, [ExtendItem("b", full)])
    assert (b.prefix_len, b.start, b.seq_len) == (48, 48, 50)
    assert b.mamba_slot >= 1 and b.mamba_slot != a.mamba_slot  # a's slot is the tree's now
    assert state_is(buf, b.mamba_slot, 200.0)  # the fork holds the state after 48 tokens
    st = e.stats()
    assert st.state_held == 1 and st.state_protected == 1 and st.state_evictable == 0
    write_state(buf, b.mamba_slot, -5.0)  # b advances its own copy ...
    e.release(s, ["b"])
    st = e.stats()
    assert st.state_held == 0 and st.kv_held == 0 and st.state_protected == 0 and st.state_evictable == 1
    (b2,) = e.alloc_extend(s, [ExtendItem("b2", full)])
    assert b2.prefix_len == 48 and state_is(buf, b2.mamba_slot, 200.0)  # ... the cached one is intact
    e.release(s, ["b2"])


def test_unaligned_end_tombstone_and_chunk_checkpoint(engine_factory):
    e, s, buf = _engine(engine_factory, 16)
    p = toks(np.arange(1, 41))
    (a,) = e.alloc_extend(s, [ExtendItem("a", p)])
    e.alloc_decode(s, [DecodeItem("a", 3)])  # 41 committed: not a page end
    assert e.cache_finished(s, ["a"])[0].cached_len == 32
    st = e.stats()
    assert st.state_evictable == 0 and st.state_available == 16 and st.kv_evictable == 32
    (m,) = e.match(s, [MatchQuery(np.concatenate([p, toks([3, 9])]))])
    assert (m.prefix_len, m.kv_prefix_len) == (0, 32)  # KV cached, no state: nothing to skip
    # a chunk ending where the KV match ends checkpoints the state there (Marconi)
    q = np.concatenate([p[:32], toks([7] * 10)])
    (c1,) = e.alloc_extend(s, [ExtendItem("c", q[:32])])
    assert c1.prefix_len == 0 and c1.seq_len == 32 and len(c1.out_cache_loc) == 32
    write_state(buf, c1.mamba_slot, 32.0)
    assert e.cache_unfinished(s, ["c"]) == [CacheResult("c", 32)]
    st = e.stats()
    assert st.state_protected == 1 and st.state_held == 1  # the tree's copy is pinned by c
    (c2,) = e.alloc_extend(s, [ExtendItem("c", q[32:])])
    assert (c2.prefix_len, c2.start, c2.seq_len, c2.mamba_slot) == (0, 32, 42, c1.mamba_slot)
    write_state(buf, c1.mamba_slot, 42.0)  # the request's own slot moves on
    assert e.cache_finished(s, ["c"])[0].cached_len == 32
    (m,) = e.match(s, [MatchQuery(np.concatenate([p, toks([3, 9])]))])
    assert (m.prefix_len, m.kv_prefix_len) == (32, 32)
    (d,) = e.alloc_extend(s, [ExtendItem("d", np.concatenate([p, toks([3, 9])]))])
    assert d.prefix_len == 32 and state_is(buf, d.mamba_slot, 32.0)
    e.release(s, ["d"])


def test_one_batch_forks_one_state_into_distinct_slots(engine_factory):
    e, s, buf = _engine(engine_factory)
    p = toks(np.arange(5, 25))
    (a,) = e.alloc_extend(s, [ExtendItem("a", p)])
    write_state(buf, a.mamba_slot, 7.0)
    e.cache_finished(s, ["a"])
    x, y = np.concatenate([p, toks([1, 2])]), np.concatenate([p, toks([3, 4, 5])])
    res = e.alloc_extend(s, [ExtendItem("x", x), ExtendItem("y", y), ExtendItem("z", toks([40, 41, 42]))])
    assert [r.prefix_len for r in res] == [20, 20, 0]
    slots = [r.mamba_slot for r in res]
    assert len(set(slots)) == 3 and min(slots) >= 1
    assert state_is(buf, slots[0], 7.0) and state_is(buf, slots[1], 7.0)
    assert bool((read_state(buf, slots[2]) == 0).all())
    st = e.stats()
    assert st.state_held == 3 and st.state_protected == 1
    d = e.alloc_decode(s, [DecodeItem("z", 1), DecodeItem("x", 2)])
    assert d.mamba_slots.tolist() == [slots[2], slots[0]]
    e.cache_finished(s, ["x", "y", "z"])
    st = e.stats()
    assert st.state_held == 0 and st.requests == 0
    assert e.flush(s) is True
    st = e.stats()
    assert st.state_available == st.state_capacity and st.kv_available == st.kv_capacity


def test_state_eviction_and_capacity(engine_factory):
    e, s, buf = _engine(engine_factory, state_slots=3)
    for i in range(3):  # three cached states fill the pool
        e.alloc_extend(s, [ExtendItem(f"w{i}", toks(np.arange(10) + 100 * i))])
        e.cache_finished(s, [f"w{i}"])
    st = e.stats()
    assert st.state_available == 0 and st.state_evictable == 3
    assert e.evict(s, 0, 0) == EvictResult(0, 0)
    e.alloc_extend(s, [ExtendItem("n", toks(np.arange(10) + 1000))])  # evicts one state itself
    st = e.stats()
    assert st.state_held == 1 and st.state_evictable == 2 and st.state_available == 0
    r = e.evict(s, 0, 1)
    assert r.states == 1
    assert e.stats().state_available == 1
    e.alloc_extend(s, [ExtendItem("o", toks([1, 2, 3]))])
    r = e.evict(s, 10_000, 0)  # every unlocked leaf goes, its state with it
    assert r.states == 1 and e.stats().state_evictable == 0
    e.alloc_extend(s, [ExtendItem("p", toks([4, 5, 6]))])
    st = e.stats()
    assert st.state_held == 3 and st.state_available == 0
    expect_unchanged(e.engine, CapacityError, lambda: e.alloc_extend(s, [ExtendItem("q", toks([7, 8]))]),
                     buf, match="[Mm]amba|state")
    e.release(s, ["n", "o", "p"])
    assert e.stats().state_available == 3


def test_detach_and_expiry_return_the_state_slots(engine_factory, clock):
    e = Checked(engine_factory(clock=clock, lease_ttl_s=5.0, **HYBRID))
    s1, s2 = e.attach("w1").session, e.attach("w2").session
    p = toks(np.arange(1, 33))
    e.alloc_extend(s1, [ExtendItem("a", p)])
    e.cache_unfinished(s1, ["a"])  # a state in the tree, pinned by a
    e.alloc_extend(s2, [ExtendItem("b", np.concatenate([p, toks([1])]))])
    st = e.stats()
    assert st.state_held == 2 and st.state_protected == 1
    e.detach(s1)
    st = e.stats()
    assert st.state_held == 1 and st.state_protected == 1  # b still pins the forked-from state
    clock.advance(6)
    st = e.stats()
    assert st.sessions == 0 and st.state_held == 0 and st.state_protected == 0 and st.state_evictable == 1
    with pytest.raises(StaleSessionError):
        e.heartbeat(s2)


def test_admission_none_caches_no_state(engine_factory):
    e, s, buf = _engine(engine_factory, admission_policy="none")
    p = toks(np.arange(1, 20))
    e.alloc_extend(s, [ExtendItem("a", p)])
    assert e.cache_finished(s, ["a"]) == [CacheResult("a", 0)]
    st = e.stats()
    assert st.state_available == st.state_capacity and st.kv_available == st.kv_capacity
    (m,) = e.match(s, [MatchQuery(p)])
    assert (m.prefix_len, m.kv_prefix_len) == (0, 0)


class HybridStress:
    """A fake hybrid model over the protocol: a request's KV holds its token ids and its
    state slot holds ``prefix_tag(tokens so far)`` in every KDA layer, so a fork is checked
    to be the state at exactly the reused position. Small pools: KV and states are evicted
    and calls refused; a refused call must change nothing."""

    def __init__(self, factory, ps, seed):
        self.rng = np.random.default_rng(seed)
        self.ps = ps
        raw = factory(page_size=ps, **dict(HYBRID, kv_tokens=256, state_slots=6, request_rows=4))
        info = raw.attach("stress")
        self.raw, self.e, self.s = raw, Checked(raw), info.session
        self.buf = factory.buffers(raw, info)
        self.texts = [self.tokens(int(self.rng.integers(10, 40))) for _ in range(3)]
        self.running = {}  # rid -> [tokens, slot, row, committed (None while a chunk is pending)]
        self.n = self.refused = self.hits = self.forks = 0

    def tokens(self, n):
        return self.rng.integers(0, 30, size=n).astype(np.int32)

    def compute(self, rid, toks_, loc, start, end, slot):
        write_token_kv(self.buf, loc, toks_[start:end])
        write_state(self.buf, slot, prefix_tag(toks_[:end]))

    def expect_state(self, slot, toks_, n):
        want = prefix_tag(toks_[:n]) if n else None
        got = read_state(self.buf, slot)
        if want is None:
            assert bool((got == 0).all()), "a request starting from scratch must get a zeroed slot"
        else:
            assert state_is(self.buf, slot, want), f"forked state is not the one after {n} tokens"

    def refusable(self, fn):
        before = fingerprint(self.raw, self.buf)
        try:
            return fn()
        except CapacityError:
            assert same(before, fingerprint(self.raw, self.buf)), "a refused call changed the engine"
            self.refused += 1
            return None

    def new(self):
        rng, e, s = self.rng, self.e, self.s
        src = self.texts[int(rng.integers(len(self.texts)))]
        cut = src.size if rng.random() < 0.5 else int(rng.integers(1, src.size + 1))  # next turn / a fork
        p = np.concatenate([src[:cut], self.tokens(int(rng.integers(1, 20)))])[-100:]
        self.n += 1
        rid = f"r{self.n}"
        (m,) = e.match(s, [MatchQuery(p[:-1])])
        assert m.prefix_len <= m.kv_prefix_len and m.prefix_len % self.ps == 0
        end = p.size
        if m.prefix_len < m.kv_prefix_len and rng.random() < 0.7:
            end = m.kv_prefix_len  # checkpoint where the tree has KV but no state
        res = self.refusable(lambda: e.alloc_extend(s, [ExtendItem(rid, p[:end])]))
        if res is None:
            return
        (r,) = res
        if end == p.size:
            assert r.prefix_len == m.prefix_len  # nothing ran in between: the same match
        np.testing.assert_array_equal(read_token_kv(self.buf, r.req_pool_idx, r.prefix_len), p[:r.prefix_len])
        self.expect_state(r.mamba_slot, p, r.prefix_len)
        self.hits += r.prefix_len
        self.forks += r.prefix_len > 0
        self.compute(rid, p, r.out_cache_loc, r.start, r.seq_len, r.mamba_slot)
        self.running[rid] = [p, r.mamba_slot, r.req_pool_idx, r.seq_len]
        if end < p.size:
            e.cache_unfinished(s, [rid])

    def step(self):
        rng, e, s = self.rng, self.e, self.s
        op = rng.choice(["new", "new", "chunk", "chunk", "decode", "decode", "finish", "finish", "abort", "evict",
                         "burst"])
        rids = sorted(self.running)
        if op == "burst":  # three new requests in one call: often more rows / slots than there are
            self.n += 1
            items = [ExtendItem(f"b{self.n}.{i}", self.tokens(int(rng.integers(20, 60)))) for i in range(3)]
            res = self.refusable(lambda: e.alloc_extend(s, items))
            if res:
                e.release(s, [it.rid for it in items])
            return None
        if op == "new" or not rids:
            return self.new() if len(self.running) < 4 else None
        rid = rids[int(rng.integers(len(rids)))]
        p, slot, row, done = self.running[rid]
        if op == "chunk" and done < p.size:
            res = self.refusable(lambda: e.alloc_extend(s, [ExtendItem(rid, p[done:])]))
            if res:
                (r,) = res
                assert (r.start, r.seq_len, r.mamba_slot) == (done, p.size, slot)
                self.compute(rid, p, r.out_cache_loc, r.start, r.seq_len, slot)
                self.running[rid][3] = p.size
        elif op == "decode" and done == p.size and p.size < 110:
            t = int(rng.integers(0, 30))
            res = self.refusable(lambda: e.alloc_decode(s, [DecodeItem(rid, t)]))
            if res:
                assert res.mamba_slots.tolist() == [slot]
                p = np.append(p, np.int32(t))
                self.compute(rid, p, res.out_cache_loc, p.size - 1, p.size, slot)
                self.running[rid][0], self.running[rid][3] = p, p.size
        elif op == "finish" and done == p.size:
            (c,) = e.cache_finished(s, [rid])
            assert c.cached_len == p.size - p.size % self.ps
            self.texts.append(p)
            del self.running[rid]
        elif op == "abort":
            e.release(s, [rid])
            del self.running[rid]
        elif op == "evict":
            r = e.evict(s, int(rng.integers(0, 40)), int(rng.integers(0, 3)))
            assert r.tokens >= 0 and r.states >= 0


@pytest.mark.parametrize("ps,seed", [(1, 0), (16, 1)])
def test_seeded_stress_forks_hold_the_state_at_the_reused_position(engine_factory, ps, seed):
    st = HybridStress(engine_factory, ps, seed)
    for _ in range(160):
        st.step()
    for rid in sorted(st.running):
        st.e.release(st.s, [rid])
    final = st.e.stats()
    assert final.requests == 0 and final.state_held == 0 and final.kv_held == 0
    assert st.forks > 0 and st.hits > 0, (st.forks, st.hits)
    assert final.evicted_tokens > 0 and st.refused > 0


def test_embedded_audit_names_leaked_and_double_freed_slots():
    """``check_invariants`` catches a state slot leaked or freed behind the engine's back,
    naming it (embedded only: this reaches into the engine's pools)."""
    from radixkv.engine import CacheEngine, EngineConfig
    from radixkv.errors import InvariantError

    e = CacheEngine(EngineConfig(**HYBRID))
    s = e.attach().session
    (a,) = e.alloc_extend(s, [ExtendItem("a", toks(np.arange(1, 20)))])
    e.check_invariants()
    pool = e.pools.mamba_pool
    leaked = int(pool.alloc(1)[0])
    with pytest.raises(InvariantError, match=rf"leaked.*\b{leaked}\b"):
        e.check_invariants()
    pool.free([leaked])
    e.check_invariants()
    pool.free([a.mamba_slot])
    with pytest.raises(InvariantError, match=rf"(double-freed|free).*\b{a.mamba_slot}\b"):
        e.check_invariants()


def test_state_tracking_caches_the_last_page_end(engine_factory):
    """State tracking (the default at page 16): each row holds two more slots (its
    ``mamba_ping_pong_track_buffer``); a step passing a page end names one of them
    (``track_slot`` / ``track_slots``) for the state there, and the tree caches that state
    when the request's own one is off the grid. The fake model writes "the state after n
    tokens" as the value n."""
    e, s, buf = _engine(engine_factory, 16, mamba_track_interval=None)
    p = toks(np.arange(1, 41))
    (a,) = e.alloc_extend(s, [ExtendItem("a", p)])
    assert a.track_seqlen == 32 and a.track_slot not in (0, a.mamba_slot)
    assert e.stats().state_held == 3  # its own slot and the two of its track buffer
    write_state(buf, a.mamba_slot, 40.0)
    write_state(buf, a.track_slot, 32.0)
    d = e.alloc_decode(s, [DecodeItem("a", 3)])
    assert d.track_slots.tolist() == [0]  # 41: no page end passed
    write_state(buf, a.mamba_slot, 41.0)
    assert e.cache_finished(s, ["a"])[0].cached_len == 32
    st = e.stats()
    assert st.state_held == 0 and st.state_evictable == 1 and st.state_available == 15
    assert_law(st)
    text = np.concatenate([p, toks([3, 9])])
    (m,) = e.match(s, [MatchQuery(text)])
    assert (m.prefix_len, m.kv_prefix_len) == (32, 32)  # untracked: (0, 32)
    (b,) = e.alloc_extend(s, [ExtendItem("b", text)])
    assert (b.prefix_len, b.start, b.track_slot, b.track_seqlen) == (32, 32, 0, -1)
    assert state_is(buf, b.mamba_slot, 32.0)  # a fork of the tracked state
    written = []
    for t in range(6):  # 43 .. 48: the last step passes the page end at 48
        d = e.alloc_decode(s, [DecodeItem("b", 5 + t)])
        written.append(int(d.track_slots[0]))
        write_state(buf, b.mamba_slot, float(d.seq_lens[0]))
        if written[-1]:
            write_state(buf, written[-1], float(d.seq_lens[0]))
    assert written[:5] == [0] * 5 and written[5] not in (0, b.mamba_slot)
    assert e.cache_unfinished(s, ["b"]) == [CacheResult("b", 48)]
    e.release(s, ["b"])
    longer = np.concatenate([text, toks(np.arange(5, 11)), toks([1, 2])])
    (c,) = e.alloc_extend(s, [ExtendItem("c", longer)])
    assert c.prefix_len == 48 and state_is(buf, c.mamba_slot, 48.0)
    e.release(s, ["c"])
    assert_law(e.stats())
