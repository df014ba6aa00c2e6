"""The reference hybrid model: incremental runs through the cache interface (extend, chunked
extend, decode, batched decode, forks that share a prefix) must reproduce forward_reference
(fp64 within 1e-9, fp32 within 1e-5 max abs on logits of O(1) scale).

The pools here are minimal in-test stand-ins with exactly the real pools' API
(``get_kv_buffer`` / ``set_kv_buffer`` keyed by global layer id, ``mamba2_layer_cache`` returning
``.conv[0]`` / ``.temporal``); ``test_real_pools`` runs the same through ``radixkv.memory``.
"""
from collections import Counter
from typing import NamedTuple

import numpy as np
import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from radixkv.errors import InvalidArgumentError, InvalidIndexError, InvariantError, LengthMismatchError, describe_ids
from radixkv.kernels.state_copy import copy_states
from radixkv.kernels.triton_util import triton_runnable
from radixkv.reference import HybridConfig, HybridModel, ModelCache

TOL = {torch.float64: 1e-9, torch.float32: 1e-5}
DTYPES = [torch.float64, torch.float32]


class LayerCache(NamedTuple):
    conv: list
    temporal: torch.Tensor


class StandInKVPool:
    """``HybridLinearKVPool``'s KV API over plain tensors (global layer ids)."""

    def __init__(self, cfg, rows, device):
        self.map = {g: i for i, g in enumerate(cfg.full_layer_ids)}
        self.k = torch.zeros(len(self.map), rows, cfg.num_heads, cfg.head_dim, dtype=cfg.dtype, device=device)
        self.v = torch.zeros_like(self.k)

    def get_kv_buffer(self, layer_id):
        return self.k[self.map[layer_id]], self.v[self.map[layer_id]]

    def set_kv_buffer(self, layer_id, loc, k, v):
        self.k[self.map[layer_id]][loc] = k.to(self.k.dtype)
        self.v[self.map[layer_id]][loc] = v.to(self.v.dtype)


class StandInMambaPool:
    """``MambaPool``'s state tensors ``[layers, slots+1, ...]`` and ``mamba2_layer_cache``."""

    def __init__(self, cfg, slots, device, local_ids=False):
        self.map = {(i if local_ids else g): i for i, g in enumerate(cfg.kda_layer_ids)}
        n = len(cfg.kda_layer_ids)
        self.conv = torch.zeros(n, slots + 1, *cfg.conv_state_shape, dtype=cfg.dtype, device=device)
        self.temporal = torch.zeros(n, slots + 1, *cfg.temporal_state_shape, dtype=cfg.dtype, device=device)

    def mamba2_layer_cache(self, layer_id):
        i = self.map[layer_id]
        return LayerCache([self.conv[i]], self.temporal[i])


class Seq(NamedTuple):
    row: int
    slot: int
    tokens: list[int]
    kv_rows: list[int]


class Harness:
    """Stand-in pools + a bookkeeping of live sequences (KV rows shared by forks are
    reference counted). ``check_invariants`` checks the bookkeeping against the tables."""

    def __init__(self, model, rows=400, slots=8, reqs=8, max_ctx=128):
        cfg, dev = model.config, model.device
        self.model, self.rng = model, np.random.default_rng(0)
        self.kv, self.mamba = StandInKVPool(cfg, rows, dev), StandInMambaPool(cfg, slots, dev)
        self.table = torch.zeros(reqs + 1, max_ctx, dtype=torch.int32, device=dev)
        self.pools = ModelCache(self.kv, self.mamba.mamba2_layer_cache, self.table)
        self.free_rows = list(range(1, rows))
        self.free_slots = list(range(1, slots + 1))
        self.free_reqs = list(range(1, reqs + 1))
        self.refs, self.seqs = Counter(), {}

    def new(self, name):
        self.seqs[name] = Seq(self.free_reqs.pop(0), self.free_slots.pop(0), [], [])

    def fork(self, src, name):
        """A new sequence continuing ``src``'s prefix: a COPY of its state, its KV rows reused."""
        s = self.seqs[src]
        row, slot = self.free_reqs.pop(0), self.free_slots.pop(0)
        copy_states(self.mamba.conv, self.mamba.temporal, torch.tensor([s.slot]), torch.tensor([slot]))
        self.table[row, : len(s.kv_rows)] = torch.tensor(s.kv_rows, dtype=torch.int32)
        self.refs.update(s.kv_rows)
        self.seqs[name] = Seq(row, slot, list(s.tokens), list(s.kv_rows))

    def finish(self, name):
        s = self.seqs.pop(name)
        self.refs.subtract(s.kv_rows)
        self.free_rows += [r for r in set(s.kv_rows) if self.refs[r] == 0]
        self.free_reqs.append(s.row)
        self.free_slots.append(s.slot)

    def _take(self, n):
        rows, self.free_rows = self.free_rows[:n], self.free_rows[n:]
        self.refs.update(rows)
        return rows

    def extend(self, name, tokens):
        s = self.seqs[name]
        start, rows = len(s.tokens), self._take(len(tokens))
        logits = self.model.extend(np.asarray(tokens, dtype=np.int32), start,
                                   torch.tensor(s.kv_rows, dtype=torch.int64),
                                   torch.tensor(rows), s.slot, self.pools)
        self.table[s.row, start:start + len(rows)] = torch.tensor(rows, dtype=torch.int32)
        s.tokens.extend(tokens)
        s.kv_rows.extend(rows)
        return logits

    def decode(self, names, tokens):
        seqs = [self.seqs[n] for n in names]
        rows = self._take(len(seqs))
        for s, r, t in zip(seqs, rows, tokens):  # the scheduler's job: record the new row first
            self.table[s.row, len(s.tokens)] = r
            s.tokens.append(t)
            s.kv_rows.append(r)
        return self.model.decode(torch.tensor(tokens), torch.tensor([s.row for s in seqs]),
                                 torch.tensor([len(s.tokens) for s in seqs]),
                                 torch.tensor(rows), torch.tensor([s.slot for s in seqs]), self.pools)

    def reference(self, name, last):
        """forward_reference logits of the last ``last`` tokens of ``name``."""
        return self.model.forward_reference(self.seqs[name].tokens)[-last:]

    def check_invariants(self):
        held = Counter(r for s in self.seqs.values() for r in s.kv_rows)
        if held != +self.refs:
            raise InvariantError(f"row refcounts drift: {describe_ids(set(held) ^ set(+self.refs))}")
        leaked = set(held) & set(self.free_rows)
        if leaked:
            raise InvariantError(f"rows both held and free: {describe_ids(leaked)}")
        slots = [s.slot for s in self.seqs.values()] + self.free_slots
        if len(set(slots)) != len(slots):
            raise InvariantError(f"duplicated slots: {describe_ids(k for k, c in Counter(slots).items() if c > 1)}")
        for name, s in self.seqs.items():
            if self.table[s.row, : len(s.kv_rows)].tolist() != s.kv_rows:
                raise InvariantError(f"req_to_token row {s.row} of {name!r} differs from its KV rows")

    def snapshot(self):
        return [t.clone() for t in (self.kv.k, self.kv.v, self.mamba.conv, self.mamba.temporal, self.table)]


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny tensors gain nothing from intra-op threads, and on a busy machine the thread pool
    makes each op milliseconds slower; restored after this module."""
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(prev)


def _tokens(n, vocab, seed):
    return np.random.default_rng(seed).integers(0, vocab, n).astype(np.int32).tolist()


def _diff(a, b):
    return (a - b).abs().max().item()


@pytest.fixture(params=DTYPES, ids=["fp64", "fp32"])
def model(request, device):
    return HybridModel(HybridConfig(vocab=97, hidden=32, num_heads=2, head_dim=16, dtype=request.param, seed=1), device)


def test_config_validation():
    cfg = HybridConfig(layer_pattern="KKFKF")
    assert cfg.kda_layer_ids == (0, 1, 3) and cfg.full_layer_ids == (2, 4) and cfg.num_layers == 5
    assert cfg.conv_state_shape == (3, 96) and cfg.temporal_state_shape == (2, 16, 16)
    for bad in (dict(layer_pattern="KXF"), dict(layer_pattern=""), dict(conv_kernel=1), dict(head_dim=7),
                dict(dtype=torch.float16), dict(hidden=0), dict(vocab=2.5)):
        with pytest.raises(InvalidArgumentError):
            HybridConfig(**bad)


def test_reference_scale_and_determinism():
    toks = _tokens(30, 97, 0)
    m64 = HybridModel(HybridConfig(vocab=97, seed=3))
    logits = m64.forward_reference(toks)
    assert logits.shape == (30, 97) and 0.3 < logits.std().item() < 3.0 and logits.abs().max().item() < 20
    assert torch.equal(logits, HybridModel(HybridConfig(vocab=97, seed=3)).forward_reference(toks))
    assert _diff(logits, HybridModel(HybridConfig(vocab=97, seed=4)).forward_reference(toks)) > 0.1
    m32 = HybridModel(HybridConfig(vocab=97, seed=3, dtype=torch.float32))  # same weights, rounded
    assert _diff(m32.forward_reference(toks).double(), logits) < 1e-4
    # causality: appending tokens does not change earlier logits
    assert _diff(m64.forward_reference(toks + [5, 6])[:30], logits) < 1e-12


def test_extend_whole_prompt(model):
    h = Harness(model)
    h.new("a")
    h.mamba.temporal.fill_(7.0)  # a reused slot full of garbage: start_pos 0 must ignore it
    h.mamba.conv.fill_(-3.0)
    toks = _tokens(45, 97, 1)
    assert _diff(h.extend("a", toks), h.reference("a", 45)) <= TOL[model.config.dtype]
    h.check_invariants()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_extend_in_random_chunks_then_decode(model, seed):
    rng = np.random.default_rng(seed)
    h = Harness(model)
    h.new("a")
    toks = _tokens(50, 97, seed + 10)
    pos, got = 0, []
    while pos < 40:
        n = int(rng.integers(1, 18))
        got.append(h.extend("a", toks[pos:pos + n]))
        pos += len(toks[pos:pos + n])
        h.check_invariants()
    for t in toks[pos:]:
        got.append(h.decode(["a"], [t]))
        h.check_invariants()
    assert _diff(torch.cat(got), model.forward_reference(toks)) <= TOL[model.config.dtype]


def test_shared_prefix_fork_and_batched_decode(model):
    tol, h = TOL[model.config.dtype], Harness(model)
    h.new("a")
    h.extend("a", _tokens(21, 97, 2))  # the shared prefix
    h.fork("a", "b")  # b starts from a COPY of a's state and a's 21 KV rows
    assert _diff(h.extend("a", _tokens(9, 97, 3)), h.reference("a", 9)) <= tol
    assert _diff(h.extend("b", _tokens(5, 97, 4)), h.reference("b", 5)) <= tol
    h.new("c")
    assert _diff(h.extend("c", _tokens(3, 97, 5)), h.reference("c", 3)) <= tol
    for step in range(6):  # three requests of different lengths decoded together
        names = ["a", "b", "c"] if step % 2 == 0 else ["c", "a"]
        out = h.decode(names, _tokens(len(names), 97, 100 + step))
        for i, n in enumerate(names):
            assert _diff(out[i], h.reference(n, 1)[0]) <= tol, (step, n)
        h.check_invariants()
    assert h.seqs["b"].kv_rows[:21] == h.seqs["a"].kv_rows[:21]


@pytest.mark.skipif(not triton_runnable("cpu"), reason="needs the Triton interpreter")
def test_decode_through_triton_kernels():
    cfg = HybridConfig(vocab=50, hidden=16, num_heads=2, head_dim=8, layer_pattern="KFK", dtype=torch.float64)
    h = Harness(HybridModel(cfg, backend="triton"))
    h.new("a")
    h.new("b")
    h.extend("a", _tokens(7, 50, 1))
    h.extend("b", _tokens(4, 50, 2))
    for step in range(3):
        out = h.decode(["a", "b"], _tokens(2, 50, step))
        assert _diff(out, torch.stack([h.reference("a", 1)[0], h.reference("b", 1)[0]])) <= 1e-9


def test_local_layer_ids():
    cfg = HybridConfig(vocab=50, hidden=16, num_heads=2, head_dim=8, layer_pattern="FKKF")
    model = HybridModel(cfg)
    kv = StandInKVPool(cfg, 64, "cpu")
    kv.map = {i: i for i in range(len(cfg.full_layer_ids))}
    mamba = StandInMambaPool(cfg, 2, "cpu", local_ids=True)
    pools = ModelCache(kv, mamba.mamba2_layer_cache, kv_layer_ids="local", mamba_layer_ids="local")
    toks = _tokens(12, 50, 0)
    out = model.extend(toks, 0, torch.zeros(0, dtype=torch.int64), torch.arange(1, 13), 1, pools)
    assert _diff(out, model.forward_reference(toks)) <= 1e-9
    with pytest.raises(KeyError):  # global ids do not exist in a local-id pool
        model.extend(toks, 0, torch.zeros(0, dtype=torch.int64), torch.arange(1, 13), 1,
                     ModelCache(kv, mamba.mamba2_layer_cache))


def test_bad_inputs_leave_pools_unchanged():
    model = HybridModel(HybridConfig(vocab=50, hidden=16, num_heads=2, head_dim=8, layer_pattern="KF"))
    h = Harness(model, rows=40, slots=3, reqs=3, max_ctx=32)
    h.new("a")
    h.extend("a", _tokens(5, 50, 0))
    s = h.seqs["a"]
    before = h.snapshot()
    prefix, e = torch.tensor(s.kv_rows), torch.zeros(0, dtype=torch.int64)
    extend_cases = [
        (([1, 2], 5, prefix, torch.tensor([30]), s.slot), LengthMismatchError),  # 2 tokens, 1 row
        (([1], 4, prefix, torch.tensor([30]), s.slot), LengthMismatchError),  # prefix rows != start_pos
        (([1], 5, prefix, torch.tensor([40]), s.slot), InvalidIndexError),  # row past the buffer
        (([1], 5, prefix, torch.tensor([0]), s.slot), InvalidIndexError),  # padding row
        (([1, 2], 5, prefix, torch.tensor([30, 30]), s.slot), InvalidArgumentError),  # row twice
        (([1], 5, prefix, prefix[:1], s.slot), InvalidArgumentError),  # overwrites the prefix
        (([1], 5, prefix, torch.tensor([30]), 4), InvalidIndexError),  # slot out of range
        (([1], 5, prefix, torch.tensor([30]), 0), InvalidIndexError),  # padding slot
        (([50], 5, prefix, torch.tensor([30]), s.slot), InvalidIndexError),  # token >= vocab
        (([1.5], 5, prefix, torch.tensor([30]), s.slot), InvalidArgumentError),  # not a token id
        (([], 5, prefix, e, s.slot), InvalidArgumentError),  # nothing to extend
        (([1], -1, e, torch.tensor([30]), s.slot), InvalidArgumentError),
        (([1], 5, prefix.float(), torch.tensor([30]), s.slot), InvalidArgumentError),
    ]
    for args, err in extend_cases:
        with pytest.raises(err):
            model.extend(*args, h.pools)
        assert all(torch.equal(a, b) for a, b in zip(before, h.snapshot())), args
    h.table[s.row, 5] = 30  # the scheduler recorded row 30 for the next token
    before = h.snapshot()
    t = torch.tensor
    decode_cases = [
        ((t([1, 2]), t([s.row]), t([6]), t([30]), t([s.slot])), LengthMismatchError),
        ((t([1]), t([s.row]), t([6]), t([31]), t([s.slot])), InvalidArgumentError),  # not what the table says
        ((t([1]), t([s.row]), t([1]), t([30]), t([s.slot])), InvalidArgumentError),  # nothing to continue
        ((t([1]), t([s.row]), t([33]), t([30]), t([s.slot])), InvalidArgumentError),  # past max_ctx
        ((t([1]), t([0]), t([6]), t([30]), t([s.slot])), InvalidIndexError),  # padding request row
        ((t([1]), t([s.row]), t([6]), t([30]), t([0])), InvalidIndexError),  # padding slot
        ((t([1, 1]), t([s.row, s.row]), t([6, 6]), t([30, 30]), t([1, 2])), InvalidArgumentError),  # repeats
        ((t([1]), t([s.row]), t([7]), t([0]), t([s.slot])), InvalidIndexError),  # row 0 in the table
    ]
    for args, err in decode_cases:
        with pytest.raises(err):
            model.decode(*args, h.pools)
        assert all(torch.equal(a, b) for a, b in zip(before, h.snapshot())), args
    with pytest.raises(InvalidArgumentError):
        model.decode(*decode_cases[1][0], ModelCache(h.kv, h.mamba.mamba2_layer_cache))  # no req_to_token
    wrong = StandInMambaPool(HybridConfig(vocab=50, hidden=16, num_heads=2, head_dim=8, layer_pattern="KF",
                                          conv_kernel=3), 3, "cpu")
    with pytest.raises(InvalidArgumentError):
        model.extend([1], 5, prefix, t([30]), s.slot, ModelCache(h.kv, wrong.mamba2_layer_cache))
    assert all(torch.equal(a, b) for a, b in zip(before, h.snapshot()))


def test_real_pools():
    """The same run backed by radixkv.memory's pools and the KV allocator."""
    memory = pytest.importorskip("radixkv.memory")
    allocator_mod = pytest.importorskip("radixkv.allocator")
    from radixkv.scheduler.req import Req

    cfg = HybridConfig(vocab=50, hidden=16, num_heads=2, head_dim=8, layer_pattern="KKFKF")
    model = HybridModel(cfg)
    kv = memory.MHATokenToKVPool(64, 1, cfg.dtype, cfg.num_heads, cfg.head_dim, len(cfg.full_layer_ids), "cpu")
    mamba = memory.MambaPool(4, cfg.conv_state_shape, cfg.temporal_state_shape, len(cfg.kda_layer_ids), cfg.dtype,
                             "cpu")
    hybrid_kv = memory.HybridLinearKVPool(kv, list(cfg.full_layer_ids), mamba)
    req_pool = memory.HybridReqToTokenPool(4, 32, mamba_pool=mamba)
    alloc = allocator_mod.TokenToKVPoolAllocator(64)
    pools = ModelCache(hybrid_kv, hybrid_kv.mamba2_layer_cache, req_pool.req_to_token)
    toks = _tokens(14, 50, 9)
    a = Req(rid="a", origin_input_ids=toks[:10])
    assert req_pool.alloc([a]) is not None
    rows = alloc.alloc(10)
    req_pool.write((a.req_pool_idx, slice(0, 10)), rows)
    out = [model.extend(toks[:10], 0, rows[:0], rows, a.mamba_pool_idx, pools)]
    b = Req(rid="b", origin_input_ids=toks[:10])  # a fork of a: a copy of its state, its 10 KV rows
    assert req_pool.alloc([b]) is not None
    mamba.copy_from(torch.tensor([a.mamba_pool_idx]), torch.tensor([b.mamba_pool_idx]))
    req_pool.write((b.req_pool_idx, slice(0, 10)), rows)
    for step, t in enumerate(toks[10:]):
        new = alloc.alloc(2)
        seq_len = 11 + step
        req_pool.write((torch.tensor([a.req_pool_idx, b.req_pool_idx]), torch.tensor([seq_len - 1] * 2)), new)
        logits = model.decode(torch.tensor([t, (t + 1) % 50]), torch.tensor([a.req_pool_idx, b.req_pool_idx]),
                              torch.tensor([seq_len] * 2), new,
                              torch.tensor([a.mamba_pool_idx, b.mamba_pool_idx]), pools)
        out.append(logits[:1])
        ref_b = model.forward_reference(toks[:10] + [(x + 1) % 50 for x in toks[10:seq_len]])[-1]
        assert _diff(logits[1], ref_b) <= 1e-9
        for p in (kv, mamba, req_pool, alloc):
            p.check_invariants()
    assert _diff(torch.cat(out), model.forward_reference(toks)) <= 1e-9


class ForkingRequests(RuleBasedStateMachine):
    """Requests arrive, extend in chunks, decode in batches, fork (state copy + shared KV rows)
    and finish, in random order; every logit produced must equal forward_reference's."""

    cfg = HybridConfig(vocab=40, hidden=16, num_heads=2, head_dim=8, layer_pattern="KFKK", dtype=torch.float64,
                       chunk_size=4)
    model = HybridModel(cfg)

    @initialize()
    def setup(self):
        self.h, self.count = Harness(self.model, rows=300, slots=6, reqs=6, max_ctx=64), 0

    def _names(self, pred=lambda s: True):
        return sorted(n for n, s in self.h.seqs.items() if pred(s))

    @precondition(lambda self: self.h.free_slots)
    @rule(n=st.integers(1, 12), seed=st.integers(0, 99))
    def arrive(self, n, seed):
        name, self.count = f"r{self.count}", self.count + 1
        self.h.new(name)
        assert _diff(self.h.extend(name, _tokens(n, 40, seed)), self.h.reference(name, n)) <= 1e-9

    @precondition(lambda self: any(len(s.tokens) < 50 for s in self.h.seqs.values()))
    @rule(data=st.data(), n=st.integers(1, 9), seed=st.integers(0, 99))
    def extend(self, data, n, seed):
        name = data.draw(st.sampled_from(self._names(lambda s: 0 < len(s.tokens) < 50)))
        assert _diff(self.h.extend(name, _tokens(n, 40, seed)), self.h.reference(name, n)) <= 1e-9

    @precondition(lambda self: any(0 < len(s.tokens) < 60 for s in self.h.seqs.values()))
    @rule(data=st.data(), seed=st.integers(0, 99))
    def decode(self, data, seed):
        names = data.draw(st.lists(st.sampled_from(self._names(lambda s: 0 < len(s.tokens) < 60)), min_size=1,
                                   unique=True))
        out = self.h.decode(names, _tokens(len(names), 40, seed))
        expect = torch.stack([self.h.reference(n, 1)[0] for n in names])
        assert _diff(out, expect) <= 1e-9

    @precondition(lambda self: self.h.seqs and self.h.free_slots)
    @rule(data=st.data())
    def fork(self, data):
        src = data.draw(st.sampled_from(self._names()))
        name, self.count = f"r{self.count}", self.count + 1
        self.h.fork(src, name)

    @precondition(lambda self: self.h.seqs)
    @rule(data=st.data())
    def finish(self, data):
        self.h.finish(data.draw(st.sampled_from(self._names())))

    @invariant()
    def consistent(self):
        self.h.check_invariants()


TestForkingRequests = ForkingRequests.TestCase
TestForkingRequests.settings = settings(max_examples=30, stateful_step_count=15, deadline=None)
