"""The compiled walks (``radixkv.cache.native``) against the pure-Python reference.

Two caches, one with ``native=True`` and one with ``native=False``, get the same seeded
operations (inserts that extend, branch and split; matches that end on, inside and past
nodes; locks; evictions; namespaces; page sizes 1, 4, 16). After every operation both
return the same results and hold identical trees: every node's tokens, rows,
``last_access``, ``hits``, ``lock_ref`` and ``only``, and both pass ``check_invariants``.
The C functions' own contracts (argument checks, ``narrow``'s refusals) are tested
directly. Skipped when the extension is not built.
"""
import gc
import sys

import numpy as np
import pytest
import torch

from radixkv.cache import RadixCache, RadixKey, native
from radixkv.cache.radix_cache import NativeRadixCache
from radixkv.cache.tree_node import NamespaceHead, TreeNode
from radixkv.errors import AlignmentError, InvalidArgumentError, InvalidIndexError, LengthMismatchError

pytestmark = pytest.mark.skipif(not native.available(), reason=f"{native.unavailable_reason}")


def snapshot(cache):
    """Every node's fields, in a canonical order (children sorted by first page)."""
    out = []
    for extra, head in sorted(cache._heads.items(), key=lambda kv: repr(kv[0])):
        stack = [(head, ())]
        while stack:
            node, path = stack.pop()
            out.append((repr(extra), path, node.kbuf, node.vbuf, node.last_access, node.hits,
                        node.lock_ref, node.only is not None, node.skey, node.created, node.id,
                        node.priority, node.block_hashes, node.pstate,
                        None if node.parent is None else node.parent.id))
            for k in sorted(node.children, reverse=True):
                stack.append((node.children[k], path + (k,)))
    return out


def result(m):
    return m.prefix_len, m.device_indices.dtype, m.device_indices.tolist(), m.last_node.kbuf


class Twin:
    """A native and a pure-Python cache driven in lockstep."""

    def __init__(self, page_size, policy="lru"):
        self.ps = page_size
        self.c = RadixCache(page_size=page_size, eviction_policy=policy, native=True)
        self.p = RadixCache(page_size=page_size, eviction_policy=policy, native=False)
        self.next_row = 0
        self.locked = []  # (native node, python node)
        self.match_splits = 0  # matches that ended inside a node (the split path)

    def both(self, name, *args):
        a = getattr(self.c, name)(*args)
        b = getattr(self.p, name)(*args)
        return a, b

    def check(self):
        self.c.check_invariants()
        self.p.check_invariants()
        assert snapshot(self.c) == snapshot(self.p)
        assert self.c._clock == self.p._clock

    def insert(self, tokens, extra=None):
        n = len(tokens) - len(tokens) % self.ps
        rows = torch.arange(self.next_row, self.next_row + n, dtype=torch.int64)
        self.next_row += n
        a = self.c.insert(RadixKey(tokens[:n], extra), rows)
        b = self.p.insert(RadixKey(tokens[:n], extra), rows.clone())
        assert a == b
        return a

    def match(self, tokens, extra=None, lock=False):
        nodes = self.c._next_id
        a = self.c.match_prefix(RadixKey(tokens, extra))
        self.match_splits += self.c._next_id != nodes
        b = self.p.match_prefix(RadixKey(tokens, extra))
        assert result(a) == result(b)
        if lock:
            self.c.inc_lock_ref(a.last_node)
            self.p.inc_lock_ref(b.last_node)
            self.locked.append((a.last_node, b.last_node))
        return a


@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("policy", ["lru", "lfu", "slru"])
def test_native_and_python_walks_agree_on_random_operations(page_size, policy):
    rng = np.random.default_rng(page_size * 7 + len(policy))
    t = Twin(page_size, policy)
    assert t.c._native_find is not None and t.p._native_find is None
    assert (t.c._native_walk is not None) == (policy != "slru")  # slru has an on_hit hook
    seqs = []
    for _step in range(400):
        op = rng.random()
        extra = None if rng.random() < 0.8 else "ns"
        if op < 0.35 or not seqs:
            if seqs and rng.random() < 0.7:  # extend or branch off a known sequence
                base = seqs[rng.integers(len(seqs))][1]
                cut = int(rng.integers(0, len(base) + 1))
                tokens = np.concatenate([base[:cut], rng.integers(0, 3, int(rng.integers(1, 40)))])
            else:
                tokens = rng.integers(0, 3, int(rng.integers(1, 80)))
            tokens = tokens.astype(np.int32)
            t.insert(tokens, extra)
            seqs.append((extra, tokens))
        elif op < 0.8:
            extra, base = seqs[rng.integers(len(seqs))]
            cut = int(rng.integers(0, len(base) + 1))
            tokens = np.concatenate([base[:cut], rng.integers(0, 3, int(rng.integers(0, 6)))]).astype(np.int32)
            t.match(tokens, extra, lock=rng.random() < 0.2)
        elif op < 0.9 and t.locked:
            a, b = t.locked.pop(int(rng.integers(len(t.locked))))
            t.c.dec_lock_ref(a)
            t.p.dec_lock_ref(b)
        else:
            a, b = t.both("evict", int(rng.integers(1, 60)))
            assert a == b
        t.check()
    assert t.match_splits > 5


def test_long_paths_and_many_children():
    """Paths of more than 32 nodes (the walk's row buffer grows) and nodes with many
    children (the dict probe instead of ``only``)."""
    t = Twin(1)
    base = np.arange(200, dtype=np.int32)
    for cut in range(1, 200, 3):  # each insert splits the chain once more
        t.insert(np.concatenate([base[:cut], np.array([1000 + cut], np.int32)]))
        t.check()
    m = t.match(base)
    assert m.prefix_len == 199  # the longest inserted cut; its path has 67 nodes
    depth, node = 0, m.last_node
    while node.parent is not None:
        depth, node = depth + 1, node.parent
    assert depth > 32
    t.check()
    for k in range(50):  # 50 children under one node
        t.insert(np.array([5000, k, k + 1], np.int32))
    for k in range(50):
        assert t.match(np.array([5000, k, k + 1, 7], np.int32)).prefix_len == 3
    t.check()


def test_match_of_nothing_and_device_result_types():
    t = Twin(4)
    t.insert(np.arange(8, dtype=np.int32))
    for tokens in ([], [9, 9, 9, 9], [0, 1, 2], [0, 1, 2, 3, 4, 5, 6]):
        m = t.match(np.array(tokens, np.int32))
        assert m.device_indices.dtype == torch.int64 and m.device_indices.dim() == 1
    t.check()


def test_narrow_contract():
    def narrow(arr, start):
        return native.narrow(arr.ctypes.data, arr.size, start)

    a = np.array([0, 5, 2**31 - 1], np.int64)
    assert narrow(a, 0) == np.array([0, 5, 2**31 - 1], np.int32).tobytes()
    assert narrow(a, 1) == np.array([5, 2**31 - 1], np.int32).tobytes()
    assert narrow(a, 3) == b""
    assert native.narrow(0, 0, 0) == b""
    assert narrow(np.array([1, -1], np.int64), 0) is None
    assert narrow(np.array([1, 2**31], np.int64), 0) is None
    assert narrow(np.array([-(2**63), 1], np.int64), 0) is None
    assert narrow(np.array([2**31, 1], np.int64), 1) == np.array([1], np.int32).tobytes()
    big = np.arange(10_000, dtype=np.int64)  # the vector loop and its remainder
    for start in (0, 1, 7, 9_999):
        assert narrow(big, start) == big[start:].astype(np.int32).tobytes()
    big[5_003] = -2
    assert narrow(big, 0) is None and narrow(big, 5_004) is not None
    for args in [(a.ctypes.data, 3, 4), (a.ctypes.data, 3, -1), (a.ctypes.data, -1, 0), (0, 3, 0)]:
        with pytest.raises(ValueError):
            native.narrow(*args)
    with pytest.raises(TypeError):
        native.narrow(a.ctypes.data, 3)


def test_insert_falls_back_and_raises_like_python():
    """Bad rows, strided values: the native insert raises the same errors and leaves the
    tree as it was."""
    for nat in (True, False):
        c = RadixCache(page_size=1, native=nat)
        c.insert(RadixKey([1, 2, 3]), torch.tensor([0, 1, 2]))
        before = c.pretty_print()
        with pytest.raises(InvalidIndexError):
            c.insert(RadixKey([1, 2, 3, 4]), torch.tensor([0, 1, 2, -5]))
        with pytest.raises(InvalidIndexError):
            c.insert(RadixKey([1, 2, 3, 4]), torch.tensor([0, 1, 2, 2**31]))
        assert c.pretty_print() == before
        c.check_invariants()
        strided = torch.arange(0, 20, dtype=torch.int64)[::2][:5]
        assert c.insert(RadixKey([1, 2, 9, 9, 9]), strided) == 2
        assert c.match_prefix(RadixKey([1, 2, 9, 9, 9])).device_indices.tolist() == [0, 1, 4, 6, 8]
        offset = torch.arange(100, 120, dtype=torch.int64)[10:14]  # a view with a storage offset
        assert c.insert(RadixKey([1, 2, 3, 7]), offset) == 3
        assert c.match_prefix(RadixKey([1, 2, 3, 7])).device_indices.tolist() == [0, 1, 2, 113]
        bad = torch.arange(100, 120, dtype=torch.int64)
        bad[15] = -1
        with pytest.raises(InvalidIndexError):
            c.insert(RadixKey([1, 2, 3, 8, 8]), bad[12:17])
        c.check_invariants()


def test_walk_rejects_bad_arguments_without_crashing():
    head = NamespaceHead(0, None)
    for args in [(object(), b"", 0, 4, 0), (head, "abc", 0, 4, 0), (head, b"\0" * 8, 12, 4, 0),
                 (head, b"\0" * 8, 4, 3, 0), (head, b"\0" * 8, 6, 4, 0), (head, b"", 0, 4)]:
        with pytest.raises((TypeError, ValueError)):
            native.walk(*args)
    with pytest.raises((TypeError, ValueError)):
        native.find(head, b"\0" * 8, 12, 4)
    bad = TreeNode(1, head, b"\0" * 4, b"\0" * 4)
    head.children[b"\0" * 4] = bad
    head.only = bad
    bad.hits = "many"
    with pytest.raises(TypeError):
        native.walk(head, b"\0" * 4, 4, 4, 0)
    head.only = "not a node"
    with pytest.raises(TypeError):
        native.find(head, b"\0" * 4, 4, 4)
    empty = NamespaceHead(2, None)
    pos, node, tick, rows, split = native.walk(empty, b"\0" * 8, 8, 4, 7)
    assert (pos, node, tick, split) == (0, empty, 7, None)
    assert rows.dtype == torch.int64 and rows.shape == (0,)


def test_new_node_sets_what_init_sets():
    parent = NamespaceHead(0, None)
    a = native.new_node(7, parent, b"\1\0\0\0", b"\2\0\0\0", 11, 3)
    b = TreeNode(7, parent, b"\1\0\0\0", b"\2\0\0\0", 11, 3)
    assert type(a) is TreeNode
    for name in TreeNode.__slots__:
        assert getattr(a, name) == getattr(b, name), name
    assert a.children is not b.children and a.children == {}
    a.children[b"x"] = b  # its own dict, a full node: usable like one made by __init__
    a.only = b
    assert repr(a).startswith("TreeNode(id=7")
    with pytest.raises(TypeError):
        native.new_node(1, parent, b"", b"")


def test_compiled_match_prefix_entry_takes_or_hands_over_every_call_form():
    """RadixCache.match_prefix is the compiled entry; every form of call gives what the
    Python method gives (the compiled cache against a pure one, same state)."""
    assert NativeRadixCache.match_prefix is not RadixCache.match_prefix
    assert "RadixCache.match_prefix (Python)" in NativeRadixCache.match_prefix.__doc__
    assert type(RadixCache()) is NativeRadixCache and type(RadixCache(native=None)) is NativeRadixCache
    assert type(RadixCache(native=False)) is RadixCache
    t = Twin(2)
    t.insert(np.arange(12, dtype=np.int32))
    t.insert(np.arange(12, dtype=np.int32), extra="ns")
    calls = [
        ((RadixKey(np.arange(6, dtype=np.int32)),), {}),
        ((RadixKey(np.arange(6, dtype=np.int32), "ns"),), {}),
        ((RadixKey(np.arange(6, dtype=np.int32), "nowhere"),), {}),  # no such namespace
        ((RadixKey([]),), {}),  # empty
        ((RadixKey([0]),), {}),  # less than a page
        (([0, 1, 2, 3],), {}),  # token list
        ((np.arange(8, dtype=np.int32), "ns"), {}),  # array + extra_key, positional
        ((), {"key": RadixKey([0, 1, 2, 3])}),  # keywords
        (([0, 1, 2, 3],), {"extra_key": "ns"}),
    ]
    for args, kwargs in calls:
        a = t.c.match_prefix(*args, **kwargs)
        b = t.p.match_prefix(*args, **kwargs)
        assert type(a) is type(b) and result(a) == result(b), (args, kwargs)
        t.check()
    for bad in [((), {}), ((RadixKey([0, 1]), None, 3), {}), ((RadixKey([0, 1]),), {"nope": 1})]:
        with pytest.raises(TypeError):
            t.c.match_prefix(*bad[0], **bad[1])
    with pytest.raises(InvalidArgumentError):
        t.c.match_prefix("not tokens")
    small = [RadixCache(page_size=1, metrics_window=2, native=nat) for nat in (True, False)]
    for c in small:  # the query log folds every 4 queries
        c.insert(RadixKey([5, 6, 7]), torch.tensor([1, 2, 3]))
        for i in range(11):
            c.match_prefix(RadixKey([5, 6, 7, i][: 1 + i % 4]))
    assert small[0].metrics.snapshot() == small[1].metrics.snapshot()
    assert small[0].metrics.snapshot().queries == 11
    off = RadixCache(page_size=2, disable=True)
    assert off.match_prefix(RadixKey([0, 1])).prefix_len == 0
    assert t.c.metrics.snapshot() == t.p.metrics.snapshot()


def test_compiled_paths_leak_no_references():
    """Reference counts of everything the C code reads, returns or creates are back where
    they were after 1,000 rounds of each call (a leak or an extra decref shows here)."""
    c = RadixCache(page_size=1, native=True)
    key = RadixKey(np.arange(50, dtype=np.int32))
    c.insert(key, torch.arange(50))
    c.insert(RadixKey(np.r_[np.arange(30), [99, 98]].astype(np.int32)), torch.arange(100, 132))
    short = RadixKey(np.arange(20, dtype=np.int32))
    c.match_prefix(short)  # splits once; later calls end on that node
    big = RadixKey(np.arange(10**6, 10**6 + 3000, dtype=np.int32))  # a pooled result
    c.insert(big, torch.arange(1000, 4000))
    big_leaf = c.match_prefix(big).last_node
    leaf = c.match_prefix(key).last_node
    head = c._heads[None]
    objs = [key, key._buf, short._buf, c._heads, head, leaf, leaf.vbuf, leaf.kbuf, leaf.parent,
            leaf.parent.vbuf, leaf.parent.parent, c.metrics.query_log, big_leaf, big_leaf.vbuf]
    value = torch.arange(50)
    arr = np.arange(40, dtype=np.int64)
    before = [sys.getrefcount(o) for o in objs] + [sys.getrefcount(value), sys.getrefcount(arr)]
    for i in range(1000):
        m = c.match_prefix(key)
        m2 = c.match_prefix(short)
        m3 = c.match_prefix(big)
        c.insert(key, value)
        c._insert(key, value, 0)  # the compiled entry's (prefix, node, path) form
        native.narrow(arr.ctypes.data, arr.size, i % 40)
        node = native.new_node(i, leaf, leaf.kbuf, leaf.vbuf, i, 0)
        del m, m2, m3, node
    after = [sys.getrefcount(o) for o in objs] + [sys.getrefcount(value), sys.getrefcount(arr)]
    assert after == before
    assert all(used == 0 for _, _, used in native.pool_stats())
    c.check_invariants()
    # new leaves under a locked node, then evicted: the node, the value, the tree's
    # structures hold what they held before
    c.inc_lock_ref(leaf)
    c.evict(10**6)  # the other branches go first (a parent left with one child points 'only' at it)
    base = np.arange(50, dtype=np.int32)
    values = [torch.arange(10**4 + 52 * i, 10**4 + 52 * (i + 1)) for i in range(300)]
    objs = [leaf, leaf.kbuf, leaf.vbuf, head, c._heads, c._leaves, c.metrics]
    gc.collect()
    before = [sys.getrefcount(o) for o in objs]
    for i, v in enumerate(values):
        assert c.insert(RadixKey(np.r_[base, [i + 10**5, i + 2 * 10**5]].astype(np.int32)), v) == 50
    c.check_invariants()
    assert c.evict(10**6) >= 600
    gc.collect()
    assert [sys.getrefcount(o) for o in objs] == before
    del v
    assert {sys.getrefcount(x) for x in values} == {3}  # the list, the loop name, the call
    c.dec_lock_ref(leaf)
    c.check_invariants()


def test_pooled_results_are_never_shared_while_alive():
    """Results of 1,024+ rows are views into pooled buffers: a live result keeps its buffer
    (later matches of the same size class get another one, or a fresh array when the class's
    buffers are all taken), and a buffer is reused only after its result is gone."""
    c = RadixCache(page_size=1, native=True)
    keys = [RadixKey(np.arange(k * 10_000, k * 10_000 + 1500, dtype=np.int32)) for k in range(7)]
    for k, key in enumerate(keys):
        c.insert(key, torch.arange(k * 2000, k * 2000 + 1500))

    def in_use():
        return {cls: used for cls, have, used in native.pool_stats() if have}

    live = [c.match_prefix(key).device_indices for key in keys]  # 7 live, 4 pooled per class
    for k, t in enumerate(live):
        assert t.tolist() == list(range(k * 2000, k * 2000 + 1500))
    assert in_use()[2048] == 4
    as_np = live[0].numpy()  # a numpy view of a pooled result keeps it alive too
    view = live[1][10:20]  # so does a tensor view
    del live
    assert in_use()[2048] == 2
    again = [c.match_prefix(key).device_indices for key in reversed(keys)]
    assert as_np.tolist() == list(range(0, 1500)) and view.tolist() == list(range(2010, 2020))
    for k, t in zip(reversed(range(7)), again):
        assert t.tolist() == list(range(k * 2000, k * 2000 + 1500))
    del again, as_np, view
    assert in_use()[2048] == 0


def test_compiled_insert_entry_takes_or_hands_over_every_call_form():
    """RadixCache.insert is the compiled entry; every form of call returns and raises what
    the Python insert does and leaves the same tree (a compiled cache against a pure one)."""
    assert NativeRadixCache.insert is not RadixCache.insert
    t = Twin(2)
    t.insert(np.arange(12, dtype=np.int32))
    rows = lambda n, at=500: torch.arange(at, at + n)  # noqa: E731
    calls = [
        ((RadixKey(np.arange(16, dtype=np.int32)), rows(16)), {}),  # extends a leaf
        ((RadixKey(np.r_[np.arange(8), [70, 71]].astype(np.int32)), rows(10, 600)), {}),  # a split
        ((RadixKey(np.arange(16, dtype=np.int32)), rows(16, 700)), {}),  # all cached
        ((RadixKey([9, 9, 9, 9], "ns"), rows(4, 800)), {}),  # a new namespace
        ((RadixKey([9, 9, 8, 8], "ns"), rows(4, 810), 5), {}),  # priority, positional
        ((RadixKey([9, 9, 7, 7], "ns"), rows(4, 820)), {"priority": 3}),
        ((RadixKey([9, 9, 6, 6], "ns"), rows(4, 830), np.int64(2)), {}),
        (([5, 5, 5, 5], rows(4, 840)), {}),  # token list
        (([5, 5, 4, 4], rows(4, 850), 0, "ns"), {}),  # extra_key positional
        ((RadixKey([5, 5, 3, 3]), np.arange(860, 864)), {}),  # numpy value
        ((RadixKey([5, 5, 2, 2]), torch.arange(870, 874, dtype=torch.int32)), {}),
        ((RadixKey([5, 5, 1, 1]), torch.arange(880, 888)[::2]), {}),  # strided
        ((RadixKey([5, 6, 1, 1]), [890, 891, 892, 893]), {}),  # list value
    ]
    for args, kwargs in calls:
        a = t.c.insert(*args, **kwargs)
        b = t.p.insert(*args, **kwargs)
        assert a == b, (args, kwargs)
        t.check()
    bad = [
        ((RadixKey([1, 2, 3]), rows(3)), AlignmentError),
        ((RadixKey([1, 2]), rows(3)), LengthMismatchError),
        ((RadixKey([1, 2]), torch.tensor([1, -1])), InvalidIndexError),
        ((RadixKey([1, 2]), torch.tensor([1, 2**31])), InvalidIndexError),
        ((RadixKey([1, 2]), rows(2), 1.5), InvalidArgumentError),
        ((RadixKey([1, 2]), torch.tensor([1.0, 2.0])), InvalidArgumentError),
        ((RadixKey([1, 2]), rows(2).reshape(1, 2)), InvalidArgumentError),
    ]
    for args, err in bad:
        for cache in (t.c, t.p):
            with pytest.raises(err):
                cache.insert(*args)
        t.check()
    assert t.c.insert(RadixKey([]), rows(0)) == t.p.insert(RadixKey([]), rows(0)) == 0
    off = RadixCache(page_size=1, disable=True)
    assert off.insert(RadixKey([1]), rows(1)) == 0 and off.total_size() == 0
    pc, pn = (t.c._insert(RadixKey([4, 4, 4, 4]), rows(4, 900), 0), t.p._insert(RadixKey([4, 4, 4, 4]),
                                                                              rows(4, 900), 0))
    assert pc[0] == pn[0] and pc[1].kbuf == pn[1].kbuf
    t.check()
    assert t.c.metrics.snapshot() == t.p.metrics.snapshot()


def test_native_true_needs_the_extension(monkeypatch):
    monkeypatch.setattr(native, "_mod", None)
    monkeypatch.setattr(native, "unavailable_reason", "not built (test)")
    with pytest.raises(InvalidArgumentError, match="not built"):
        RadixCache(native=True)
    assert RadixCache().native is False
    assert RadixCache(native=False).native is False


@pytest.mark.parametrize("page_size", [1, 4])
def test_compiled_insert_path_form_agrees_with_python(page_size):
    """``_insert`` (the ``(prefix, node, path)`` form that ``cache_*_req`` and
    MambaRadixCache use) goes through the compiled entry on a native cache: the same prefix,
    end node and path (node ids, tokens, rows) as the pure cache's, on inserts that extend,
    branch, split and repeat, and the same trees after each."""
    rng = np.random.default_rng(page_size)
    t = Twin(page_size)
    assert t.c._insert_entry is native.insert and t.p._insert_entry is not native.insert
    seqs = []
    for _ in range(300):
        if seqs and rng.random() < 0.7:
            base = seqs[rng.integers(len(seqs))]
            tokens = np.concatenate([base[:int(rng.integers(0, len(base) + 1))],
                                     rng.integers(0, 3, int(rng.integers(0, 30)))])
        else:
            tokens = rng.integers(0, 3, int(rng.integers(1, 60)))
        n = len(tokens) - len(tokens) % page_size
        tokens = tokens[:n].astype(np.int32)
        rows = torch.arange(t.next_row, t.next_row + n, dtype=torch.int64)
        t.next_row += n
        prio = int(rng.integers(0, 3))
        a = t.c._insert(RadixKey(tokens), rows, prio)
        b = t.p._insert(RadixKey(tokens), rows.clone(), prio)
        assert a[0] == b[0]
        assert (a[1].id, a[1].kbuf, a[1].vbuf) == (b[1].id, b[1].kbuf, b[1].vbuf)
        assert [(x.id, x.kbuf, x.vbuf) for x in a[2]] == [(x.id, x.kbuf, x.vbuf) for x in b[2]]
        seqs.append(tokens)
        if rng.random() < 0.1:
            assert t.c.evict(20) == t.p.evict(20)
        t.check()
