"""The storage tier (L3) of a hybrid tree (``TieredMambaRadixCache`` with ``storage``,
``radixkv/cache/hybrid/state_storage.py``): a node that gets a state backs up its path's pages
and the state; a tree started again on the same store finds them past its (empty) tree and
loads KV and state back, bit-equal; KV without a whole stored state is never a hit; a corrupt,
missing or foreign state is a counted miss; a deleted directory or a stalled backend costs hits,
never errors. KV values and states name their own prefix (``serve`` checks every reused row and
state), and a seeded stress with restarts runs the audit after every step."""
import shutil
import time

import numpy as np
import pytest
import torch
from hypothesis import settings
from hypothesis.stateful import rule
from storage_double import DictStorage
from test_tiered_mamba_cache import TieredHybridMachine, kv, make, serve, state_of
from tier_util import read_kv

from radixkv.storage.file import FileStorage


def _drained(cache):
    assert cache.storage.drain(10.0)
    return cache


def _state_keys(cache, tokens):
    """The storage keys of the chunks of the state stored at the end of ``tokens``."""
    toks = np.asarray(tokens, dtype=np.int32)
    from radixkv.storage.keys import page_keys

    keys = page_keys(toks, cache.page_size, cache._storage_seed(None))
    return cache._chunk_keys(cache._state_key(keys[-1]))


def _loaded(cache, mamba, tokens, query_extra=1):
    """Match ``tokens`` plus a page, load it back; returns the grown match, with the reused
    KV and the whole state checked against ``tokens``' prefix."""
    ps = cache.page_size
    q = np.asarray(list(tokens) + [99] * (query_extra * ps), dtype=np.int32)
    m = cache.load_back(cache.match_prefix(q))
    cache.check_invariants()
    if m.prefix_len:
        assert torch.equal(read_kv(cache, m.device_indices), kv(q[:m.prefix_len]))
        slot = cache.state_slot(m.last_node)
        assert torch.all(mamba.temporal_state[:, slot] == state_of(q[:m.prefix_len]))
        assert torch.all(mamba.conv_state[:, slot] == 0)
    return m


@pytest.mark.parametrize("ps", [1, 4])
def test_a_restarted_tree_loads_kv_and_state_from_storage(ps):
    store = DictStorage()
    cache, alloc, mamba = make(ps, backend=store)
    a = list(range(1, 1 + 2 * ps))
    b = a + list(range(50, 50 + 3 * ps))
    serve(cache, alloc, mamba, a)
    serve(cache, alloc, mamba, b)
    assert _drained(cache).storage_stats["states_queued"] == 2
    assert cache.storage.stats.written == 5 + 2 * cache._chunks  # b's pages once, two states
    cache2, alloc2, mamba2 = make(ps, backend=store)  # a restart: fresh pools, the same store
    m = cache2.match_prefix(np.array(b + [99] * ps, dtype=np.int32))
    assert (m.prefix_len, m.host_len, m.kv_prefix_len, m.storage_len) == (0, 5 * ps, 5 * ps, 5 * ps)
    cache2.check_invariants()
    assert cache2.host_size() == 5 * ps and cache2.tier_counters()["hit_tokens_storage"] == 5 * ps
    got = _loaded(cache2, mamba2, b, query_extra=1)  # matched again: now a host hit, then loaded
    assert got.prefix_len == 5 * ps and cache2.storage_stats["states_fetched"] == 1
    assert cache2.storage_stats["states_queued"] == 0  # a state read from storage is not written again
    assert serve(cache2, alloc2, mamba2, b + [7] * ps) == (5 * ps, 0)  # on the device now
    cache2.check_invariants()


def test_the_deepest_stored_state_is_the_hit_and_kv_past_it_is_not_kept():
    store = DictStorage()
    cache, alloc, mamba = make(1, backend=store)
    serve(cache, alloc, mamba, [1, 2, 3])
    serve(cache, alloc, mamba, [1, 2, 3, 4, 5, 6])
    _drained(cache)
    for k in _state_keys(cache, [1, 2, 3, 4, 5, 6]):
        del store.pages[k]  # KV of 1..6 stored, states at 3 only
    cache2, _, mamba2 = make(1, backend=store)
    m = cache2.match_prefix([1, 2, 3, 4, 5, 6, 7])
    assert (m.host_len, m.kv_prefix_len, cache2.host_size()) == (3, 3, 3)  # no stateless KV kept
    cache2.check_invariants()
    assert _loaded(cache2, mamba2, [1, 2, 3, 4, 5, 6]).prefix_len == 3


def test_kv_without_its_state_is_no_hit():
    store = DictStorage()
    cache, alloc, mamba = make(1, backend=store)
    serve(cache, alloc, mamba, [1, 2, 3, 4])
    _drained(cache)
    for k in _state_keys(cache, [1, 2, 3, 4]):
        del store.pages[k]
    cache2, _, _ = make(1, backend=store)
    m = cache2.match_prefix([1, 2, 3, 4, 5])
    assert (m.prefix_len, m.host_len, m.kv_prefix_len) == (0, 0, 0)
    assert cache2.storage_stats["state_misses"] == 1 and cache2.host_size() == 0
    cache2.check_invariants()


def test_a_state_of_another_layout_is_never_loaded():
    store = DictStorage()
    cache, alloc, mamba = make(1, backend=store)
    serve(cache, alloc, mamba, [1, 2, 3, 4])
    _drained(cache)
    other, _, _ = make(1, backend=store, state_shape=(1, 2, 3))  # same KV layout, another state layout
    m = other.match_prefix([1, 2, 3, 4, 5])
    assert m.host_len == 0 and other.storage_stats["state_misses"] == 1
    other.check_invariants()


def test_corrupt_and_missing_state_files_are_counted_misses(tmp_path):
    """The file backend: a flipped byte in the deepest state's chunk makes it a miss (counted
    by the backend and the tree, the file deleted); the next match falls back to the state
    above it; a deleted state file is a miss as well."""
    cache, alloc, mamba = make(1, backend=FileStorage(tmp_path, page_bytes=64))
    a, b = [1, 2, 3], [1, 2, 3, 4, 5]
    serve(cache, alloc, mamba, a)
    serve(cache, alloc, mamba, b)
    _drained(cache)
    fs = cache.storage.backend
    path = fs.path_of(_state_keys(cache, b)[0])
    raw = bytearray(path.read_bytes())
    raw[3] ^= 0xFF
    path.write_bytes(bytes(raw))
    cache2, _, mamba2 = make(1, backend=FileStorage(tmp_path, page_bytes=64))
    m = cache2.match_prefix(b + [9])
    assert m.host_len == 0 and cache2.storage_stats["state_misses"] == 1
    assert cache2.storage.backend.stats().corrupt == 1
    cache2.check_invariants()
    got = _loaded(cache2, mamba2, b)  # the corrupt file is gone: a's state is the deepest now
    assert got.prefix_len == 3
    for k in _state_keys(cache, a):
        fs.path_of(k).unlink()
    cache3, _, _ = make(1, backend=FileStorage(tmp_path, page_bytes=64))
    assert cache3.match_prefix(b + [9]).host_len == 0 and cache3.storage_stats["state_misses"] == 1
    cache3.check_invariants()


def test_a_storage_directory_deleted_mid_run_costs_hits_not_errors(tmp_path):
    """One tree and one file backend throughout: the directory deleted under them makes
    storage miss (no error); the next writes recreate it and are served again."""
    cache, alloc, mamba = make(1, backend=FileStorage(tmp_path / "s", page_bytes=64))

    def forget():  # empty both tiers: only storage can serve the prompt now
        cache.evict(cache.evictable_size())
        cache.evict_host(cache.host_capacity())
        cache.check_invariants()
        assert cache.total_size() == 0 and cache.host_size() == 0

    serve(cache, alloc, mamba, [1, 2, 3, 4])
    _drained(cache)
    shutil.rmtree(tmp_path / "s")
    forget()
    assert cache.match_prefix([1, 2, 3, 4, 5]).host_len == 0
    serve(cache, alloc, mamba, [1, 2, 3, 4])  # written again: the directory is recreated
    _drained(cache)
    forget()
    assert _loaded(cache, mamba, [1, 2, 3, 4]).prefix_len == 4
    assert cache.storage.stats.write_failed == 0 and cache.storage_stats["states_fetched"] == 1


def test_a_stalled_backend_costs_the_hit_not_the_call():
    store = DictStorage()
    cache, alloc, mamba = make(1, backend=store)
    serve(cache, alloc, mamba, [1, 2, 3, 4])
    _drained(cache)
    cache2, _, _ = make(1, backend=store, timeout_s=0.01)
    store.gate.clear()  # every backend call blocks
    try:
        m = cache2.match_prefix([1, 2, 3, 4, 5])
        assert m.host_len == 0 and cache2.storage.stats.fetch_timeouts == 1
        cache2.check_invariants()
    finally:
        store.gate.set()


def test_admit_reused_backs_up_a_state_once_it_is_hit_again():
    store = DictStorage()
    cache, alloc, mamba = make(1, backend=store, admit="reused")
    serve(cache, alloc, mamba, [1, 2, 3, 4])
    assert cache.storage_stats["states_queued"] == 0
    for _ in range(2):  # matches count hits (serve matched once): the node is backed up at its second
        assert cache.match_prefix([1, 2, 3, 4, 5]).prefix_len == 4
    assert cache.storage_stats["states_queued"] == 1
    _drained(cache)
    cache2, _, mamba2 = make(1, backend=store, admit="reused")
    assert _loaded(cache2, mamba2, [1, 2, 3, 4]).prefix_len == 4


@pytest.mark.parametrize("timeout_s,hit", [(0.5, False), (5.0, True)])
def test_a_slow_backend_costs_one_timeout_per_match_not_three(timeout_s, hit):
    """Every backend read call takes 0.2 s: the KV read (``batch_exists`` + ``batch_get``)
    0.4 s, the state probe 0.2 s, the state read 0.4 s. The three waits share one deadline:
    with a 0.5 s timeout the match gives up at the probe (no hit, one counted timeout, back
    within about one timeout; three separate waits would have returned a hit after 1 s);
    with 5 s the same double yields the hit (the double is slow, not broken)."""
    store = DictStorage()
    cache, alloc, mamba = make(1, backend=store)
    serve(cache, alloc, mamba, [1, 2, 3, 4])
    _drained(cache)
    cache2, _, _ = make(1, backend=store, timeout_s=timeout_s)
    store.delay = 0.2
    t0 = time.monotonic()
    m = cache2.match_prefix([1, 2, 3, 4, 5])
    took = time.monotonic() - t0
    assert (m.host_len == 4, m.storage_len == 4) == (hit, hit), m
    assert cache2.storage.stats.fetch_timeouts == (0 if hit else 1)
    assert cache2.storage_stats["states_fetched"] == int(hit)
    assert cache2.storage_stats["state_misses"] == 0  # a timeout is no miss
    if not hit:
        assert took < 2.5 * timeout_s, took  # one shared deadline (3 waits: up to 3x)
    cache2.check_invariants()
    assert cache2.storage.wait_reads(10.0)  # the late probe ends; nothing leaks
    cache2.check_invariants()
    cache2.storage.close()


@pytest.mark.parametrize("ps,seed,policy,host_slots", [
    (1, 0, "write_back", 4), (2, 1, "write_back", 4), (4, 2, "write_back", 4), (1, 5, "write_through", 4),
    (2, 4, "write_through", 4), (2, 1, "write_back", 1), (1, 0, "write_back", 1)])
def test_seeded_stress_with_storage_and_restarts(ps, seed, policy, host_slots):
    """Conversations served through the tree (either write policy) with KV, state and host
    drops and restarts (the tree started again over fresh pools on the same store, after a
    drain): every reused row and state (device, host or storage) is checked against its
    prefix; the audit after every step. One host state slot: a load back that took it and
    must evict a device state drops that state (no host room) instead of failing."""
    rng = np.random.default_rng(seed)
    store = DictStorage()

    def fresh():
        return make(ps, device_tokens=24 * ps, host_tokens=24 * ps, slots=4, host_slots=host_slots, backend=store,
                    write_policy=policy)

    cache, alloc, mamba = fresh()
    convs = [list(rng.integers(1, 30, size=int(rng.integers(1, 3)) * ps)) for _ in range(5)]
    stored = restarts = inside = 0
    for _ in range(200):
        op = rng.random()
        if op < 0.65:
            i = int(rng.integers(len(convs)))
            grow = list(rng.integers(1, 30, size=int(rng.integers(1, 4)) * ps))
            if len(convs[i]) + len(grow) > 16 * ps:
                convs[i] = convs[i][:ps]
            if serve(cache, alloc, mamba, convs[i] + grow) is not None:
                convs[i] = convs[i] + grow
        elif op < 0.75:
            cache.evict(int(rng.integers(1, 8 * ps)))
        elif op < 0.82:  # state pressure, then a conversation again: its KV may have stayed, its state not
            cache.evict(0, int(rng.integers(2, 9)))
            serve(cache, alloc, mamba, convs[int(rng.integers(len(convs)))] + [int(rng.integers(1, 30))] * ps)
        elif op < 0.92:
            cache.evict_host(int(rng.integers(1, 6)))
        else:
            stored += _drained(cache).tier_counters()["hit_tokens_storage"]
            inside += cache.storage_stats["states_fetched_in_tree"]
            cache, alloc, mamba = fresh()
            restarts += 1
        cache.check_invariants()
    stored += cache.tier_counters()["hit_tokens_storage"]
    inside += cache.storage_stats["states_fetched_in_tree"]
    assert restarts > 0 and stored > 0 and inside > 0, (restarts, stored, inside)  # inside: states read for KV kept


class StoredHybridMachine(TieredHybridMachine):
    """``TieredHybridMachine`` (serve, match, KV / state / host drops against the model of the
    prefixes given a state) with a storage tier, and restarts: the tree started again over
    fresh pools on the same store (drained first). A match, from any tier, ends only where a
    state was given; the audit holds after every step."""

    def __init__(self):
        super().__init__()
        self.store = DictStorage()
        self.cache, self.alloc, self.mamba = self._fresh()

    def _fresh(self):
        ps = self.PS
        return make(ps, device_tokens=16 * ps, host_tokens=12 * ps, slots=4, host_slots=3, backend=self.store,
                    write_policy=self.POLICY, events=self.EVENTS)

    @rule()
    def restart(self):
        _drained(self.cache)
        self.cache, self.alloc, self.mamba = self._fresh()

    def teardown(self):
        self.cache.storage.close()


class StoredHybridMachinePaged(StoredHybridMachine):
    PS = 2


_SETTINGS = settings(max_examples=20, stateful_step_count=30, deadline=None)
TestStoredHybridMachine = StoredHybridMachine.TestCase
TestStoredHybridMachine.settings = _SETTINGS
TestStoredHybridMachinePaged = StoredHybridMachinePaged.TestCase
TestStoredHybridMachinePaged.settings = _SETTINGS


def test_audit_names_a_node_whose_storage_keys_do_not_match_its_pages():
    from radixkv.errors import InvariantError

    cache, alloc, mamba = make(2, backend=DictStorage())
    serve(cache, alloc, mamba, [1, 1, 2, 2])
    cache.check_invariants()
    node = next(iter(cache.root_node.children.values()))
    node.pkeys = node.pkeys[:1]
    with pytest.raises(InvariantError, match=rf"2 pages with 1 storage keys: nodes \[{node.id}\]"):
        cache.check_invariants()


def _tree_shape(cache):
    """Every node's id, key length, tiers and state tier: what a match must not change on a miss."""
    dev, hosted = cache._states.slot_of, cache._hstates.slot_of
    return sorted((x.id, len(x.kbuf), bool(x.vbuf), x.hbuf is not None, x in dev, x in hosted)
                  for x in cache.iter_nodes() if x.parent is not None)


def _one(store):
    return lambda: store


def _kv_without_states(ps, backend, events=False):  # backend: a store, made anew per tree
    """A tree whose device KV holds ``[1..8]`` pages (one node ``[1..6]``, then ``[7, 8]``)
    with no state on that path in any tier, and a store holding the state at 4 pages only
    (inside the node): a restart read ``[1..6]`` and its state from storage (so no node ends
    at 4), served ``[7, 8]``, then every state of the path left the tree (demoted, then
    dropped by a full one-slot host state table: the KV stays)."""
    a = [t for t in range(1, 5) for _ in range(ps)]
    b = a + [t for t in (5, 6) for _ in range(ps)]
    c = b + [t for t in (7, 8) for _ in range(ps)]
    cache, alloc, mamba = make(ps, backend=backend())
    serve(cache, alloc, mamba, a)
    serve(cache, alloc, mamba, b)
    _drained(cache).storage.close()
    cache, alloc, mamba = make(ps, device_tokens=64 * ps, host_slots=1, backend=backend(), events=events)
    assert serve(cache, alloc, mamba, c) == (0, 6 * ps)  # 1..6 from storage, one node
    _drained(cache)
    fs = cache.storage.backend
    for toks in (b, c):  # storage keeps the state at 4 pages only
        for k in _state_keys(cache, toks):
            if isinstance(fs, FileStorage):
                fs.path_of(k).unlink()
            else:
                del fs.pages[k]
    serve(cache, alloc, mamba, [20] * ps)  # its state is demoted last: the one host slot keeps it
    cache.evict(0, 8)
    cache.check_invariants()
    assert not cache._states.slot_of and len(cache._hstates.slot_of) == 1  # [20]'s
    return cache, alloc, mamba, a, c


@pytest.mark.parametrize("ps,events", [(1, False), (2, True), (4, False)])
def test_a_state_evicted_while_its_kv_stayed_is_read_from_storage(ps, events):
    """The tree's KV match (8 pages) runs past its deepest state (none): the stored state at
    4 pages, inside a node, is read into a host state slot on that node (split there), no KV
    is read, the match ends there (``storage_len`` 0: storage gave no tokens' KV) and
    ``load_back`` loads it, bit-equal to the bytes stored."""
    cache, alloc, mamba, a, c = _kv_without_states(ps, _one(DictStorage()), events)
    fetched, host, queued = cache.storage.stats.fetched, cache.host_size(), cache.storage_stats["states_queued"]
    m = cache.match_prefix(np.array(c + [99] * ps, dtype=np.int32))
    assert (m.prefix_len, m.host_len, m.kv_prefix_len, m.storage_len) == (0, 4 * ps, 8 * ps, 0)
    assert len(m.host_node.kbuf) == 4 * ps * 4 and m.host_node.vbuf  # split at 4 pages; a device node
    assert cache.storage.stats.fetched - fetched == cache._chunks and cache.host_size() == host  # no KV read
    st = cache.storage_stats
    assert (st["states_fetched_in_tree"], st["in_tree_state_tokens"], st["state_misses"]) == (1, 4 * ps, 0)
    cache.check_invariants()
    stored = b"".join(cache.storage.backend.pages[k] for k in _state_keys(cache, a))
    got = cache.load_back(m)
    cache.check_invariants()
    assert got.prefix_len == 4 * ps
    assert torch.equal(read_kv(cache, got.device_indices), kv(a))
    raw = cache._hstates_pool().device_state_bytes(cache.state_slot(got.last_node))
    assert raw.numpy().tobytes() == stored[:raw.numel()]  # bit-equal to the stored bytes
    assert float(mamba.temporal_state[0, cache.state_slot(got.last_node), 0, 0, 0]) == state_of(a)
    assert cache.storage_stats["states_queued"] == queued  # read from storage: not written again
    assert serve(cache, alloc, mamba, c + [9] * ps) == (4 * ps, 0)
    cache.check_invariants()


def test_a_corrupt_stored_state_within_the_kv_match_is_a_miss_changing_nothing(tmp_path):
    cache, _, _, a, c = _kv_without_states(1, lambda: FileStorage(tmp_path, page_bytes=64))
    fs = cache.storage.backend
    path = fs.path_of(_state_keys(cache, a)[0])
    raw = bytearray(path.read_bytes())
    raw[3] ^= 0xFF
    path.write_bytes(bytes(raw))
    before = _tree_shape(cache)
    m = cache.match_prefix(c + [99])
    assert (m.prefix_len, m.host_len, m.kv_prefix_len, m.storage_len) == (0, 0, 8, 0)
    assert cache.storage_stats["state_misses"] == 1 and fs.stats().corrupt == 1
    assert cache.storage_stats["states_fetched_in_tree"] == 0 and _tree_shape(cache) == before
    cache.check_invariants()


@pytest.mark.parametrize("tail", [0, 1])
def test_the_deadline_bounds_a_lookup_within_the_kv_match(tail):
    """Every backend read call takes 0.6 s, the timeout is 0.5 s: with the key inside the
    tree (``tail`` 0: the probe alone) or past it (the KV read first, then the probe), the
    match gives up within about one timeout, no hit, one counted timeout and no miss."""
    store = DictStorage()
    cache, _, _, _, c = _kv_without_states(1, _one(store))
    cache.storage.timeout_s = 0.5
    store.delay = 0.6
    timeouts = cache.storage.stats.fetch_timeouts
    t0 = time.monotonic()
    m = cache.match_prefix(c + [99] * tail)
    took = time.monotonic() - t0
    assert (m.host_len, m.kv_prefix_len) == (0, 8)
    assert cache.storage.stats.fetch_timeouts - timeouts == 1 and cache.storage_stats["state_misses"] == 0
    assert took < 2.5 * 0.5, took  # one shared deadline
    cache.check_invariants()
    assert cache.storage.wait_reads(10.0)
    store.delay = 0.0
    cache.storage.timeout_s = 5.0
    assert cache.match_prefix(c + [99]).host_len == 4  # the slow double was slow, not broken
    cache.check_invariants()


def test_a_stretch_storage_lacked_is_not_probed_again_until_a_state_is_queued_there():
    """Nothing stored at the KV match's stateless page ends: the first match probes them (one
    ``batch_exists`` each), the next asks storage nothing; a new node past them whose state
    was queued, then left the tree, is probed and its state found."""
    store = DictStorage()
    cache, alloc, mamba, a, c = _kv_without_states(1, _one(store))
    for k in _state_keys(cache, a):
        del store.pages[k]
    calls = store.calls
    m = cache.match_prefix(c)
    assert (m.host_len, m.kv_prefix_len, cache.storage_stats["state_misses"]) == (0, 8, 0)
    assert store.calls - calls == 8  # one probe per page end
    calls = store.calls
    assert cache.match_prefix(c).host_len == 0 and store.calls == calls  # known absent
    cache.check_invariants()
    assert serve(cache, alloc, mamba, c + [9]) == (0, 0)  # no state anywhere: from scratch, state at 9
    _drained(cache)
    serve(cache, alloc, mamba, [21])
    cache.evict(0, 8)  # the state at 9 demoted, then dropped by [21]'s
    calls = store.calls
    m = cache.match_prefix(c + [9])
    assert (m.host_len, m.kv_prefix_len, cache.storage_stats["states_fetched_in_tree"]) == (9, 9, 1)
    assert store.calls - calls == 2  # the probe of page end 9 alone, then the state read's batch_exists
    cache.check_invariants()
