"""RadixCache unit scenarios: match/insert/split, namespaces, locks, pages, bad input,
disable, reset, KV events, metrics, and check_invariants catching corruption."""
import numpy as np
import pytest
import torch

from radixkv.allocator import PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator
from radixkv.cache import RadixCache, RadixKey
from radixkv.cache.block_hash import block_hashes
from radixkv.cache.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from radixkv.errors import (
    AlignmentError,
    InvalidArgumentError,
    InvalidIndexError,
    InvariantError,
    LengthMismatchError,
)


def make(page_size=1, size=256, device="cpu", **kw):
    alloc = (TokenToKVPoolAllocator(size, device=device) if page_size == 1
             else PagedTokenToKVPoolAllocator(size, page_size, device=device))
    return RadixCache(None, alloc, page_size=page_size, **kw), alloc


def put(cache, alloc, tokens, extra=None, priority=0):
    """Insert like a request would: fresh rows, then free the duplicates. Returns the
    (already-cached length, rows given)."""
    rows = alloc.alloc(len(tokens))
    done = cache.insert(RadixKey(tokens, extra), rows, priority=priority)
    if done:
        alloc.free(rows[:done])
    return done, rows


def state(cache, alloc):
    return (cache.pretty_print(), cache.evictable_size(), cache.protected_size(),
            alloc.available_size())


def test_insert_match_and_split(device):
    cache, alloc = make(device=device)
    assert put(cache, alloc, [1, 2, 3, 4, 5, 6])[0] == 0
    m = cache.match_prefix(RadixKey([1, 2, 3, 4, 5, 6, 7]))
    assert m.prefix_len == 6 and m.device_indices.dtype == torch.int64
    assert m.device_indices.device.type == torch.device(device).type
    full = m.device_indices.clone()
    # a match ending inside the node splits it there
    m2 = cache.match_prefix([1, 2, 3, 9])
    assert m2.prefix_len == 3 and torch.equal(m2.device_indices, full[:3])
    assert m2.last_node.num_tokens == 3 and len(m2.last_node.children) == 1
    # a diverging insert splits too and reuses the shared rows
    done, rows = put(cache, alloc, [1, 2, 3, 4, 8, 8])
    assert done == 4
    m3 = cache.match_prefix([1, 2, 3, 4, 8, 8])
    assert torch.equal(m3.device_indices, torch.cat([full[:4], rows[4:].to(torch.int64)]))
    assert cache.total_size() == 8 and cache.evictable_size() == 8
    assert sorted(cache.all_values().tolist()) == sorted(full.tolist() + rows[4:].tolist())
    cache.check_invariants()
    alloc.check_invariants()
    assert cache.match_prefix([7, 7]).prefix_len == 0
    assert cache.match_prefix([]).prefix_len == 0


def test_insert_returns_cached_length_and_key_inside_node():
    cache, alloc = make()
    put(cache, alloc, [1, 2, 3, 4])
    done, _ = put(cache, alloc, [1, 2])  # ends inside the node: split, nothing new
    assert done == 2 and cache.total_size() == 4
    assert [n.num_tokens for n in cache.iter_nodes()] in ([2, 2],)
    done, _ = put(cache, alloc, [1, 2, 3, 4])
    assert done == 4
    cache.check_invariants()
    assert alloc.available_size() + cache.total_size() == 256


def test_namespaces_are_disjoint():
    cache, alloc = make()
    put(cache, alloc, [1, 2, 3], extra=None)
    put(cache, alloc, [1, 2, 3], extra="lora-a")
    a = cache.match_prefix(RadixKey([1, 2, 3], "lora-a"))
    n = cache.match_prefix([1, 2, 3])
    assert a.prefix_len == n.prefix_len == 3
    assert set(a.device_indices.tolist()).isdisjoint(n.device_indices.tolist())
    assert cache.match_prefix(RadixKey([1, 2, 3], "lora-b")).prefix_len == 0
    assert cache.match_prefix([1, 2, 3], extra_key="lora-a").prefix_len == 3
    assert set(cache.namespaces()) == {None, "lora-a"}
    cache.check_invariants()
    # evicting everything drops the empty namespace head (but never the None one)
    assert cache.evict(100) == 6
    assert cache.namespaces() == [None]
    cache.check_invariants()
    # a head handed out for an empty match is a no-op lock target
    m = cache.match_prefix(RadixKey([1], "gone"))
    assert cache.inc_lock_ref(m.last_node) == 0 and cache.dec_lock_ref(m.last_node) == 0


def test_locks_protect_the_path():
    cache, alloc = make()
    put(cache, alloc, [1, 2, 3, 4])
    put(cache, alloc, [1, 2, 5, 6])
    m = cache.match_prefix([1, 2, 3, 4])
    assert cache.inc_lock_ref(m.last_node) == -4  # [3,4] and the shared [1,2]
    assert (cache.evictable_size(), cache.protected_size()) == (2, 4)
    cache.check_invariants()
    assert cache.evict(100) == 2  # only [5,6] can go
    assert cache.match_prefix([1, 2, 3, 4]).prefix_len == 4
    assert cache.inc_lock_ref(m.last_node) == 0  # second lock: no size change
    assert cache.dec_lock_ref(m.last_node) == 0
    assert cache.dec_lock_ref(m.last_node) == 4
    before = state(cache, alloc)
    with pytest.raises(InvalidArgumentError):
        cache.dec_lock_ref(m.last_node)
    assert state(cache, alloc) == before
    cache.check_invariants()
    assert cache.evict(100) == 4 and cache.total_size() == 0
    with pytest.raises(InvalidArgumentError):  # evicted node
        cache.inc_lock_ref(m.last_node)
    with pytest.raises(InvalidArgumentError):
        cache.inc_lock_ref("node")
    cache.check_invariants()
    assert alloc.available_size() == 256


def test_nodes_of_another_tree_or_before_reset_are_rejected():
    cache, alloc = make()
    other, oalloc = make()
    put(other, oalloc, [1, 2])
    put(cache, alloc, [1, 2])
    foreign = other.match_prefix([1, 2]).last_node
    before = state(cache, alloc)
    with pytest.raises(InvalidArgumentError):
        cache.inc_lock_ref(foreign)
    assert state(cache, alloc) == before
    node = cache.match_prefix([1, 2]).last_node
    cache.reset()
    with pytest.raises(InvalidArgumentError):
        cache.dec_lock_ref(node)


def test_page_alignment_and_page_splits(device):
    cache, alloc = make(page_size=4, size=512, device=device)
    before = state(cache, alloc)
    with pytest.raises(AlignmentError):
        cache.insert(RadixKey(list(range(6))), torch.arange(100, 106))
    assert state(cache, alloc) == before
    toks = list(range(1, 13))  # three pages
    put(cache, alloc, toks)
    # the match is truncated to whole pages
    assert cache.match_prefix(toks + [99, 98]).prefix_len == 12
    assert cache.match_prefix(toks[:7]).prefix_len == 4
    # a mismatch inside the second page matches (and splits at) the first page only
    m = cache.match_prefix(toks[:5] + [77, 77, 77])
    assert m.prefix_len == 4 and m.last_node.num_tokens == 4
    assert all(n.num_tokens % 4 == 0 for n in cache.iter_nodes())
    done, _ = put(cache, alloc, toks[:8] + [5, 5, 5, 5])
    assert done == 8
    cache.check_invariants()
    alloc.check_invariants()


@pytest.mark.parametrize("bad_value, err", [
    (torch.arange(5), LengthMismatchError),
    (torch.arange(4, dtype=torch.float32), InvalidArgumentError),
    (torch.tensor([1, 2, 3, -4]), InvalidIndexError),
    (torch.tensor([1, 2, 3, 2**31]), InvalidIndexError),
    (np.array([1, 2, 3, -4], dtype=np.int32), InvalidIndexError),
    (np.array([1, 2, 3, 2**32 + 5], dtype=np.uint64), InvalidIndexError),
    (torch.arange(8).reshape(2, 4), InvalidArgumentError),
    (None, InvalidArgumentError),
    (np.array([1.0, 2.0, 3.0, 4.0]), InvalidArgumentError),
])
def test_bad_insert_leaves_everything_unchanged(bad_value, err):
    cache, alloc = make()
    put(cache, alloc, [1, 2, 3, 4, 5, 6])
    put(cache, alloc, [1, 2, 7, 7])
    before = state(cache, alloc)
    # the key diverges inside a node: a valid insert would split it
    with pytest.raises(err):
        cache.insert(RadixKey([1, 2, 3, 9]), bad_value)
    assert state(cache, alloc) == before
    cache.check_invariants()


def test_other_bad_arguments_change_nothing():
    cache, alloc = make()
    put(cache, alloc, [1, 2, 3])
    before = state(cache, alloc)
    for call in (lambda: cache.insert([1, 2, 3, 4], torch.arange(4), priority=1.5),
                 lambda: cache.insert([1.5, 2.0], torch.arange(2)),
                 lambda: cache.match_prefix(np.zeros((2, 2), dtype=np.int32)),
                 lambda: cache.evict(-1),
                 lambda: cache.evict(2.0),
                 lambda: cache.match_prefix(RadixKey([1]), extra_key="x")):
        with pytest.raises(InvalidArgumentError):
            call()
        assert state(cache, alloc) == before
    with pytest.raises(InvalidArgumentError):
        RadixCache(None, alloc, page_size=0)
    with pytest.raises(InvalidArgumentError):
        RadixCache(None, alloc, eviction_policy="no-such-policy")


def test_disable():
    cache, alloc = make(disable=True)
    assert cache.insert([1, 2, 3], torch.tensor([4, 5, 6])) == 0
    m = cache.match_prefix([1, 2, 3])
    assert m.prefix_len == 0 and m.device_indices.numel() == 0
    assert cache.total_size() == 0 and cache.evict(10) == 0
    assert cache.inc_lock_ref(m.last_node) == 0 and cache.dec_lock_ref(m.last_node) == 0
    with pytest.raises(AlignmentError):  # still validated
        make(page_size=2, disable=True)[0].insert([1, 2, 3], torch.arange(3))
    cache.check_invariants()


def test_reset_frees_every_row_in_one_call():
    cache, alloc = make(enable_kv_events=True)
    put(cache, alloc, [1, 2, 3, 4])
    put(cache, alloc, [1, 2, 9], extra="t")
    cache.inc_lock_ref(cache.match_prefix([1, 2, 3]).last_node)
    calls = []
    real_free = alloc.free
    alloc.free = lambda idx: (calls.append(idx.numel()), real_free(idx))
    cache.reset()
    assert calls == [7]
    assert alloc.available_size() == 256 and cache.total_size() == 0
    assert cache.protected_size() == 0 and cache.namespaces() == [None]
    assert isinstance(cache.take_events()[-1], AllBlocksCleared)
    cache.check_invariants()


def test_kv_events_follow_the_tree():
    cache, alloc = make(page_size=2, enable_kv_events=True)
    toks = [1, 2, 3, 4, 5, 6]
    put(cache, alloc, toks)
    ev = cache.take_events()
    assert [type(e) for e in ev] == [BlockStored]
    assert list(ev[0].block_hashes) == block_hashes(np.asarray(toks), 2)
    assert ev[0].parent_block_hash is None
    # a split divides the hashes silently; the new branch chains on the shared page
    put(cache, alloc, [1, 2, 9, 9])
    ev = cache.take_events()
    assert len(ev) == 1 and ev[0].parent_block_hash == block_hashes(np.asarray(toks), 2)[0]
    assert list(ev[0].block_hashes) == block_hashes(np.asarray([1, 2, 9, 9]), 2)[1:]
    cache.check_invariants()
    cache.evict(2)
    ev = cache.take_events()
    assert len(ev) == 1 and isinstance(ev[0], BlockRemoved)
    cache.evict(100)
    ev = cache.take_events()
    removed = sorted(h for e in ev for h in e.block_hashes)
    assert len(removed) == 2  # the remaining branch and the shared page
    assert cache.kv_events.live_blocks() == 0
    put(cache, alloc, [5, 5], extra=7)
    ev = cache.take_events()
    assert ev[0].extra_key == 7 and ev[0].lora_id == 7
    cache.check_invariants()


def test_events_disabled_keeps_no_hashes():
    cache, alloc = make()
    put(cache, alloc, [1, 2, 3])
    assert cache.take_events() == []
    assert all(n.block_hashes is None for n in cache.iter_nodes())


def test_metrics_count_hits_and_window():
    cache, alloc = make(metrics_window=2)
    put(cache, alloc, [1, 2, 3, 4])
    cache.match_prefix([1, 2, 3, 4])          # 4/4
    cache.match_prefix([1, 2, 9, 9])          # 2/4
    cache.match_prefix([8, 8, 8, 8])          # 0/4
    cache.evict(100)
    s = cache.metrics.snapshot()
    assert (s.queries, s.queried_tokens, s.hit_tokens) == (3, 12, 6)
    assert s.hit_rate == pytest.approx(0.5)
    assert s.window_queries == 2 and s.window_hit_rate == pytest.approx(2 / 8)
    assert (s.inserts, s.inserted_tokens, s.evictions, s.evicted_tokens) == (1, 4, 1, 4)
    cache.metrics.reset()
    assert cache.metrics.snapshot().queries == 0


@pytest.mark.parametrize("window", [1, 3, 7])
def test_metrics_window_against_brute_force(window):
    """Many queries (the log folds several times): every snapshot equals sums over the
    whole history and over its last ``window`` queries."""
    from radixkv.cache.metrics import CacheMetrics

    m = CacheMetrics(window)
    rng = np.random.default_rng(window)
    hist = []
    for _i in range(12 * window + 5):
        q = int(rng.integers(0, 50))
        h = int(rng.integers(0, q + 1))
        m.record_query(q, h)
        hist.append((q, h))
        if rng.random() < 0.7:  # reads at random distances, some longer than the window
            continue
        s = m.snapshot()
        tq, th = sum(x for x, _ in hist), sum(y for _, y in hist)
        wq, wh = sum(x for x, _ in hist[-window:]), sum(y for _, y in hist[-window:])
        assert (s.queries, s.queried_tokens, s.hit_tokens) == (len(hist), tq, th)
        assert (m.queries, m.queried_tokens, m.hit_tokens) == (len(hist), tq, th)
        assert s.window_queries == min(window, len(hist))
        assert s.hit_rate == (th / tq if tq else 0.0)
        assert s.window_hit_rate == (wh / wq if wq else 0.0)


def test_matched_rows_are_never_free():
    cache, alloc = make(size=64)
    rng = np.random.default_rng(0)
    for _ in range(200):
        toks = rng.integers(0, 3, rng.integers(1, 12)).tolist()
        m = cache.match_prefix(toks)
        if m.prefix_len:
            assert not bool(alloc.is_free(m.device_indices).any())
        need = len(toks)
        if alloc.available_size() < need:
            cache.evict(need - alloc.available_size())
        put(cache, alloc, toks)
    cache.check_invariants()
    assert alloc.available_size() + cache.total_size() == 64


def test_check_invariants_names_the_broken_ids():
    cache, alloc = make()
    put(cache, alloc, [1, 2, 3])
    put(cache, alloc, [1, 5, 6])
    nodes = {n.key[0]: n for n in cache.iter_nodes()}
    cache.check_invariants()
    # a row held by two nodes
    saved = nodes[2].vbuf
    nodes[2].vbuf = nodes[5].vbuf
    with pytest.raises(InvariantError, match="two nodes"):
        cache.check_invariants()
    nodes[2].vbuf = saved
    # sizes that do not add up
    cache._evictable += 1
    with pytest.raises(InvariantError, match="sizes"):
        cache.check_invariants()
    cache._evictable -= 1
    # a lock on a node without its ancestor
    nodes[5].lock_ref = 1
    with pytest.raises(InvariantError, match=str(nodes[5].id)):
        cache.check_invariants()
    nodes[5].lock_ref = 0
    # an unlocked leaf missing from the evictable index
    cache._leaves.remove(nodes[2])
    nodes[2].skey = None
    with pytest.raises(InvariantError, match=str(nodes[2].id)):
        cache.check_invariants()
    cache._refile(nodes[2])
    nodes[2].skey = cache.policy.sort_key(nodes[2])
    cache._leaves.add(nodes[2])
    cache.check_invariants()
    # a row freed behind the tree's back
    leaf = nodes[5]
    alloc.free(torch.tensor([int(leaf.value[0])]))
    with pytest.raises(InvariantError, match=f"free in the allocator.*{leaf.id}"):
        cache.check_invariants()


def test_device_of_results_follows_the_allocator(device):
    cache, alloc = make(device=device)
    put(cache, alloc, [3, 4, 5])
    assert cache.device.type == torch.device(device).type
    assert cache.all_values().device.type == torch.device(device).type
    assert cache.match_prefix([3, 4]).device_indices.device.type == torch.device(device).type


def test_benchmark_runs_and_reports_json(capsys):
    """Smoke run of benchmarks/bench_radix.py on a tiny workload: it must run the cycle on
    both implementations, agree on the hit rate, and print JSON (speed is never checked)."""
    import importlib.util
    import json
    import pathlib

    path = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "bench_radix.py"
    spec = importlib.util.spec_from_file_location("bench_radix", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    threads = torch.get_num_threads()
    try:
        bench.main(["--requests", "40", "--pool", "60000", "--page-sizes", "1", "4", "--json"])
    finally:
        torch.set_num_threads(threads)
    out = json.loads(capsys.readouterr().out)
    runs = out["runs"]
    assert set(runs) == {"radixkv/page1", "naive/page1", "radixkv/page4", "naive/page4"}
    for ps in (1, 4):
        mine, ref = runs[f"radixkv/page{ps}"], runs[f"naive/page{ps}"]
        assert mine["hit_rate"] == ref["hit_rate"] and mine["evicted_tokens"] > 0
        assert mine["ops"]["match_prefix"]["n"] == 40
        assert mine["memory"]["cached_tokens"] > 0
