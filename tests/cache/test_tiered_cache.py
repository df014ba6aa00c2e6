"""The tiered cache (device + host, optionally storage): demotion, load back, drops, the
write policies, locks, invariants, and bit-equal KV through every move."""
import numpy as np
import pytest
import torch
from storage_double import DictStorage, ScatterDictStorage
from tier_util import check_copies_hit_held_pages_once, kv_of, make_cache, read_kv, record_stores, serve

from radixkv.cache.block_hash import encode_extra_key
from radixkv.cache.eviction import available_policies
from radixkv.cache.radix_key import RadixKey
from radixkv.cache.tiered_cache import TieredRadixCache
from radixkv.errors import InvalidArgumentError, InvariantError
from radixkv.storage.file import FileStorage
from radixkv.storage.keys import page_keys, storage_seed
from radixkv.storage.tier_controller import StorageController


def toks(*vals, n=8):
    return np.array([v for v in vals for _ in range(1)] if n is None else
                    [vals[0] * 100 + i for i in range(n)], dtype=np.int32)


def seq(base, n):
    return (np.arange(n, dtype=np.int32) + base * 1000).astype(np.int32)


@pytest.mark.parametrize("ps", [1, 4])
def test_device_eviction_demotes_and_a_match_loads_back(ps):
    c = make_cache(ps=ps, device_tokens=16, host_tokens=32)
    a, b = seq(1, 16), seq(2, 16)
    assert serve(c, a) == (0, 0, 0)
    c.check_invariants()
    serve(c, b)  # evicts a to the host
    c.check_invariants()
    assert c.host_size() == 16 and c.total_size() == 16
    dev, host, sto = serve(c, a)  # served from the host, bit-equal (serve checks the KV)
    assert (dev, host, sto) == (0, 16, 0)
    c.check_invariants()
    assert c.tier_hits == {"device": 0, "host": 16, "storage": 0}
    assert c.tier_stats["loaded_pages"] == 16 // ps


def test_write_back_holds_the_sum_of_the_tiers():
    c = make_cache(device_tokens=8, host_tokens=24)
    seqs = [seq(i, 8) for i in range(4)]
    for s in seqs:
        serve(c, s)
    assert c.total_size() + c.host_size() == 32  # nothing dropped: 8 + 24
    for s in seqs[::-1]:
        dev, host, _ = serve(c, s)
        assert dev + host == 8
        c.check_invariants()


def test_a_loaded_node_keeps_its_host_copy_while_room_allows_and_gives_it_up_first():
    c = make_cache(device_tokens=8, host_tokens=24)
    a, b = seq(1, 8), seq(2, 8)
    serve(c, a)
    serve(c, b)  # a demoted
    assert serve(c, a) == (0, 8, 0)  # loaded back; b demoted; the host had room: a keeps its copy
    c.check_invariants()
    assert c.host_size() == 16 and c.total_size() == 8
    node = c.match_prefix(RadixKey(a)).last_node
    assert node.vbuf and node.hbuf is not None
    assert serve(c, seq(3, 8))[:2] == (0, 0)  # a leaves the device for its copy: no new host page
    assert c.tier_stats["demoted_pages"] == 2 * 8
    for s in (seq(4, 8), seq(5, 8)):  # the host fills: copies of device nodes go before host-only pages
        serve(c, s)
        c.check_invariants()
    assert c.total_size() + c.host_size() == 32
    for s in (seq(4, 8), seq(3, 8), a, seq(5, 8)):  # 2, the least recent, was the one dropped
        assert sum(serve(c, s)) == 8
        c.check_invariants()


def test_host_eviction_drops_only_the_tail_pages_it_needs():
    c = make_cache(device_tokens=8, host_tokens=12)
    serve(c, seq(1, 8))
    serve(c, seq(2, 8))  # 1 -> host (8 of 12 pages)
    serve(c, seq(3, 8))  # 2 -> host: 4 pages short, the last 4 of 1 go
    c.check_invariants()
    assert c.tier_stats["host_dropped_pages"] == 4 and c.host_size() == 12
    assert serve(c, seq(1, 8))[:2] == (0, 4)  # its first 4 tokens are still there


def test_host_eviction_drops_the_least_recent_host_only_leaf():
    c = make_cache(device_tokens=8, host_tokens=8)
    for i in range(3):
        serve(c, seq(i, 8))
        c.check_invariants()
    # 0 was demoted, then dropped to make room for 1; 2 is on the device
    assert serve(c, seq(0, 8))[:2] == (0, 0)
    assert c.tier_stats["host_dropped_pages"] >= 8


def test_shared_prefix_split_across_tiers():
    c = make_cache(ps=2, device_tokens=16, host_tokens=32)
    base = seq(5, 8)
    a = np.concatenate([base, seq(6, 4)])
    b = np.concatenate([base, seq(7, 4)])
    serve(c, a)
    serve(c, b)
    serve(c, seq(8, 16))  # pushes everything to the host
    c.check_invariants()
    dev, host, _ = serve(c, np.concatenate([base, seq(9, 6)]))
    assert (dev, host) == (0, 8)
    c.check_invariants()
    dev, host, _ = serve(c, b)
    assert dev + host == 12


def test_write_through_copies_at_insert_and_demotion_needs_no_copy():
    c = make_cache(device_tokens=8, host_tokens=32, write_policy="write_through")
    serve(c, seq(1, 8))
    assert c.host_size() == 8 and c.tier_stats["written_through_pages"] == 8
    serve(c, seq(2, 8))
    assert c.tier_stats["demoted_pages"] == 0
    assert serve(c, seq(1, 8))[1] == 8
    c.check_invariants()


def test_host_only_nodes_cannot_be_locked_and_insert_revives_them():
    c = make_cache(device_tokens=8, host_tokens=16)
    a = seq(1, 8)
    serve(c, a)
    serve(c, seq(2, 8))
    m = c.match_prefix(RadixKey(a))
    assert m.prefix_len == 0 and m.host_len == 8
    with pytest.raises(InvalidArgumentError):
        c.inc_lock_ref(m.host_nodes[0])
    # a caller that recomputed a's KV inserts it: the host node takes those rows
    c.evict(8)
    rows = c.token_to_kv_pool_allocator.alloc(8)
    assert c.insert(RadixKey(a), rows) == 8  # the rows are the tree's now (not duplicates)
    c.check_invariants()
    assert c.match_prefix(RadixKey(a)).prefix_len == 8


def test_check_invariants_names_leaked_and_double_owned_host_pages():
    c = make_cache(device_tokens=8, host_tokens=16)
    serve(c, seq(1, 8))
    serve(c, seq(2, 8))
    c.host_alloc.alloc(1)
    with pytest.raises(InvariantError, match="leaked"):
        c.check_invariants()
    c = make_cache(device_tokens=8, host_tokens=16)
    serve(c, seq(1, 8))
    serve(c, seq(2, 4))
    serve(c, seq(3, 8))
    nodes = [x for x in c.iter_nodes() if x.hbuf]
    nodes[1].hbuf = nodes[0].hbuf[:len(nodes[1].hbuf)]
    with pytest.raises(InvariantError, match="double-owned"):
        c.check_invariants()


def test_reset_returns_every_host_page():
    c = make_cache(device_tokens=8, host_tokens=16)
    serve(c, seq(1, 8))
    serve(c, seq(2, 8))
    c.reset()
    assert c.host_alloc.available_size() == 16 and c.host_size() == 0
    c.check_invariants()


def test_load_back_with_no_room_serves_what_fits():
    c = make_cache(device_tokens=8, host_tokens=16)
    serve(c, seq(1, 8))
    serve(c, seq(2, 8))
    m0 = c.match_prefix(RadixKey(seq(2, 8)))
    c.inc_lock_ref(m0.last_node)  # the device is pinned whole: nothing can be evicted
    m = c.load_back(c.match_prefix(RadixKey(seq(1, 8))))
    assert m.prefix_len == 0 and m.host_len == 8
    c.dec_lock_ref(m0.last_node)
    c.check_invariants()


def test_events_carry_the_tier_and_remove_a_page_only_when_it_leaves_every_tier():
    c = make_cache(device_tokens=8, host_tokens=8, events=True)
    serve(c, seq(1, 8))
    stored = c.take_events()
    assert [(type(e).__name__, e.medium) for e in stored] == [("BlockStored", "GPU")]
    serve(c, seq(2, 8))  # 1 moves to the host: stored in CPU, then removed from GPU, same hashes
    ev = [(type(e).__name__, e.medium, e.block_hashes) for e in c.take_events()]
    assert ev[:2] == [("BlockStored", "CPU", stored[0].block_hashes), ("BlockRemoved", "GPU", stored[0].block_hashes)]
    assert all(c.kv_events.is_live(h) for h in stored[0].block_hashes)  # never absent
    c.check_invariants()
    serve(c, seq(1, 8))  # back to the device: CPU -> GPU (and 2 to the host)
    ev = [(type(e).__name__, e.medium) for e in c.take_events()]
    assert ("BlockRemoved", "CPU") in ev and ("BlockStored", "GPU") in ev
    serve(c, seq(3, 8))  # 2 leaves the host for good: removed from CPU, not stored again
    ev = [(type(e).__name__, e.medium) for e in c.take_events()]
    assert ev.count(("BlockRemoved", "CPU")) == 1 and ("BlockStored", "CPU") in ev
    c.check_invariants()


@pytest.mark.parametrize("policy", available_policies())
def test_every_eviction_policy_orders_the_device_tier(policy):
    """The policy sees a node leave the device (on_evict) and come back (on_insert); host-only
    nodes get no policy hooks. Two namespaces; the audit (policy's included) after each step."""
    rng = np.random.default_rng(0)
    base = make_cache(device_tokens=16, host_tokens=32)
    c = TieredRadixCache(None, base.token_to_kv_pool_allocator, host_pool=base.host_pool, eviction_policy=policy)
    hits = 0
    for i in range(120):
        w = rng.integers(0, 6, rng.integers(1, 4))
        t = np.array([x * 10 + j for x in w for j in range(4)], dtype=np.int32)
        hits += serve(c, t, extra_key=[None, "ns"][i % 2])[1]
        c.check_invariants()
    assert hits > 0


# ---------------------------------------------------------------------- storage
def _controller(store, c_kwargs=None, **kw):
    c = make_cache(**(c_kwargs or {}))
    ctl = StorageController(store, c.host_pool.page_bytes, **kw)
    c.storage = ctl
    return c, ctl


@pytest.mark.parametrize("Store", [DictStorage, ScatterDictStorage])
def test_storage_serves_pages_the_host_dropped_and_a_new_cache_warm(Store):
    store = Store()
    c, ctl = _controller(store, {"device_tokens": 8, "host_tokens": 8}, timeout_s=5.0)
    for i in range(4):
        serve(c, seq(i, 8))
    assert ctl.drain(5.0)
    assert ctl.stats.written == 32
    dev, host, sto = serve(c, seq(0, 8))
    assert (dev, host, sto) == (0, 0, 8)
    c.check_invariants()
    # a fresh cache (a restarted manager) over the same store finds it too, bit-equal
    c2, ctl2 = _controller(store, {"device_tokens": 8, "host_tokens": 8}, timeout_s=5.0)
    assert serve(c2, seq(2, 8)) == (0, 0, 8)
    c2.check_invariants()
    ctl.close(1.0)
    ctl2.close(1.0)


@pytest.mark.parametrize("Store", [DictStorage, ScatterDictStorage])
def test_a_stalled_backend_costs_hits_not_time(Store):
    store = Store()
    c, ctl = _controller(store, {"device_tokens": 8, "host_tokens": 8}, timeout_s=0.05)
    for i in range(3):
        serve(c, seq(i, 8))
    assert ctl.drain(5.0)
    store.gate.clear()  # the backend hangs
    before = ctl.stats.fetch_timeouts  # a busy machine may have timed out a miss already
    dev, host, sto = serve(c, seq(0, 8))
    assert sto == 0 and ctl.stats.fetch_timeouts == before + 1
    c.check_invariants()
    store.gate.set()
    ctl.close(1.0)


@pytest.mark.parametrize("Store", [DictStorage, ScatterDictStorage])
def test_a_match_that_timed_out_on_storage_is_served_by_its_prefetch_later(Store):
    store = Store()
    c, ctl = _controller(store, {"device_tokens": 8, "host_tokens": 8}, timeout_s=0.01)
    for i in range(3):
        serve(c, seq(i, 8))
    assert ctl.drain(5.0) and ctl.wait_reads(30)  # (a busy machine may have left a miss's read late)
    before = ctl.stats.fetch_timeouts
    store.gate.clear()  # the backend hangs: the match returns without it (what the faster tiers hold)
    m = c.match_prefix(RadixKey(seq(0, 8)))
    assert (m.prefix_len, m.host_len, m.storage_len) == (0, 0, 0) and ctl.stats.fetch_timeouts == before + 1
    c.check_invariants()
    store.gate.set()
    assert ctl.wait_reads(30)  # the read went on in the background
    store.gate.clear()  # hung again: the next match is served from the prefetched pages
    calls = store.calls
    assert serve(c, seq(0, 8)) == (0, 0, 8)  # serve checks the KV bit for bit
    assert store.calls == calls and ctl.stats.prefetch_used == 8
    c.check_invariants()
    store.gate.set()
    ctl.close(1.0)


def test_a_raising_backend_is_a_counted_miss():
    class Broken(DictStorage):
        def batch_exists(self, keys):
            raise OSError("gone")

    c, ctl = _controller(Broken(), {"device_tokens": 8, "host_tokens": 8}, timeout_s=5.0)
    for i in range(3):
        serve(c, seq(i, 8))
    assert serve(c, seq(0, 8))[2] == 0
    assert ctl.stats.errors >= 1
    ctl.close(1.0)


@pytest.mark.parametrize("Store", [DictStorage, ScatterDictStorage])
def test_storage_admit_reused_backs_up_only_pages_hit_before(Store):
    store = Store()
    c, ctl = _controller(store, {"device_tokens": 32, "host_tokens": 32}, timeout_s=5.0, admit="reused")
    serve(c, seq(1, 8))
    serve(c, seq(2, 8))
    serve(c, seq(1, 8))
    serve(c, seq(1, 8))
    assert ctl.drain(5.0)
    assert ctl.stats.written == 8
    ctl.close(1.0)


@pytest.mark.parametrize("Store", [DictStorage, ScatterDictStorage])
def test_backups_past_the_queue_bound_are_dropped_and_counted(Store):
    store = Store()
    store.gate.clear()
    c, ctl = _controller(store, {"device_tokens": 32, "host_tokens": 32}, timeout_s=0.01,
                         max_pending_pages=8)
    serve(c, seq(1, 8))
    serve(c, seq(2, 8))
    assert ctl.stats.backup_dropped == 8
    store.gate.set()
    assert ctl.drain(5.0)
    ctl.close(1.0)


@pytest.mark.parametrize("Store", [DictStorage, ScatterDictStorage])
def test_a_page_whose_backup_was_dropped_is_backed_up_when_the_host_drops_it(Store):
    store = Store()
    store.gate.clear()  # writes hang: the queue fills
    c, ctl = _controller(store, {"device_tokens": 8, "host_tokens": 8}, timeout_s=0.01, max_pending_pages=8)
    serve(c, seq(1, 8))  # queued (8 pages: the queue is full)
    serve(c, seq(2, 8))  # dropped from the queue; 1 moves to the host
    assert ctl.stats.backup_dropped == 8
    store.gate.set()
    assert ctl.drain(5.0)
    ctl.max_pending_pages = 1 << 20  # from here on no backup is refused, however slow the writes
    serve(c, seq(3, 8))  # 2 moves to the host, 1 (backed up already) leaves it
    serve(c, seq(4, 8))  # 3 moves to the host, 2 leaves it: backed up on its way out
    assert ctl.drain(5.0)
    assert ctl.stats.written == 32  # 1, 3, 4 at insert; 2 at its drop
    c.storage.timeout_s = 5.0
    assert serve(c, seq(2, 8))[2] == 8
    ctl.close(1.0)


def test_kv_of_depends_on_the_prefix():
    a, b = seq(1, 8), seq(1, 8)
    b[3] = 99
    assert torch.equal(kv_of(a)[:3], kv_of(b)[:3]) and not torch.equal(kv_of(a)[3:], kv_of(b)[3:])
    assert read_kv is not None


def _file_cache(tmp_path, **kw):
    c = make_cache(device_tokens=8, host_tokens=8)
    store = FileStorage(tmp_path / "pages", page_bytes=c.host_pool.page_bytes)
    ctl = StorageController(store, c.host_pool.page_bytes, **kw)
    c.storage = ctl
    return c, ctl, store


def _page_path(store, tokens, i):
    keys = page_keys(tokens.astype(np.int32), 1, storage_seed(encode_extra_key(None), "test"))
    return store.path_of(keys[i])


@pytest.mark.parametrize("damage", ["flip", "torn", "short", "delete"])
def test_a_bad_page_read_into_host_rows_is_a_miss_and_its_host_pages_go_back(tmp_path, damage):
    """The file tier reads straight into the host rows; from a bad page on, the rows are given
    back (never a node over them), the allocator stays conserved, the good lead is served."""
    c, ctl, store = _file_cache(tmp_path, timeout_s=30.0)
    assert ctl.scatters
    for i in range(4):
        serve(c, seq(i, 8))
    assert ctl.drain(30.0) and ctl.stats.written == 32
    p = _page_path(store, seq(0, 8), 3)
    if damage == "flip":
        b = bytearray(p.read_bytes())
        b[5] ^= 1
        p.write_bytes(bytes(b))
    elif damage == "torn":  # the right size, the second half never written (a power loss)
        b = p.read_bytes()
        p.write_bytes(b[:len(b) // 2] + bytes(len(b) - len(b) // 2))
    elif damage == "short":  # the size is wrong: not even counted as present
        p.write_bytes(p.read_bytes()[:-9])
    else:
        p.unlink()
    m = c.match_prefix(RadixKey(seq(0, 8)))
    assert (m.prefix_len, m.storage_len) == (0, 3) and not c._parked
    assert store.stats().corrupt == (damage in ("flip", "torn"))
    c.check_invariants()  # the rows from the bad page on went back: nothing leaked or held twice
    assert c.host_alloc.num_pages - c.host_alloc.available_size() == c.host_size()
    assert serve(c, seq(0, 8))[2] == 0  # (matched above) served bit for bit from the host copy
    c.check_invariants()
    ctl.close(1.0)


def test_host_pages_of_a_late_read_into_them_are_held_until_it_ends_then_given_back():
    store = ScatterDictStorage()
    c, ctl = _controller(store, {"device_tokens": 8, "host_tokens": 8}, timeout_s=0.05)
    for i in range(3):
        serve(c, seq(i, 8))
    assert ctl.drain(5.0) and ctl.wait_reads(30)
    store.get_gate.clear()  # counted, host rows reserved, then the read into them hangs
    m = c.match_prefix(RadixKey(seq(0, 8)))
    assert m.storage_len == 0
    c.check_invariants()  # the parked pages count as held: in use, owned by no node
    parked = sum(len(p) for p, _ in c._parked)
    assert parked in (0, 8)  # 0: a busy machine counted after the timeout (fresh rows instead)
    assert c.host_alloc.available_size() + c.host_size() + parked == c.host_alloc.num_pages
    store.get_gate.set()
    assert ctl.wait_reads(30)
    assert serve(c, seq(0, 8)) == (0, 0, 8)  # the prefetched pages; the parked ones went back
    assert not c._parked
    c.check_invariants()
    ctl.close(1.0)


def test_with_free_host_pages_storage_reads_straight_into_them_in_one_pass():
    """Host pages for every key reserved up front: no count call, only the pages read stay
    allocated (the rest go back), bit-equal; with the host full a storage miss evicts nothing."""
    store = ScatterDictStorage()
    c, ctl = _controller(store, {"device_tokens": 8, "host_tokens": 8}, timeout_s=30.0)
    for i in range(4):
        serve(c, seq(i, 8))
    assert ctl.drain(30.0) and ctl.wait_reads(30)
    c2, ctl2 = _controller(store, {"device_tokens": 8, "host_tokens": 32}, timeout_s=30.0)
    calls = store.calls  # batch_exists calls
    longer = np.concatenate([seq(2, 8), seq(9, 4)])  # 8 tokens in storage, then 4 it lacks
    m = c2.match_prefix(RadixKey(longer))
    assert (m.prefix_len, m.host_len, m.storage_len) == (0, 8, 8) and store.calls == calls
    c2.check_invariants()
    assert c2.host_alloc.num_pages - c2.host_alloc.available_size() == c2.host_size() == 8
    assert serve(c2, seq(2, 8)) == (0, 8, 0)  # the pages read into the host rows, bit for bit
    c2.check_invariants()
    held = c.host_size()  # c's host is full: a miss counts first and evicts no host page
    assert held == c.host_capacity()
    m = c.match_prefix(RadixKey(seq(7, 8)))
    assert m.storage_len == 0 and c.host_size() == held and store.calls > calls
    c.check_invariants()
    ctl.close(1.0)
    ctl2.close(1.0)


def test_nodes_dropped_under_a_victim_in_the_same_evict_are_gone_for_good():
    """One evict demotes leaf a, then its parent b, then drops their device parent c (too big
    for the host) with them: the pending demotion copy must not write a's or b's freed pages
    (d, demoted next, reuses them: one copy with a page twice is a race on CUDA), and later
    host drops must not meet a or b again (a second removal: the event recorder raises)."""
    c = make_cache(device_tokens=16, host_tokens=4, events=True)
    chain = seq(1, 12)  # c: 8 tokens, b: 2, a: 2
    for n in (8, 10, 12):
        serve(c, chain[:n])
    serve(c, seq(2, 2))  # d, the most recent
    c.check_invariants()
    stores = record_stores(c)
    assert c.evict(14) == 14
    c.check_invariants()
    check_copies_hit_held_pages_once(c, stores)
    assert c.evict_host(4) == 2  # only d is left to drop
    c.check_invariants()
    assert c.host_size() == 0 and not c._host_heap
    assert serve(c, seq(2, 2)) == (0, 0, 0) and serve(c, chain) == (0, 0, 0)
    c.check_invariants()
