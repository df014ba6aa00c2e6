"""Decode reserves (``EngineConfig.decode_reserve``): KV slots a running request holds ahead
for its next decode steps. The contract a remote client relies on: a decode call in which
every request has >= 2 reserved slots touches no allocator and its result follows from the
earlier results alone."""
import numpy as np
import pytest
from engine_fixtures import ManualClock, toks

from radixkv.engine import CacheEngine, EngineConfig
from radixkv.engine.protocol import DecodeItem, ExtendItem
from radixkv.errors import CapacityError, InvalidArgumentError, StaleSessionError


def engine(**kw):
    cfg = dict(kv_tokens=256, decode_reserve=4, request_rows=8, max_context_len=64)
    cfg.update(kw)
    return CacheEngine(EngineConfig(**cfg))


def test_config_needs_page_size_one_and_a_count():
    with pytest.raises(InvalidArgumentError, match="decode_reserve"):
        EngineConfig(kv_tokens=64, page_size=4, decode_reserve=2)
    with pytest.raises(InvalidArgumentError, match="decode_reserve"):
        EngineConfig(decode_reserve=-1)
    assert EngineConfig(kv_tokens=64, page_size=4).decode_reserve == 0


def test_reserve_is_handed_out_used_front_first_and_topped_up_when_empty():
    e = engine()
    s = e.attach().session
    a, b = e.alloc_extend(s, [ExtendItem("a", toks(range(10))), ExtendItem("b", toks(range(5)))])
    assert a.reserved.size == 4 and b.reserved.size == 4
    assert not set(a.reserved) & set(b.reserved) and not set(a.reserved) & set(a.out_cache_loc)
    assert e.stats(s).kv_held == 10 + 5 + 8
    res = {"a": list(a.reserved), "b": list(b.reserved)}
    free_before = e.stats(s).kv_available
    for step in range(3):  # reserves of 4, 3, 2 before the call: no allocator call
        d = e.alloc_decode(s, [DecodeItem("a", 7), DecodeItem("b", 8)])
        assert d.out_cache_loc.tolist() == [res["a"].pop(0), res["b"].pop(0)]
        assert d.reserved.tolist() == res["a"] + res["b"] and d.reserved_lens.tolist() == [3 - step] * 2
        assert d.seq_lens.tolist() == [11 + step, 6 + step]
        assert e.stats(s).kv_available == free_before
        e.check_invariants()
    d = e.alloc_decode(s, [DecodeItem("a", 7), DecodeItem("b", 8)])  # last slot used: topped up
    assert d.reserved_lens.tolist() == [4, 4]
    assert e.stats(s).kv_available == free_before - 8
    e.check_invariants()


def test_decode_mixes_reserved_and_fresh_slots_and_a_refusal_keeps_the_reserve():
    e = engine(kv_tokens=32, decode_reserve=2, max_context_len=32)
    s = e.attach().session
    (a,) = e.alloc_extend(s, [ExtendItem("a", toks(range(10)))])
    (b,) = e.alloc_extend(s, [ExtendItem("b", toks(range(20)))])  # 30 + 2 reserved: pool full
    assert a.reserved.size == 2 and b.reserved.size == 0
    e.alloc_decode(s, [DecodeItem("a", 1)])
    with pytest.raises(CapacityError):  # b needs a fresh slot, a would use its reserve
        e.alloc_decode(s, [DecodeItem("a", 1), DecodeItem("b", 2)])
    st = e.stats(s)
    assert st.kv_held == 10 + 1 + 1 + 20 and st.kv_available == 0
    e.check_invariants()
    e.release(s, ["b"])
    d = e.alloc_decode(s, [DecodeItem("a", 1)])  # last reserved slot; then a fresh reserve of 2
    assert d.out_cache_loc.tolist() == [a.reserved[1]] and d.reserved_lens.tolist() == [2]
    e.check_invariants()


def test_no_eviction_for_a_reserve_and_none_when_short():
    e = engine(kv_tokens=24, decode_reserve=4, max_context_len=24)
    s = e.attach().session
    e.alloc_extend(s, [ExtendItem("x", toks(range(100, 116)))])
    e.cache_finished(s, ["x"])  # 16 tokens evictable in the tree
    (r,) = e.alloc_extend(s, [ExtendItem("y", toks(range(6)))])  # 6 fresh slots: 2 free left
    assert r.reserved.size == 0
    st = e.stats(s)
    assert st.kv_evictable == 16 and st.kv_available == 2
    e.check_invariants()


def test_reserve_stops_at_the_context_limit():
    e = engine(max_context_len=12, decode_reserve=4)
    s = e.attach().session
    (r,) = e.alloc_extend(s, [ExtendItem("a", toks(range(10)))])
    assert r.reserved.size == 2
    e.alloc_decode(s, [DecodeItem("a", 1)])
    d = e.alloc_decode(s, [DecodeItem("a", 1)])
    assert d.seq_lens.tolist() == [12] and d.reserved_lens.tolist() == [0]
    with pytest.raises(CapacityError):
        e.alloc_decode(s, [DecodeItem("a", 1)])
    e.check_invariants()


def test_finish_release_detach_and_expiry_give_the_reserve_back():
    clock = ManualClock()
    e = CacheEngine(EngineConfig(kv_tokens=128, decode_reserve=3, lease_ttl_s=2.0), clock=clock)
    s1, s2 = e.attach().session, e.attach().session
    for s, names in ((s1, "ab"), (s2, "cd")):
        e.alloc_extend(s, [ExtendItem(n, toks(range(5))) for n in names])
    assert e.stats().kv_held == 4 * (5 + 3)  # one call each: no prefix shared yet
    e.cache_finished(s1, ["a"])  # its 5 slots to the tree, its reserve back
    assert (e.stats().kv_held, e.stats().kv_evictable) == (3 * 8, 5)
    e.release(s1, ["b"])
    assert e.stats().kv_held == 2 * 8
    e.check_invariants()
    clock.t = 3.0
    assert set(e.sweep()) == {s1.session_id, s2.session_id}
    st = e.stats()
    assert st.kv_held == 0 and st.requests == 0
    assert st.kv_available + st.kv_evictable + st.kv_protected == st.kv_capacity
    with pytest.raises(StaleSessionError):
        e.heartbeat(s2)
    e.check_invariants()


def _predict(table, items):
    """A decode result from the earlier results alone (what a remote client computes)."""
    out = [table[rid]["res"][0] for rid, _ in items]
    seq = [table[rid]["seq"] + 1 for rid, _ in items]
    rows = [table[rid]["row"] for rid, _ in items]
    return out, seq, rows


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("reserve", [1, 2, 5])
def test_seeded_stress_against_an_engine_without_reserves(seed, reserve):
    """Same calls on two engines, with and without reserves, over a pool large enough that
    nothing is evicted: token-level results agree; the reserved engine's decode calls whose
    requests all hold >= 2 slots leave the free count alone and match the prediction from
    the earlier results; both engines pass their audits after every call."""
    rng = np.random.default_rng(seed)
    ea = engine(kv_tokens=4096, decode_reserve=reserve, request_rows=16, max_context_len=128)
    eb = engine(kv_tokens=4096, decode_reserve=0, request_rows=16, max_context_len=128)
    sa, sb = ea.attach().session, eb.attach().session
    prompts = [toks(rng.integers(0, 50, 40)) for _ in range(4)]
    table, live, n = {}, [], 0
    for _step in range(120):
        op = rng.integers(0, 10)
        if op < 3 and len(live) < 12:
            k = int(rng.integers(1, 4))
            items = []
            for _ in range(k):
                n += 1
                p = np.concatenate([prompts[rng.integers(0, 4)], toks(rng.integers(0, 50, rng.integers(1, 20)))])
                items.append(ExtendItem(f"r{n}", p))
            ra, rb = ea.alloc_extend(sa, items), eb.alloc_extend(sb, items)
            for x, y in zip(ra, rb):
                assert (x.prefix_len, x.start, x.seq_len) == (y.prefix_len, y.start, y.seq_len)
                assert x.reserved.size == min(reserve, 128 - x.seq_len) and y.reserved.size == 0
                table[x.rid] = {"res": list(x.reserved), "seq": x.seq_len, "row": x.req_pool_idx}
                live.append(x.rid)
        elif op < 8 and live:
            rids = list(rng.choice(live, size=min(len(live), int(rng.integers(1, 5))), replace=False))
            rids = [r for r in rids if table[r]["seq"] < 128]
            if not rids:
                continue
            items = [DecodeItem(r, int(rng.integers(0, 50))) for r in rids]
            local = all(len(table[r]["res"]) >= 2 for r in rids)
            free = ea.stats(sa).kv_available
            da, db = ea.alloc_decode(sa, items), eb.alloc_decode(sb, items)
            assert da.seq_lens.tolist() == db.seq_lens.tolist()
            if local:
                out, seq, rows = _predict(table, items)
                assert da.out_cache_loc.tolist() == out and da.seq_lens.tolist() == seq
                assert da.req_pool_indices.tolist() == rows
                assert ea.stats(sa).kv_available == free
            parts = np.split(da.reserved, np.cumsum(da.reserved_lens)[:-1])
            for r, part, s_ in zip(rids, parts, da.seq_lens.tolist()):
                table[r]["res"], table[r]["seq"] = list(part), s_
        elif live:
            r = str(rng.choice(live))
            live.remove(r)
            if op == 8:
                ca, cb = ea.cache_finished(sa, [r]), eb.cache_finished(sb, [r])
                assert ca == cb
            else:
                ea.release(sa, [r]), eb.release(sb, [r])
        ea.check_invariants()
        eb.check_invariants()
        a, b = ea.stats(sa), eb.stats(sb)
        assert (a.hit_tokens, a.queries, a.kv_evictable) == (b.hit_tokens, b.queries, b.kv_evictable)
        assert a.kv_held == b.kv_held + sum(len(table[r]["res"]) for r in live)
    ea.detach(sa)
    st = ea.stats()
    assert st.kv_held == 0 and st.kv_available + st.kv_evictable == st.kv_capacity


def test_hybrid_model_decodes_from_the_reserve():
    e = engine(layer_types="FK", state_slots=8, decode_reserve=2)
    s = e.attach().session
    (r,) = e.alloc_extend(s, [ExtendItem("a", toks(range(8)))])
    assert r.reserved.size == 2 and r.mamba_slot >= 0
    d = e.alloc_decode(s, [DecodeItem("a", 3)])
    assert d.out_cache_loc.tolist() == [r.reserved[0]] and d.mamba_slots.tolist() == [r.mamba_slot]
    e.check_invariants()
    e.cache_finished(s, ["a"])
    st = e.stats(s)
    assert st.kv_held == 0 and st.state_held == 0
    e.check_invariants()
