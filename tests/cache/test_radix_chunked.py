"""Request-level caching: chunked prefill through cache_unfinished_req, then
cache_finished_req, with the real ReqToTokenPool and allocators; duplicate rows, row
rewrites, lock moves, page tails, disable, and bad requests."""
import numpy as np
import pytest
import torch

from radixkv.allocator import PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator
from radixkv.cache import RadixCache, RadixKey
from radixkv.errors import InvalidArgumentError, InvalidIndexError, LengthMismatchError
from radixkv.memory import ReqToTokenPool
from radixkv.scheduler.req import Req

POOL = 256


def setup(page_size=1, device="cpu", **kw):
    pool = ReqToTokenPool(8, 64, device=device)
    alloc = (TokenToKVPoolAllocator(POOL, device=device) if page_size == 1
             else PagedTokenToKVPoolAllocator(POOL, page_size, device=device))
    return RadixCache(pool, alloc, page_size=page_size, **kw), pool, alloc


def admit(cache, pool, alloc, req, upto):
    """What the scheduler does for a new request: match its first ``upto`` tokens, lock,
    take a row, allocate slots (whole pages) for the rest of them, write the row."""
    m = cache.match_prefix(RadixKey(req.fill_ids[:upto], req.extra_key))
    cache.inc_lock_ref(m.last_node)
    pool.alloc([req])
    ps = cache.page_size
    need = upto - m.prefix_len
    fresh = alloc.alloc(-(-need // ps) * ps)[:need]
    row = torch.cat([m.device_indices, fresh])
    pool.write((req.req_pool_idx, slice(0, upto)), row)
    req.prefix_indices, req.last_node = m.device_indices, m.last_node
    req.cache_protected_len = m.prefix_len
    req.kv_committed_len = upto
    return fresh


def extend(cache, pool, alloc, req, upto):
    """Continue a request that holds a row: slots for tokens [kv_committed_len, upto)
    (page size 1 only)."""
    lo = req.kv_committed_len
    fresh = alloc.alloc(upto - lo)
    pool.write((req.req_pool_idx, slice(lo, upto)), fresh)
    req.kv_committed_len = upto
    return fresh


def row(pool, req, n):
    return pool.req_to_token[req.req_pool_idx, :n].to(torch.int64)


def conserved(cache, pool, alloc, running=()):
    """Every slot is free, in the tree, or owned by a running request beyond its
    protected prefix (whole pages)."""
    ps = cache.page_size
    held = 0
    for r in running:
        own = row(pool, r, r.kv_committed_len)[r.cache_protected_len:]
        held += len(np.unique(own.cpu().numpy() // ps)) * ps
    return alloc.available_size() + cache.total_size() + held == alloc.size


def test_chunked_prefill_then_finish(device):
    cache, pool, alloc = setup(device=device)
    prompt = np.arange(100, 120, dtype=np.int32)
    r1 = Req("r1", prompt)
    admit(cache, pool, alloc, r1, 8)
    cache.cache_unfinished_req(r1)
    assert r1.cache_protected_len == 8 and r1.last_node.num_tokens == 8
    assert torch.equal(r1.prefix_indices.cpu(), row(pool, r1, 8).cpu())
    assert r1.prefix_indices.dtype == torch.int64
    assert cache.protected_size() == 8 and cache.evictable_size() == 0
    first_node = r1.last_node
    extend(cache, pool, alloc, r1, 16)
    cache.cache_unfinished_req(r1)
    assert r1.cache_protected_len == 16 and r1.last_node is not first_node
    assert cache.protected_size() == 16  # the lock moved down the path, nothing leaked
    assert first_node.lock_ref == 1 and r1.last_node.lock_ref == 1
    cache.check_invariants()
    assert conserved(cache, pool, alloc, [r1])
    # decode: the rest of the prompt plus 3 output tokens
    for t in (7, 8, 9):
        r1.append_output(t)
    extend(cache, pool, alloc, r1, 23)
    cache.cache_finished_req(r1)
    pool.free(r1)
    assert cache.protected_size() == 0 and cache.total_size() == 23
    assert cache.match_prefix(r1.fill_ids).prefix_len == 23
    cache.check_invariants()
    alloc.check_invariants()
    assert conserved(cache, pool, alloc)


def test_duplicates_are_freed_and_the_row_points_at_the_tree(device):
    cache, pool, alloc = setup(device=device)
    prompt = np.arange(1, 25, dtype=np.int32)
    r1, r2 = Req("r1", prompt), Req("r2", prompt[:12].copy())
    admit(cache, pool, alloc, r1, 16)
    own2 = admit(cache, pool, alloc, r2, 12)  # matched nothing: computes its own 12 rows
    cache.cache_unfinished_req(r1)  # the tree now holds tokens [0, 16) with r1's rows
    tree_rows = row(pool, r1, 12).clone()
    avail = alloc.available_size()
    cache.cache_unfinished_req(r2)  # its 12 rows duplicate the tree's: freed, row rewritten
    assert alloc.available_size() == avail + 12
    assert torch.equal(row(pool, r2, 12).cpu(), tree_rows.cpu())
    assert not bool(alloc.is_free(tree_rows).any())
    assert bool(alloc.is_free(own2).all())
    assert r2.cache_protected_len == 12
    assert torch.equal(r2.prefix_indices.cpu(), tree_rows.cpu())
    cache.check_invariants()
    assert conserved(cache, pool, alloc, [r1, r2])
    cache.cache_finished_req(r2)  # nothing new, no duplicates left: only the unlock
    pool.free(r2)
    assert alloc.available_size() == avail + 12
    cache.cache_finished_req(r1)
    pool.free(r1)
    cache.check_invariants()
    assert cache.protected_size() == 0 and conserved(cache, pool, alloc)


def test_finished_duplicates_without_chunking():
    cache, pool, alloc = setup()
    toks = np.arange(50, 60, dtype=np.int32)
    a, b = Req("a", toks), Req("b", toks.copy())
    admit(cache, pool, alloc, a, 10)
    own_b = admit(cache, pool, alloc, b, 10)
    cache.cache_finished_req(a)
    pool.free(a)
    cache.cache_finished_req(b)  # all 10 of b's rows were duplicates
    pool.free(b)
    assert bool(alloc.is_free(own_b).all())
    assert cache.total_size() == 10 and alloc.available_size() == POOL - 10
    cache.check_invariants()


def test_paged_chunks_keep_the_unaligned_tail(device):
    cache, pool, alloc = setup(page_size=4, device=device)
    prompt = np.arange(200, 222, dtype=np.int32)  # 22 tokens
    r = Req("r", prompt)
    admit(cache, pool, alloc, r, 22)  # all slots for the prompt, whole pages
    r.kv_committed_len = 10           # first chunk: 10 tokens computed
    cache.cache_unfinished_req(r)
    assert r.cache_protected_len == 8 and cache.total_size() == 8
    assert torch.equal(r.prefix_indices.cpu(), row(pool, r, 10).cpu())  # tree rows + tail
    r.kv_committed_len = 22
    cache.cache_unfinished_req(r)
    assert r.cache_protected_len == 20 and cache.total_size() == 20
    cache.check_invariants()
    assert conserved(cache, pool, alloc, [r])
    cache.cache_finished_req(r)  # frees the 2-token tail's page
    pool.free(r)
    assert cache.total_size() == 20 and alloc.available_size() == alloc.size - 20
    assert cache.protected_size() == 0
    cache.check_invariants()
    alloc.check_invariants()


def test_disabled_cache_frees_everything():
    cache, pool, alloc = setup(disable=True)
    r = Req("r", np.arange(1, 11, dtype=np.int32))
    admit(cache, pool, alloc, r, 10)
    cache.cache_unfinished_req(r)  # no-op
    assert r.cache_protected_len == 0 and cache.total_size() == 0
    cache.cache_finished_req(r)
    pool.free(r)
    assert alloc.available_size() == POOL


def test_bad_requests_change_nothing():
    cache, pool, alloc = setup()
    r = Req("r", np.arange(1, 11, dtype=np.int32))
    with pytest.raises(InvalidArgumentError):
        cache.cache_finished_req(r)  # no row
    admit(cache, pool, alloc, r, 10)
    cache.cache_unfinished_req(r)
    snap = (cache.pretty_print(), alloc.available_size(), pool.req_to_token.clone())

    def unchanged():
        return (cache.pretty_print(), alloc.available_size()) == snap[:2] and \
            torch.equal(pool.req_to_token, snap[2])

    r.cache_protected_len = 11
    with pytest.raises(InvalidArgumentError):
        cache.cache_finished_req(r)
    assert unchanged()
    r.cache_protected_len = 10
    node = r.last_node
    other = RadixCache(None, TokenToKVPoolAllocator(8))
    other.insert([5], torch.tensor([1]))
    r.last_node = other.match_prefix([5]).last_node
    with pytest.raises(InvalidArgumentError):
        cache.cache_unfinished_req(r)
    assert unchanged()
    r.last_node = node
    r.req_pool_idx, saved = 99, r.req_pool_idx
    with pytest.raises(InvalidIndexError):
        cache.cache_finished_req(r)
    assert unchanged()
    r.req_pool_idx = saved
    r.output_ids = np.arange(60, dtype=np.int32)
    r.kv_committed_len = 70
    with pytest.raises(LengthMismatchError):
        cache.cache_finished_req(r)
    assert unchanged()
    r.output_ids = np.empty(0, dtype=np.int32)
    r.kv_committed_len = 10
    with pytest.raises(InvalidArgumentError):
        RadixCache(None, alloc).cache_finished_req(r)
    cache.cache_finished_req(r)
    pool.free(r)
    assert conserved(cache, pool, alloc)
    cache.check_invariants()


def test_tree_rows_are_never_freed_even_if_protected_len_lags():
    cache, pool, alloc = setup()
    toks = np.arange(70, 80, dtype=np.int32)
    a = Req("a", toks)
    admit(cache, pool, alloc, a, 10)
    cache.cache_finished_req(a)
    pool.free(a)
    b = Req("b", np.concatenate([toks, np.arange(5, dtype=np.int32)]))
    admit(cache, pool, alloc, b, 15)   # its row starts with the tree's 10 rows
    b.cache_protected_len = 0          # a caller that forgot to record the prefix
    cache.cache_finished_req(b)
    pool.free(b)
    cache.check_invariants()           # no tree row was handed back to the allocator
    assert cache.total_size() == 15 and alloc.available_size() == POOL - 15
