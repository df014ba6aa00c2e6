"""The scheduler flow: extend -> decode xN -> release with prefix sharing, chunked prefill,
paged decode, eviction, and the all-or-nothing failure paths.

A fake KV buffer (``kv[slot] = token id``) plays the model: after every step, every request's
row must map its committed tokens to slots that hold exactly those tokens, which checks
prefix reuse end to end, not just the bookkeeping."""
import numpy as np
import pytest
import torch

from radixkv.allocator import PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator
from radixkv.cache.kv_conservation import check_conservation
from radixkv.cache.radix_cache import RadixCache
from radixkv.errors import CapacityError, InvalidArgumentError
from radixkv.memory import ReqToTokenPool
from radixkv.scheduler import flow
from radixkv.scheduler.batch import Batch, ForwardMode
from radixkv.scheduler.flow import alloc_for_decode, alloc_for_extend, release_kv_cache
from radixkv.scheduler.req import Req


class Env:
    """Pools + tree + a fake KV buffer that records which token each slot holds."""

    def __init__(self, page_size, slots=512, rows=16, width=256, device="cpu"):
        self.ps = page_size
        self.pool = ReqToTokenPool(rows, width, device)
        if page_size == 1:
            self.alloc = TokenToKVPoolAllocator(slots, device)
        else:
            self.alloc = PagedTokenToKVPoolAllocator(slots, page_size, device)
        self.tree = RadixCache(self.pool, self.alloc, page_size=page_size, enable_kv_events=True)
        self.kv = torch.full((slots + 2 * page_size,), -1, dtype=torch.int64, device=device)
        self.running = []

    def batch(self, reqs, fill_lens=None):
        return Batch(reqs, self.pool, self.alloc, self.tree, fill_lens=fill_lens)

    def extend(self, reqs, fill_lens=None):
        b = self.batch(reqs, fill_lens)
        out = alloc_for_extend(b)
        toks = [torch.from_numpy(r.fill_ids[int(p):int(s)]) for r, p, s in zip(reqs, b.prefix_lens, b.seq_lens_cpu)]
        self.kv[out] = torch.cat(toks).to(self.kv) if toks else self.kv[:0]
        self.running += [r for r in reqs if r not in self.running]
        self.check(b)
        return b

    def decode(self, b, rng):
        for r in b.reqs:
            r.append_output(int(rng.integers(0, 50)))
        out = alloc_for_decode(b)
        self.kv[out] = torch.tensor([int(r.output_ids[-1]) for r in b.reqs], dtype=torch.int64).to(self.kv.device)
        self.check(b)
        return out

    def release(self, r):
        release_kv_cache(r, self.tree)
        self.running.remove(r)
        self.check()

    def check(self, batch=None):
        check_conservation(self.alloc, self.tree, self.running)
        self.tree.check_invariants()
        self.alloc.check_invariants()
        self.pool.check_invariants()
        if batch is not None:
            batch.check_invariants()
        for r in self.running:
            row = self.pool.req_to_token[r.req_pool_idx, : r.kv_committed_len].long()
            want = torch.from_numpy(r.fill_ids[: r.kv_committed_len].astype(np.int64))
            assert torch.equal(self.kv[row].cpu(), want), f"request {r.rid}: row maps to wrong tokens"

    def snapshot(self):
        return (
            self.alloc.stats(), self.alloc.free_pages.tolist(), self.pool.available_size(),
            self.pool.free_slots.available(), self.pool.req_to_token.clone(),
            self.tree.evictable_size(), self.tree.protected_size(),
            _tree_content(self.tree),
        )

    def same(self, snap):
        now = self.snapshot()
        for a, b in zip(snap, now):
            if isinstance(a, torch.Tensor):
                assert torch.equal(a, b)
            else:
                assert a == b


def _tree_content(tree):
    """Every leaf's full path: namespace, tokens, slots and per-token lock counts. A node
    split (which matching may do) leaves this unchanged; any other change shows."""
    out = []
    for leaf in tree.iter_nodes():
        if leaf.children:
            continue
        keys, vals, locks, x = [], [], [], leaf
        while x.parent is not None:
            keys.append(x.kbuf)
            vals.append(x.vbuf)
            locks.append((x.lock_ref, x.num_tokens))
            x = x.parent
        per_token = tuple(lock for lock, n in reversed(locks) for _ in range(n))
        out.append((repr(x.extra_key), b"".join(reversed(keys)), b"".join(reversed(vals)), per_token))
    return sorted(out)


def _prompt(rng, shared, n):
    return np.concatenate([shared, rng.integers(100, 1000, n)]).astype(np.int32)


@pytest.mark.parametrize("ps", [1, 16])
def test_extend_decode_release_with_shared_prefixes(ps, device):
    rng = np.random.default_rng(ps)
    env = Env(ps, device=device)
    system = rng.integers(1000, 2000, 40).astype(np.int32)
    wave1 = [Req(f"a{i}", _prompt(rng, system, 5 + 7 * i)) for i in range(4)]
    b = env.extend(wave1)
    assert b.forward_mode == ForwardMode.EXTEND and b.prefix_lens.tolist() == [0, 0, 0, 0]
    assert b.extend_num_tokens == sum(r.seq_len for r in wave1)
    for _ in range(6):
        env.decode(b, rng)
    assert b.forward_mode == ForwardMode.DECODE
    assert b.seq_lens_cpu.tolist() == [r.seq_len for r in wave1]
    for r in wave1[:2]:
        env.release(r)
    # the tree now holds the system prompt: new requests reuse its page-aligned part
    wave2 = [Req(f"b{i}", _prompt(rng, system, 3 + i)) for i in range(3)]
    b2 = env.extend(wave2)
    aligned = 40 - 40 % ps
    assert b2.prefix_lens.tolist() == [aligned] * 3
    for r in wave2:
        assert r.cache_protected_len == aligned and r.last_node is not None
        assert r.prefix_indices.numel() == aligned
    assert env.tree.protected_size() >= aligned
    merged = env.batch(wave1[2:]).merge(env.batch(wave2))
    for _ in range(ps + 2):  # cross a page boundary for every request
        env.decode(merged, rng)
    for r in list(env.running):
        env.release(r)
    assert env.tree.protected_size() == 0
    assert env.alloc.available_size() + env.tree.evictable_size() == env.alloc.size
    assert env.pool.available_size() == env.pool.size
    events = env.tree.take_events()
    assert events and all(e.block_size == ps for e in events if hasattr(e, "block_size"))


@pytest.mark.parametrize("ps", [1, 16])
def test_chunked_prefill(ps):
    rng = np.random.default_rng(10 + ps)
    env = Env(ps)
    prompt = rng.integers(0, 500, 150).astype(np.int32)
    r = Req("long", prompt)
    for end in (37, 64, 100, 150):
        b = env.extend([r], fill_lens=[end])
        assert r.kv_committed_len == end
        assert int(b.seq_lens_cpu[0]) == end
        if end < 150:
            env.tree.cache_unfinished_req(r)
            assert r.cache_protected_len == end - end % ps
            env.check()
    for _ in range(3):
        env.decode(b, rng)
    # another request with the same prompt reuses everything the chunks cached
    twin = Req("twin", prompt)
    b2 = env.extend([twin])
    assert int(b2.prefix_lens[0]) == (100 - 100 % ps)
    env.release(r)
    env.release(twin)
    assert env.tree.protected_size() == 0


def test_paged_decode_takes_a_page_only_at_boundaries():
    ps = 4
    env = Env(ps, slots=64)
    rng = np.random.default_rng(0)
    r = Req("r", rng.integers(0, 99, 5).astype(np.int32))
    b = env.extend([r])
    before = env.alloc.available_size()
    for _ in range(8):
        last = int(env.pool.req_to_token[r.req_pool_idx, r.kv_committed_len - 1])
        avail = env.alloc.available_size()
        out = int(env.decode(b, rng)[0])
        pos = r.seq_len - 1
        assert int(env.pool.req_to_token[r.req_pool_idx, pos]) == out  # written at seq_len - 1
        if pos % ps:
            assert out == last + 1 and env.alloc.available_size() == avail
        else:
            assert out % ps == 0 and env.alloc.available_size() == avail - ps
    assert before - env.alloc.available_size() == 2 * ps  # positions 8 and 12 opened pages


@pytest.mark.parametrize("ps", [1, 8])
def test_extend_evicts_the_shortfall(ps):
    rng = np.random.default_rng(3)
    env = Env(ps, slots=128)
    for i in range(3):
        r = Req(i, rng.integers(0, 99, 32).astype(np.int32))
        env.extend([r])
        env.release(r)
    assert env.tree.evictable_size() == 96 and env.alloc.available_size() == 32
    big = Req("big", rng.integers(0, 99, 64).astype(np.int32))
    env.extend([big])  # needs 64, 32 free: evicts exactly what it lacks (whole nodes)
    assert env.tree.evictable_size() == 64 and env.alloc.available_size() == 0


@pytest.mark.parametrize("ps", [1, 16])
def test_extend_failure_changes_nothing(ps):
    rng = np.random.default_rng(5)
    env = Env(ps, slots=128, rows=4)
    system = rng.integers(0, 99, 32).astype(np.int32)
    holder = Req("holder", _prompt(rng, system, 16))
    env.extend([holder])  # 48 slots, locked while it runs
    done = Req("done", _prompt(rng, system, 16))
    env.extend([done])
    env.release(done)  # its unique tail is evictable
    snap = env.snapshot()
    reqs = [Req(f"x{i}", _prompt(rng, system, 40)) for i in range(3)]
    fields = [(r.req_pool_idx, r.prefix_indices, r.last_node, r.kv_committed_len) for r in reqs]
    with pytest.raises(CapacityError) as e:
        env.extend(reqs)
    assert e.value.requested > e.value.available
    env.same(snap)
    assert [(r.req_pool_idx, r.prefix_indices, r.last_node, r.kv_committed_len) for r in reqs] == fields
    env.check()
    # too many rows for the pool
    with pytest.raises(CapacityError):
        env.extend([Req(f"y{i}", np.arange(3, dtype=np.int32)) for i in range(4)])
    env.same(snap)
    # a bad target
    with pytest.raises(InvalidArgumentError):
        env.extend([Req("z", np.arange(3, dtype=np.int32))], fill_lens=[4])
    with pytest.raises(CapacityError):  # wider than a row
        env.extend([Req("w", np.arange(300, dtype=np.int32))])
    env.same(snap)
    # after that, a request that fits still works (and uses the cached prefix)
    ok = Req("ok", _prompt(rng, system, 8))
    b = env.extend([ok])
    assert int(b.prefix_lens[0]) == 32


@pytest.mark.parametrize("where", ["alloc", "write"])
@pytest.mark.parametrize("ps", [1, 4])
def test_extend_rolls_back_after_partial_progress(ps, where, monkeypatch):
    """Failures after rows/slots were taken: everything is returned exactly."""
    rng = np.random.default_rng(6)
    env = Env(ps, slots=128)
    system = rng.integers(0, 99, 16).astype(np.int32)
    first = Req("first", _prompt(rng, system, 4))
    env.extend([first])
    env.release(first)
    snap = env.snapshot()
    reqs = [Req(f"x{i}", _prompt(rng, system, 5)) for i in range(2)]
    if where == "alloc":
        name = "alloc" if ps == 1 else "alloc_extend"
        monkeypatch.setattr(env.alloc, name, lambda *a, **k: None)
        err = CapacityError
    else:
        def boom(*a, **k):
            raise RuntimeError("injected")
        monkeypatch.setattr(flow, "write_cache_indices", boom)
        err = RuntimeError
    with pytest.raises(err):
        env.extend(reqs)
    env.same(snap)
    assert all(r.req_pool_idx is None and r.last_node is None for r in reqs)


@pytest.mark.parametrize("ps", [1, 4])
def test_decode_failure_changes_nothing(ps):
    rng = np.random.default_rng(8)
    env = Env(ps, slots=32)
    reqs = [Req(i, rng.integers(0, 99, 16).astype(np.int32)) for i in range(2)]
    b = env.extend(reqs)
    for r in reqs:
        r.append_output(1)
    snap = env.snapshot()
    with pytest.raises(CapacityError):
        alloc_for_decode(b)
    env.same(snap)
    assert [r.kv_committed_len for r in reqs] == [16, 16]
    with pytest.raises(InvalidArgumentError):  # two uncommitted tokens
        reqs[0].append_output(2)
        alloc_for_decode(b)
    env.same(snap)


def test_release_and_input_errors():
    env = Env(1, slots=64)
    r = Req("r", np.arange(5, dtype=np.int32))
    with pytest.raises(InvalidArgumentError):
        release_kv_cache(r, env.tree)
    with pytest.raises(InvalidArgumentError):
        alloc_for_decode(env.batch([r]))
    env.extend([r])
    env.release(r)
    with pytest.raises(InvalidArgumentError):  # released twice
        release_kv_cache(r, env.tree)
    with pytest.raises(InvalidArgumentError):
        Batch([r, r], env.pool, env.alloc, env.tree)
    env.check()


@pytest.mark.parametrize("ps", [1, 4])
def test_mixed_batch_of_new_and_continuing_requests(ps):
    rng = np.random.default_rng(21)
    env = Env(ps, slots=256)
    assert alloc_for_extend(env.batch([])).numel() == 0
    long = Req("long", rng.integers(0, 99, 90).astype(np.int32))
    env.extend([long], fill_lens=[30])
    env.tree.cache_unfinished_req(long)
    fresh = Req("fresh", np.concatenate([long.fill_ids[:30], rng.integers(0, 99, 7)]).astype(np.int32))
    b = env.extend([long, fresh], fill_lens=[61, fresh.seq_len])  # one chunk + one new request
    assert b.prefix_lens.tolist() == [30, 28 if ps == 4 else 30]
    assert b.extend_lens.tolist() == [31, fresh.seq_len - b.prefix_lens[1].item()]
    assert len(b.out_cache_loc) == b.extend_num_tokens
    env.tree.cache_unfinished_req(long)
    b = env.extend([long])
    for _ in range(5):
        env.decode(env.batch([long, fresh]), rng)
    env.release(fresh)
    env.release(long)
