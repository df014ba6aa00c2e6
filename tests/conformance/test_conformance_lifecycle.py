"""Request life cycles through the protocol: prefill -> decode -> finish -> prefix reuse,
chunked prefill, abort, flush, events, namespaces; page sizes 1 and 16.

A fake model writes K = token id into the slots each step returns, so "the second request
reads the same rows" is checked on the data, not only on the bookkeeping."""
import numpy as np
import pytest
from conformance_util import Checked, assert_law, rand_tokens, read_token_kv, toks, write_token_kv

from radixkv.engine.protocol import (
    CacheResult,
    DecodeItem,
    EngineStats,
    ExtendItem,
    MatchQuery,
)

PAGES = [1, 16]


def _engine(engine_factory, ps, **kw):
    cfg = dict(page_size=ps, kv_tokens=1024, request_rows=16, max_context_len=512, enable_kv_events=True)
    cfg.update(kw)
    raw = engine_factory(**cfg)
    info = raw.attach("conformance")
    return Checked(raw), info.session, engine_factory.buffers(raw, info)


def _prefill(e, s, buf, rid, full_tokens, new_tokens, **kw):
    """Extend ``rid`` by ``new_tokens`` (its tokens are then ``full_tokens``) and write their KV."""
    (r,) = e.alloc_extend(s, [ExtendItem(rid, new_tokens, **kw)])
    assert r.rid == rid and r.seq_len == len(full_tokens)
    assert len(r.out_cache_loc) == r.seq_len - r.start and r.out_cache_loc.dtype == np.int64
    write_token_kv(buf, r.out_cache_loc, full_tokens[r.start:r.seq_len])
    np.testing.assert_array_equal(read_token_kv(buf, r.req_pool_idx, r.seq_len), full_tokens)
    return r


@pytest.mark.parametrize("ps", PAGES)
def test_prompt_decode_finish_then_prefix_reuse(engine_factory, ps):
    e, s, buf = _engine(engine_factory, ps)
    rng = np.random.default_rng(0)
    prompt = rand_tokens(rng, 40)
    a = _prefill(e, s, buf, "a", prompt, prompt)
    assert (a.prefix_len, a.start, a.seq_len, a.mamba_slot) == (0, 0, 40, -1)
    seq = prompt
    for _step in range(5):
        t = int(rng.integers(0, 50))
        d = e.alloc_decode(s, [DecodeItem("a", t)])
        seq = np.append(seq, np.int32(t))
        assert d.seq_lens.tolist() == [len(seq)] and d.req_pool_indices.tolist() == [a.req_pool_idx]
        assert d.mamba_slots.tolist() == [-1] and d.out_cache_loc.dtype == np.int64
        write_token_kv(buf, d.out_cache_loc, seq[-1:])
        np.testing.assert_array_equal(read_token_kv(buf, a.req_pool_idx, len(seq)), seq)
    st = e.stats()
    assert st.requests == 1 and st.kv_held > 0
    (c,) = e.cache_finished(s, ["a"])
    assert c == CacheResult("a", len(seq) - len(seq) % ps)
    st = e.stats()
    assert st.requests == 0 and st.kv_held == 0 and st.kv_evictable == c.cached_len
    # a second request sharing the prompt: reuses the cached rows, which hold its tokens
    follow = np.concatenate([seq[:30], rand_tokens(rng, 7)])
    (m,) = e.match(s, [MatchQuery(follow)])
    assert m.prefix_len == m.kv_prefix_len == 30 - 30 % ps
    b = _prefill(e, s, buf, "b", follow, follow)
    assert b.prefix_len == b.start == 30 - 30 % ps > 0
    assert len(b.out_cache_loc) == len(follow) - b.prefix_len
    np.testing.assert_array_equal(read_token_kv(buf, b.req_pool_idx, b.prefix_len), seq[:b.prefix_len])
    e.cache_finished(s, ["b"])
    assert e.stats().hit_tokens >= b.prefix_len


@pytest.mark.parametrize("ps", PAGES)
def test_whole_prompt_cached_still_computes_one_token(engine_factory, ps):
    e, s, buf = _engine(engine_factory, ps)
    prompt = toks(np.arange(1, 2 * ps + 2 if ps > 1 else 9))
    _prefill(e, s, buf, "a", prompt, prompt)
    e.cache_finished(s, ["a"])
    b = _prefill(e, s, buf, "b", prompt, prompt)
    assert b.seq_len - b.start >= 1
    n = len(prompt) - 1
    assert b.prefix_len == n - n % ps
    e.release(s, ["b"])


@pytest.mark.parametrize("ps", PAGES)
def test_chunked_prefill(engine_factory, ps):
    e, s, buf = _engine(engine_factory, ps)
    rng = np.random.default_rng(1)
    prompt = rand_tokens(rng, 75)
    pos = 0
    for chunk in (20, 33, 22):
        r = _prefill(e, s, buf, "a", prompt[:pos + chunk], prompt[pos:pos + chunk])
        assert r.start == pos and r.prefix_len == 0
        pos += chunk
        (c,) = e.cache_unfinished(s, ["a"])
        assert c.cached_len == pos - pos % ps
        np.testing.assert_array_equal(read_token_kv(buf, r.req_pool_idx, pos), prompt[:pos])
        st = e.stats()
        assert st.kv_protected == c.cached_len
    # another request can reuse what the unfinished one cached, while it runs
    other = np.concatenate([prompt[:50], rand_tokens(rng, 4)])
    b = _prefill(e, s, buf, "b", other, other)
    assert b.prefix_len == 50 - 50 % ps
    d = e.alloc_decode(s, [DecodeItem("a", 3), DecodeItem("b", 4)])
    assert d.seq_lens.tolist() == [76, len(other) + 1]
    write_token_kv(buf, d.out_cache_loc, toks([3, 4]))
    e.cache_finished(s, ["a", "b"])
    assert e.stats().requests == 0


@pytest.mark.parametrize("ps", PAGES)
def test_more_input_after_decode(engine_factory, ps):
    e, s, buf = _engine(engine_factory, ps)
    p = toks(np.arange(10, 30))
    _prefill(e, s, buf, "a", p, p)
    d = e.alloc_decode(s, [DecodeItem("a", 7)])
    seq = np.append(p, np.int32(7))
    write_token_kv(buf, d.out_cache_loc, seq[-1:])
    more = toks([1, 2, 3, 4, 5])
    r = _prefill(e, s, buf, "a", np.concatenate([seq, more]), more)
    assert r.start == 21 and r.seq_len == 26
    (c,) = e.cache_finished(s, ["a"])
    assert c.cached_len == 26 - 26 % ps


@pytest.mark.parametrize("ps", PAGES)
def test_abort_frees_everything_and_caches_nothing(engine_factory, ps):
    e, s, buf = _engine(engine_factory, ps)
    base = e.stats()
    p = toks(np.arange(100, 160))
    _prefill(e, s, buf, "a", p, p)
    e.alloc_decode(s, [DecodeItem("a", 1)])
    e.release(s, ["a"])
    st = e.stats()
    assert st.kv_available == st.kv_capacity and st.kv_evictable == 0 and st.requests == 0
    assert e.match(s, [MatchQuery(p)])[0].prefix_len == 0
    # abort after a chunk was cached: the cached part stays in the tree, unlocked
    _prefill(e, s, buf, "b", p[:40], p[:40])
    (c,) = e.cache_unfinished(s, ["b"])
    e.release(s, ["b"])
    st = e.stats()
    assert st.kv_evictable == c.cached_len and st.kv_protected == 0 and st.kv_held == 0
    assert st.sessions == base.sessions


@pytest.mark.parametrize("ps", PAGES)
def test_flush_refused_while_running_then_empties_tree(engine_factory, ps):
    e, s, buf = _engine(engine_factory, ps)
    p = toks(np.arange(1, 50))
    _prefill(e, s, buf, "a", p, p)
    assert e.flush(s) is False
    e.cache_finished(s, ["a"])
    assert e.stats().kv_evictable > 0
    assert e.flush(s) is True
    st = e.stats()
    assert st.kv_available == st.kv_capacity and st.kv_evictable == 0
    assert e.match(s, [MatchQuery(p)])[0].prefix_len == 0


@pytest.mark.parametrize("ps", PAGES)
def test_events_stored_removed_cleared(engine_factory, ps):
    e, s, buf = _engine(engine_factory, ps, kv_tokens=128)
    p = toks(np.arange(1, 65))
    _prefill(e, s, buf, "a", p, p)
    e.cache_finished(s, ["a"])
    ev = e.take_events(s)
    stored = [x for x in ev if x["type"] == "BlockStored"]
    assert stored and sum(len(x["token_ids"]) for x in stored) == 64
    assert all(x["block_size"] == ps and len(x["block_hashes"]) * ps == len(x["token_ids"]) for x in stored)
    assert e.take_events(s) == []
    ev_tokens = np.concatenate([np.asarray(x["token_ids"]) for x in stored])
    np.testing.assert_array_equal(np.sort(ev_tokens), np.sort(p))
    # filling the pool evicts the cached blocks: BlockRemoved names the stored hashes
    q = toks(np.arange(200, 328))
    _prefill(e, s, buf, "b", q, q)
    ev = e.take_events(s, max_events=1)
    assert len(ev) == 1 and ev[0]["type"] == "BlockRemoved"
    removed = set(ev[0]["block_hashes"]) | {h for x in e.take_events(s) for h in x.get("block_hashes", [])}
    assert removed >= {h for x in stored for h in x["block_hashes"]}
    assert e.stats().evicted_tokens == 64
    e.release(s, ["b"])
    assert e.flush(s) is True
    assert e.take_events(s) == [{"type": "AllBlocksCleared"}]


def test_events_off_by_default(engine_factory):
    e, s, buf = _engine(engine_factory, 1, enable_kv_events=False)
    p = toks(np.arange(1, 9))
    _prefill(e, s, buf, "a", p, p)
    e.cache_finished(s, ["a"])
    assert e.take_events(s) == []


@pytest.mark.parametrize("ps", PAGES)
def test_extra_key_namespaces_do_not_share(engine_factory, ps):
    e, s, buf = _engine(engine_factory, ps)
    p = toks(np.arange(1, 40))
    _prefill(e, s, buf, "a", p, p, extra_key="tenant-1")
    e.cache_finished(s, ["a"])
    assert e.match(s, [MatchQuery(p)])[0].prefix_len == 0
    assert e.match(s, [MatchQuery(p, "tenant-2")])[0].prefix_len == 0
    assert e.match(s, [MatchQuery(p, "tenant-1")])[0].prefix_len == 39 - 39 % ps
    b = _prefill(e, s, buf, "b", p, p, extra_key="tenant-1")
    assert b.prefix_len > 0
    c = _prefill(e, s, buf, "c", p, p)
    assert c.prefix_len == 0
    e.release(s, ["b", "c"])


@pytest.mark.parametrize("ps", PAGES)
def test_eviction_makes_room_and_explicit_evict(engine_factory, ps):
    e, s, buf = _engine(engine_factory, ps, kv_tokens=256)
    rng = np.random.default_rng(2)
    for i in range(6):  # 6 x 80 tokens through a 256-token pool: the tree gets evicted
        p = rand_tokens(rng, 80)
        _prefill(e, s, buf, f"r{i}", p, p)
        e.cache_finished(s, [f"r{i}"])
    st = e.stats()
    assert st.evicted_tokens > 0 and st.inserted_tokens == 6 * (80 - 80 % ps)
    r = e.evict(s, 1)
    assert r.tokens >= 1 and r.states == 0
    st2 = e.stats()
    assert st2.kv_evictable == st.kv_evictable - r.tokens
    r = e.evict(s, 10 ** 6)
    assert r.tokens == st2.kv_evictable
    assert e.evict(s, 5).tokens == 0
    assert_law(e.stats())


def test_batches_of_many_requests(engine_factory):
    e, s, buf = _engine(engine_factory, 1)
    rng = np.random.default_rng(3)
    prompts = {f"q{i}": rand_tokens(rng, int(rng.integers(1, 30))) for i in range(8)}
    res = e.alloc_extend(s, [ExtendItem(rid, t) for rid, t in prompts.items()])
    assert [r.rid for r in res] == list(prompts)
    assert len({r.req_pool_idx for r in res}) == 8
    locs = np.concatenate([r.out_cache_loc for r in res])
    assert len(np.unique(locs)) == len(locs)
    for r in res:
        write_token_kv(buf, r.out_cache_loc, prompts[r.rid])
    d = e.alloc_decode(s, [DecodeItem(rid, 1) for rid in prompts])
    assert d.seq_lens.tolist() == [len(t) + 1 for t in prompts.values()]
    assert d.req_pool_indices.tolist() == [r.req_pool_idx for r in res]
    assert e.alloc_extend(s, []) == []
    empty = e.alloc_decode(s, [])
    assert all(len(x) == 0 and x.dtype == np.int64 for x in empty)
    e.cache_finished(s, list(prompts)[:4])
    e.release(s, list(prompts)[4:])
    assert e.stats().requests == 0


def test_admission_none_caches_nothing(engine_factory):
    e, s, buf = _engine(engine_factory, 1, admission_policy="none")
    p = toks(np.arange(1, 30))
    _prefill(e, s, buf, "a", p, p)
    assert e.cache_unfinished(s, ["a"]) == [CacheResult("a", 0)]
    assert e.cache_finished(s, ["a"]) == [CacheResult("a", 0)]
    st = e.stats()
    assert st.kv_available == st.kv_capacity
    b = _prefill(e, s, buf, "b", p, p)
    assert b.prefix_len == 0
    e.cache_finished(s, ["b"])


def test_stats_shape(engine_factory):
    e, s, buf = _engine(engine_factory, 1)
    st = e.stats(s)
    assert isinstance(st, EngineStats) and st.sessions == 1 and st.requests == 0
    assert st.kv_capacity == 1024 and st.rows_capacity == 16 and st.state_capacity == 0
    assert st.hit_rate == 0.0
