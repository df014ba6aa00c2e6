"""Hypothesis state machine: the RadixCache against a brute-force model.

The model is, per namespace, the prefix-closed set of cached page-aligned prefixes, each
mapped to the KV rows of its last page. Inserts add prefixes, evictions remove some (the
tree's new content must be a subset with the same rows, the count must match the freed
tokens, and locked prefixes must survive), matches must return exactly the model's
longest cached prefix and its rows, none of them free in the allocator. After every step:
``check_invariants()`` of the cache and the allocator, the tree's content equals the
model, and no KV row leaks (free + cached == pool).
"""
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from tree_walk import walk_pages

from radixkv.allocator import PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator
from radixkv.cache import RadixCache, RadixKey
from radixkv.errors import AlignmentError, LengthMismatchError

NAMESPACES = st.sampled_from([None, "tenant-a"])
POOL = 48


def tree_content(cache):
    """Read-only walk: {(extra, prefix tuple): rows tuple of its last page}."""
    out = {}
    for head in cache._heads.values():
        for _, _, pages in walk_pages(head, cache.page_size):
            out.update(((head.extra_key, p), rows) for p, rows in pages.items())
    return out


class RadixMachine(RuleBasedStateMachine):
    page_size = 1
    policy = "lru"
    events = False
    native = None  # the compiled walks when built (radixkv.cache.native); False: pure Python

    def __init__(self):
        super().__init__()
        ps = self.page_size
        self.alloc = (TokenToKVPoolAllocator(POOL, device="cpu") if ps == 1
                      else PagedTokenToKVPoolAllocator(POOL, ps, device="cpu"))
        self.cache = RadixCache(None, self.alloc, page_size=ps, eviction_policy=self.policy,
                                enable_kv_events=self.events, native=self.native)
        self.model = {}
        self.locks = []  # (node, extra, matched prefix tuple)

    # ---------------------------------------------------------------- model helpers
    def longest(self, extra, tokens):
        ps = self.page_size
        n, rows = 0, []
        while n + ps <= len(tokens):
            page = self.model.get((extra, tuple(tokens[:n + ps])))
            if page is None:
                break
            rows.extend(page)
            n += ps
        return n, rows

    def _evict(self, k):
        before = dict(self.model)
        evictable = self.cache.evictable_size()
        freed = self.cache.evict(k)
        after = tree_content(self.cache)
        assert all(before.get(key) == rows for key, rows in after.items())
        assert (len(before) - len(after)) * self.page_size == freed
        for _, extra, prefix in self.locks:
            for n in range(self.page_size, len(prefix) + 1, self.page_size):
                assert (extra, prefix[:n]) in after, "a locked prefix was evicted"
        if k and evictable:
            assert freed > 0
        if freed < k:
            assert self.cache.evictable_size() == 0
        self.model = after
        return freed

    # ---------------------------------------------------------------- rules
    @rule(extra=NAMESPACES, pages=st.lists(st.lists(st.integers(0, 2), min_size=1, max_size=1),
                                           min_size=1, max_size=8), data=st.data())
    def insert(self, extra, pages, data):
        ps = self.page_size
        tokens = [t for p in pages for t in p] if ps == 1 else data.draw(
            st.lists(st.integers(0, 2), min_size=ps, max_size=3 * ps).map(
                lambda t: t[:len(t) - len(t) % ps]))
        n = len(tokens)
        if self.alloc.available_size() < n:
            self._evict(n - self.alloc.available_size())
        rows = self.alloc.alloc(n)
        if rows is None:
            return
        expect, _ = self.longest(extra, tokens)
        done = self.cache.insert(RadixKey(tokens, extra), rows)
        assert done == expect
        if done:
            self.alloc.free(rows[:done])
        rl = rows.tolist()
        for i in range(done, n, ps):
            self.model[(extra, tuple(tokens[:i + ps]))] = tuple(rl[i:i + ps])

    @rule(extra=NAMESPACES, tokens=st.lists(st.integers(0, 2), max_size=10), lock=st.booleans())
    def match(self, extra, tokens, lock):
        m = self.cache.match_prefix(RadixKey(tokens, extra))
        n, rows = self.longest(extra, tokens)
        assert m.prefix_len == n
        assert m.device_indices.tolist() == rows
        if n:
            assert not bool(self.alloc.is_free(m.device_indices).any()), "matched a free row"
        if lock:
            self.cache.inc_lock_ref(m.last_node)
            self.locks.append((m.last_node, extra, tuple(tokens[:n])))

    @precondition(lambda self: self.model)
    @rule(data=st.data(), extend=st.lists(st.integers(0, 2), max_size=3))
    def lock_cached(self, data, extend):
        """Match (and lock) a cached prefix, maybe extended: non-empty matches that end on
        leaves, inside nodes or at their ends."""
        extra, prefix = data.draw(st.sampled_from(sorted(self.model, key=repr)))
        self.match(extra, list(prefix) + extend, True)

    @precondition(lambda self: self.locks)
    @rule(data=st.data())
    def unlock(self, data):
        i = data.draw(st.integers(0, len(self.locks) - 1))
        node, _, _ = self.locks.pop(i)
        self.cache.dec_lock_ref(node)

    @rule(k=st.integers(0, 20))
    def evict(self, k):
        self._evict(k)

    @rule(extra=NAMESPACES, tokens=st.lists(st.integers(0, 2), min_size=1, max_size=8),
          extra_rows=st.integers(1, 2))
    def bad_insert(self, extra, tokens, extra_rows):
        before = (self.cache.pretty_print(), self.alloc.available_size())
        ps = self.page_size
        rows = list(range(1, len(tokens) + 1 + extra_rows))
        try:
            self.cache.insert(RadixKey(tokens, extra), rows)
        except (AlignmentError, LengthMismatchError) as e:
            assert isinstance(e, AlignmentError) == (len(tokens) % ps != 0)
        else:
            raise AssertionError("a bad insert was accepted")
        assert (self.cache.pretty_print(), self.alloc.available_size()) == before

    @rule()
    def reset(self):
        self.cache.reset()
        self.model = {}
        self.locks = []
        assert self.alloc.available_size() == self.alloc.size

    # ---------------------------------------------------------------- invariants
    @invariant()
    def consistent(self):
        self.cache.check_invariants()
        self.alloc.check_invariants()
        assert tree_content(self.cache) == self.model
        assert self.alloc.available_size() + self.cache.total_size() == self.alloc.size
        assert self.cache.protected_size() <= self.cache.total_size()
        if not self.locks:
            assert self.cache.protected_size() == 0


def _variant(name, **attrs):
    machine = type(name, (RadixMachine,), attrs)
    case = machine.TestCase
    case.settings = settings(max_examples=50, stateful_step_count=60)
    return case


TestRadixLRU = _variant("LRUMachine", policy="lru", events=True)
TestRadixPagedSLRU = _variant("PagedSLRUMachine", page_size=2, policy="slru")
TestRadixPagedPriority = _variant("PagedPriorityMachine", page_size=4, policy="priority", events=True)
TestRadixMRU = _variant("MRUMachine", policy="mru")
TestRadixLFU = _variant("LFUMachine", policy="lfu")
TestRadixPagedLRU = _variant("PagedLRUMachine", page_size=4, policy="lru")
TestRadixPurePython = _variant("PureLRUMachine", policy="lru", events=True, native=False)
