"""The tiers through the protocol: a host tier (and a file:// storage tier) behind a small
device pool. Demote (evict moves pages to the host), promote (a match counts them, an extend
loads them back), drop (a full host tier drops its least recently used pages), storage reads
after a flush and after a restart on the same directory; the per-tier fields of match,
extend and stats, and the tier of every KV event (docs/events.md, "Tiers"). The data is
checked too: an extend served from the host or storage reads the tokens written before."""
import time

import numpy as np
import pytest
from conformance_util import Checked, rand_tokens, read_token_kv, toks, write_token_kv

from radixkv.engine.protocol import ExtendItem, MatchQuery

PAGES = [4, 16]


def _config(ps, tmp_path, storage=True, host=128):
    cfg = dict(page_size=ps, kv_tokens=64, host_kv_tokens=host, request_rows=8, max_context_len=64,
               enable_kv_events=True)
    if storage:
        cfg.update(storage=f"file://{tmp_path / 'pages'}", storage_timeout_ms=60_000.0)
    return cfg


def _open(engine_factory, cfg):
    raw = engine_factory(**cfg)
    info = raw.attach("tiers")
    return Checked(raw), info.session, engine_factory.buffers(raw, info)


def _run(e, s, buf, rid, tokens):
    """Prefill ``rid`` (its KV written: K = token id), then cache it; returns the extend result."""
    (r,) = e.alloc_extend(s, [ExtendItem(rid, tokens)])
    write_token_kv(buf, r.out_cache_loc, tokens[r.start:r.seq_len])
    np.testing.assert_array_equal(read_token_kv(buf, r.req_pool_idx, r.seq_len), tokens)
    e.cache_finished(s, [rid])
    return r


def _drained(e):
    """Stats once the storage write queue is empty (the writes run on the manager's storage
    thread; the test waits for the condition, a deadline only reports a hang)."""
    deadline = time.monotonic() + 60
    while (st := e.stats()).storage_pending:
        assert time.monotonic() < deadline, f"storage writes still pending: {st}"
        time.sleep(0.01)
    return st


def _events(e, s):
    return [(d["type"], tuple(d.get("block_hashes", ())), d.get("medium")) for d in e.take_events(s)]


def _tier_law(st):
    assert st.host_available + st.host_used == st.host_capacity, st
    assert st.tier_hit_device + st.tier_hit_host + st.tier_hit_storage == st.hit_tokens, st


@pytest.mark.parametrize("ps", PAGES)
def test_demote_promote_and_storage(engine_factory, ps, tmp_path):
    e, s, buf = _open(engine_factory, _config(ps, tmp_path))
    rng = np.random.default_rng(ps)
    a = rand_tokens(rng, 32)
    _run(e, s, buf, "a", a)
    ((kind, hashes, medium),) = _events(e, s)
    assert (kind, medium, len(hashes)) == ("BlockStored", "GPU", 32 // ps)
    st = e.stats()
    assert (st.kv_evictable, st.host_capacity, st.host_used) == (32, 128, 0)
    # demote: the device gives the pages up, the host keeps them; events move them GPU -> CPU
    assert e.evict(s, 64).tokens == 32
    st = e.stats()
    assert (st.kv_evictable, st.host_used, st.host_demoted_pages) == (0, 32, 32 // ps)
    assert _events(e, s) == [("BlockStored", hashes, "CPU"), ("BlockRemoved", hashes, "GPU")]
    # promote: a match counts them (on the host), an extend loads them into device rows
    query = toks(np.concatenate([a, rand_tokens(rng, 5)]))
    (m,) = e.match(s, [MatchQuery(query)])
    assert (m.prefix_len, m.kv_prefix_len, m.host_len, m.storage_len) == (32, 32, 32, 0)
    (b,) = e.alloc_extend(s, [ExtendItem("b", query)])
    assert (b.prefix_len, b.start, b.host_len, b.storage_len) == (32, 32, 32, 0)
    np.testing.assert_array_equal(read_token_kv(buf, b.req_pool_idx, 32), a)
    assert _events(e, s) == [("BlockStored", hashes, "GPU"), ("BlockRemoved", hashes, "CPU")]
    st = e.stats()
    # write-back: the loaded pages keep their host copy while the host has room (given up first)
    assert (st.host_loaded_pages, st.host_loaded_bytes > 0, st.host_used) == (32 // ps, True, 32)
    assert st.tier_hit_host >= 32
    _tier_law(st)
    e.release(s, ["b"])
    # storage: every inserted page was backed up; after a flush (both tiers emptied) a match
    # reads a's pages from storage into the host tier and an extend loads them
    st = _drained(e)
    assert st.storage_written_pages == 32 // ps and st.storage_errors == st.storage_write_failed == 0
    assert e.flush(s)
    assert e.stats().host_used == 0
    (m,) = e.match(s, [MatchQuery(query)])
    assert (m.prefix_len, m.host_len, m.storage_len) == (32, 32, 32)
    (c,) = e.alloc_extend(s, [ExtendItem("c", query)])
    assert (c.prefix_len, c.host_len, c.storage_len) == (32, 32, 0)  # the match read them already
    np.testing.assert_array_equal(read_token_kv(buf, c.req_pool_idx, 32), a)
    evs = _events(e, s)
    assert [(k, m_) for k, _, m_ in evs] == [("AllBlocksCleared", None), ("BlockStored", "CPU"),
                                             ("BlockStored", "GPU"), ("BlockRemoved", "CPU")]
    assert evs[1][1] == hashes  # the same block hashes as before the flush
    st = e.stats()
    assert (st.storage_loaded_pages, st.tier_hit_storage) == (32 // ps, 32)
    _tier_law(st)
    e.release(s, ["c"])


@pytest.mark.parametrize("ps", PAGES)
def test_restart_on_the_same_storage_serves_hits(engine_factory, ps, tmp_path):
    e, s, buf = _open(engine_factory, _config(ps, tmp_path))
    a = rand_tokens(np.random.default_rng(7), 48)
    _run(e, s, buf, "a", a)
    _drained(e)
    e2, s2, buf2 = _open(engine_factory, _config(ps, tmp_path))  # a second manager, same directory
    (m,) = e2.match(s2, [MatchQuery(a)])
    assert (m.prefix_len, m.host_len, m.storage_len) == (48, 48, 48)
    (r,) = e2.alloc_extend(s2, [ExtendItem("r", a)])
    assert r.prefix_len == 48 - ps and r.host_len == 48 - ps  # one token is always computed
    np.testing.assert_array_equal(read_token_kv(buf2, r.req_pool_idx, r.prefix_len), a[:r.prefix_len])
    e2.release(s2, ["r"])


@pytest.mark.parametrize("ps", PAGES)
def test_full_host_tier_drops_least_recent(engine_factory, ps, tmp_path):
    e, s, buf = _open(engine_factory, _config(ps, tmp_path, storage=False, host=32))
    rng = np.random.default_rng(3)
    a, b = rand_tokens(rng, 32), toks(rand_tokens(rng, 32) + 100)
    _run(e, s, buf, "a", a)
    (_, ha, _), = _events(e, s)
    assert e.evict(s, 64).tokens == 32
    _run(e, s, buf, "b", b)
    e.take_events(s)
    assert e.evict(s, 64).tokens == 32  # b goes to the host: a, least recent there, is dropped
    evs = _events(e, s)
    assert ("BlockRemoved", ha, "CPU") in evs and evs[-1][0] == "BlockRemoved" and evs[-1][2] == "GPU"
    (ma, mb) = e.match(s, [MatchQuery(a), MatchQuery(b)])
    assert (ma.prefix_len, mb.prefix_len, mb.host_len) == (0, 32, 32)
    st = e.stats()
    assert (st.host_used, st.host_dropped_pages, st.storage_written_pages) == (32, 32 // ps, 0)
    _tier_law(st)
