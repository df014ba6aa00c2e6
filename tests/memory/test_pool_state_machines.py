"""Hypothesis state machines: ReqToTokenPool, MambaPool and HybridReqToTokenPool against plain
Python / numpy models, with ``check_invariants()`` after every step."""
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from radixkv.errors import (
    DoubleFreeError,
    InvalidArgumentError,
    InvalidIndexError,
    LengthMismatchError,
)
from radixkv.memory import HybridReqToTokenPool, MambaPool, ReqToTokenPool
from radixkv.scheduler.req import Req

MACHINE_SETTINGS = settings(max_examples=40, stateful_step_count=25, deadline=None,
                            suppress_health_check=[HealthCheck.too_slow])


def new_req(counter):
    return Req(f"r{counter}", np.arange(2, dtype=np.int32))


# -- ReqToTokenPool ----------------------------------------------------------------------
class ReqToTokenMachine(RuleBasedStateMachine):
    SIZE, CTX = 5, 6

    def __init__(self):
        super().__init__()
        self.pool = ReqToTokenPool(self.SIZE, self.CTX)
        self.live = []  # requests holding a row
        self.table = np.zeros((self.SIZE + 1, self.CTX), dtype=np.int32)  # the model table
        self.counter = 0

    def fresh(self, n):
        out = []
        for _ in range(n):
            self.counter += 1
            out.append(new_req(self.counter))
        return out

    @rule(n_new=st.integers(0, 3), data=st.data())
    def alloc(self, n_new, data):
        held = data.draw(st.lists(st.sampled_from(self.live), unique_by=id, max_size=3)) if self.live else []
        new = self.fresh(n_new)
        order = data.draw(st.permutations(held + new))
        held_rows = [r.req_pool_idx for r in held]
        free_before = self.pool.available_size()
        res = self.pool.alloc(order)
        assert [r.req_pool_idx for r in held] == held_rows
        if n_new > free_before:
            assert res is None and all(r.req_pool_idx is None for r in new)
            return
        assert res == [r.req_pool_idx for r in order]
        taken = {r.req_pool_idx for r in self.live}
        new_rows = [r.req_pool_idx for r in new]
        assert len(set(new_rows)) == n_new and not taken & set(new_rows)
        assert all(1 <= x <= self.SIZE for x in new_rows)
        self.live += new

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free(self, data):
        r = data.draw(st.sampled_from(self.live))
        self.pool.free(r)
        assert r.req_pool_idx is None
        self.live.remove(r)

    def snap(self):
        return (self.pool.available_size(), self.pool.arena.buffer.clone(),
                [r.req_pool_idx for r in self.live])

    @rule(data=st.data())
    def bad_free(self, data):
        before = self.snap()
        held = {r.req_pool_idx for r in self.live}
        free_rows = [x for x in range(1, self.SIZE + 1) if x not in held]
        choices = [("none", None), ("oob", data.draw(st.sampled_from([0, self.SIZE + 1, -3])))]
        if free_rows:
            choices.append(("double", data.draw(st.sampled_from(free_rows))))
        kind, row = data.draw(st.sampled_from(choices))
        ghost = Req("ghost", np.arange(1, dtype=np.int32), req_pool_idx=row)
        error = {"none": InvalidArgumentError, "oob": InvalidIndexError, "double": DoubleFreeError}[kind]
        with pytest.raises(error):
            self.pool.free(ghost)
        after = self.snap()
        assert after[0] == before[0] and torch.equal(after[1], before[1]) and after[2] == before[2]

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def write_span(self, data):
        r = data.draw(st.sampled_from(self.live))
        start = data.draw(st.integers(0, self.CTX))
        end = data.draw(st.integers(start, self.CTX))
        vals = np.asarray(data.draw(st.lists(st.integers(0, 2**31 - 1), min_size=end - start,
                                             max_size=end - start)), dtype=np.int64)
        self.pool.write((r.req_pool_idx, slice(start, end)), torch.from_numpy(vals))
        self.table[r.req_pool_idx, start:end] = vals

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def write_decode(self, data):
        rs = data.draw(st.lists(st.sampled_from(self.live), unique_by=id, min_size=1))
        cols = data.draw(st.lists(st.integers(0, self.CTX - 1), min_size=len(rs), max_size=len(rs)))
        vals = data.draw(st.lists(st.integers(0, 1000), min_size=len(rs), max_size=len(rs)))
        rows = [r.req_pool_idx for r in rs]
        self.pool.write((torch.tensor(rows), torch.tensor(cols)), torch.tensor(vals, dtype=torch.int32))
        self.table[rows, cols] = vals

    @rule(row=st.integers(-2, 8), col=st.integers(-2, 8))
    def write_maybe_out_of_range(self, row, col):
        ok = 0 <= row <= self.SIZE and 0 <= col < self.CTX
        before = self.snap()
        if ok:
            self.pool.write((row, col), 5)
            self.table[row, col] = 5
        else:
            with pytest.raises(InvalidIndexError):
                self.pool.write((row, col), 5)
            after = self.snap()
            assert torch.equal(after[1], before[1])

    @rule()
    def clear(self):
        self.pool.clear()
        for r in self.live:
            r.req_pool_idx = None
        self.live = []

    @invariant()
    def consistent(self):
        self.pool.check_invariants(self.live)
        assert self.pool.available_size() == self.SIZE - len(self.live)
        assert np.array_equal(self.pool.req_to_token.numpy(), self.table)


# -- MambaPool ---------------------------------------------------------------------------
class MambaPoolMachine(RuleBasedStateMachine):
    SIZE, LAYERS, CONV, TEMP = 5, 2, (2, 3), (2, 2, 2)

    def __init__(self):
        super().__init__()
        self.pool = MambaPool(self.SIZE, self.CONV, self.TEMP, self.LAYERS, torch.float32)
        self.model = {}  # slot -> (conv [L, *CONV], temporal [L, *TEMP]) numpy

    def zero_state(self):
        return (np.zeros((self.LAYERS,) + self.CONV, np.float32),
                np.zeros((self.LAYERS,) + self.TEMP, np.float32))

    def snap(self):
        return self.pool.available_size(), self.pool.arena.buffer.clone()

    def assert_same(self, before):
        after = self.snap()
        assert after[0] == before[0] and torch.equal(after[1], before[1])

    @rule(n=st.integers(0, 3))
    def alloc(self, n):
        free_before = self.SIZE - len(self.model)
        ids = self.pool.alloc(n)
        if n > free_before:
            assert ids is None
            return
        ids = ids.tolist()
        assert len(set(ids)) == n and not set(ids) & set(self.model)
        assert all(1 <= i <= self.SIZE for i in ids)
        for i in ids:
            self.model[i] = self.zero_state()

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def free(self, data):
        ids = data.draw(st.lists(st.sampled_from(sorted(self.model)), unique=True, min_size=1))
        self.pool.free(torch.tensor(ids))
        for i in ids:
            del self.model[i]

    @rule(data=st.data())
    def bad_free(self, data):
        free = [i for i in range(1, self.SIZE + 1) if i not in self.model]
        options = [([0], InvalidIndexError), ([self.SIZE + 1], InvalidIndexError)]
        if free:
            options.append(([data.draw(st.sampled_from(free))], DoubleFreeError))
        if self.model:
            i = data.draw(st.sampled_from(sorted(self.model)))
            options.append(([i, i], DoubleFreeError))
        ids, error = data.draw(st.sampled_from(options))
        before = self.snap()
        with pytest.raises(error):
            self.pool.free(torch.tensor(ids))
        self.assert_same(before)

    @precondition(lambda self: self.model)
    @rule(data=st.data(), seed=st.integers(0, 2**16))
    def write(self, data, seed):
        i = data.draw(st.sampled_from(sorted(self.model)))
        g = torch.Generator().manual_seed(seed)
        conv = torch.randn((self.LAYERS,) + self.CONV, generator=g)
        temp = torch.randn((self.LAYERS,) + self.TEMP, generator=g)
        layer = data.draw(st.integers(0, self.LAYERS - 1))
        cache = self.pool.mamba2_layer_cache(layer)  # write one layer through the layer view
        cache.conv[0][i] = conv[layer]
        cache.temporal[i] = temp[layer]
        c, t = self.model[i]
        c[layer], t[layer] = conv[layer].numpy(), temp[layer].numpy()

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def copy_from(self, data):
        keys = sorted(self.model)
        dst = data.draw(st.lists(st.sampled_from(keys), unique=True, min_size=1))
        src = data.draw(st.lists(st.sampled_from(keys), min_size=len(dst), max_size=len(dst)))
        self.pool.copy_from(torch.tensor(src), torch.tensor(dst))
        gathered = [tuple(a.copy() for a in self.model[s]) for s in src]
        for d, state in zip(dst, gathered):
            self.model[d] = state

    @rule(data=st.data())
    def bad_copy(self, data):
        keys = sorted(self.model)
        free = [i for i in range(1, self.SIZE + 1) if i not in self.model]
        options = [([0], keys[:1] or [1], InvalidIndexError)]
        if free and keys:
            f = data.draw(st.sampled_from(free))
            options += [([f], keys[:1], InvalidArgumentError), (keys[:1], [f], InvalidArgumentError)]
        if len(keys) >= 2:
            options.append((keys[:2], keys[:1], LengthMismatchError))
        src, dst, error = data.draw(st.sampled_from(options))
        before = self.snap()
        with pytest.raises(error):
            self.pool.copy_from(src, dst)
        self.assert_same(before)

    @invariant()
    def consistent(self):
        self.pool.check_invariants()
        assert self.pool.available_size() == self.SIZE - len(self.model)
        for i, (c, t) in self.model.items():
            assert np.array_equal(self.pool.conv_state[:, i].numpy(), c), i
            assert np.array_equal(self.pool.temporal_state[:, i].numpy(), t), i


# -- HybridReqToTokenPool ----------------------------------------------------------------
class HybridMachine(RuleBasedStateMachine):
    SIZE, MAMBA = 4, 3

    def __init__(self):
        super().__init__()
        self.pool = HybridReqToTokenPool(self.SIZE, 4, mamba_size=self.MAMBA, conv_state_shape=(1, 2),
                                         temporal_state_shape=(1, 2, 2), num_mamba_layers=2)
        self.live = []  # row + slot
        self.detached = []  # slot, no row (freed with free_mamba_cache=False)
        self.tag = {}  # rid -> the value its slot's state was written with
        self.counter = 0

    def all_reqs(self):
        return self.live + self.detached

    @rule(n_new=st.integers(0, 3), data=st.data())
    def alloc(self, n_new, data):
        held = data.draw(st.lists(st.sampled_from(self.live), unique_by=id, max_size=2)) if self.live else []
        back = data.draw(st.lists(st.sampled_from(self.detached), unique_by=id, max_size=2)) \
            if self.detached else []
        new = []
        for _ in range(n_new):
            self.counter += 1
            new.append(new_req(self.counter))
        order = data.draw(st.permutations(held + back + new))
        before = {id(r): (r.req_pool_idx, r.mamba_pool_idx) for r in order}
        rows_free, slots_free = self.pool.available_size(), self.pool.mamba_pool.available_size()
        res = self.pool.alloc(order)
        if len(new) + len(back) > rows_free or len(new) > slots_free:
            assert res is None
            assert all((r.req_pool_idx, r.mamba_pool_idx) == before[id(r)] for r in order)
            return
        assert res == [r.req_pool_idx for r in order]
        for r in held:
            assert (r.req_pool_idx, r.mamba_pool_idx) == before[id(r)]
        for r in back:
            assert r.mamba_pool_idx == before[id(r)][1] and r.req_pool_idx is not None
            self.detached.remove(r)
        for r in new:
            slot = r.mamba_pool_idx
            assert int(self.pool.mamba_pool.temporal_state[:, slot].count_nonzero()) == 0  # zeroed
            self.pool.mamba_pool.temporal_state[:, slot] = float(self.counter)
            self.tag[r.rid] = float(self.counter)
        self.live += back + new

    @precondition(lambda self: self.live)
    @rule(data=st.data(), keep_slot=st.booleans())
    def free(self, data, keep_slot):
        r = data.draw(st.sampled_from(self.live))
        slot = r.mamba_pool_idx
        self.pool.free(r, free_mamba_cache=not keep_slot)
        self.live.remove(r)
        assert r.req_pool_idx is None
        if keep_slot:
            assert r.mamba_pool_idx == slot
            self.detached.append(r)
        else:
            assert r.mamba_pool_idx is None
            del self.tag[r.rid]

    @precondition(lambda self: self.detached)
    @rule(data=st.data())
    def release_detached_slot(self, data):
        r = data.draw(st.sampled_from(self.detached))
        self.pool.mamba_pool.free(r.mamba_pool_idx)
        r.mamba_pool_idx = None
        self.detached.remove(r)
        del self.tag[r.rid]

    @rule()
    def bad_free(self):
        before = (self.pool.available_size(), self.pool.mamba_pool.available_size(),
                  self.pool.arena.buffer.clone())
        with pytest.raises(InvalidArgumentError):
            self.pool.free(Req("nobody", np.arange(1, dtype=np.int32)))
        for r in self.detached[:1]:  # a request without a row cannot be freed again
            with pytest.raises(InvalidArgumentError):
                self.pool.free(r)
        assert (self.pool.available_size(), self.pool.mamba_pool.available_size()) == before[:2]
        assert torch.equal(self.pool.arena.buffer, before[2])

    @invariant()
    def consistent(self):
        self.pool.check_invariants(self.all_reqs())
        assert self.pool.available_size() == self.SIZE - len(self.live)
        assert self.pool.mamba_pool.available_size() == self.MAMBA - len(self.all_reqs())
        if self.live:
            rows = torch.tensor([r.req_pool_idx for r in self.live])
            assert self.pool.get_mamba_indices(rows).tolist() == [r.mamba_pool_idx for r in self.live]
        for r in self.all_reqs():  # each slot still holds its own request's state
            assert torch.all(self.pool.mamba_pool.temporal_state[:, r.mamba_pool_idx] == self.tag[r.rid])


TestReqToTokenMachine = ReqToTokenMachine.TestCase
TestReqToTokenMachine.settings = MACHINE_SETTINGS
TestMambaPoolMachine = MambaPoolMachine.TestCase
TestMambaPoolMachine.settings = MACHINE_SETTINGS
TestHybridMachine = HybridMachine.TestCase
TestHybridMachine.settings = MACHINE_SETTINGS
