"""HybridReqToTokenPool (rows + Mamba slots, all or nothing) and HybridLinearKVPool (layer
routing)."""
import numpy as np
import pytest
import torch

from radixkv.errors import DoubleFreeError, InvalidArgumentError, InvalidIndexError, InvariantError
from radixkv.memory import (
    HybridLinearKVPool,
    HybridReqToTokenPool,
    MambaPool,
    MHATokenToKVPool,
    MLATokenToKVPool,
)
from radixkv.scheduler.req import Req

CONV, TEMP, ML = (2, 6), (2, 3, 3), 2


def hybrid(device, size=4, mamba_size=4):
    return HybridReqToTokenPool(size, 8, mamba_size=mamba_size, conv_state_shape=CONV,
                                temporal_state_shape=TEMP, num_mamba_layers=ML, device=device)


def reqs(n, start=0):
    return [Req(f"r{start + i}", np.arange(2, dtype=np.int32)) for i in range(n)]


def snapshot(pool, rs):
    ids = torch.arange(0, pool.size + 1)
    mids = torch.arange(0, pool.mamba_pool.size + 1, device=pool.mamba_pool.device)
    return (pool.available_size(), pool.mamba_pool.available_size(),
            pool.free_slots.is_free(ids).clone(), pool.mamba_pool.free_slots.is_free(mids).clone(),
            pool.arena.buffer.clone(), pool.mamba_pool.arena.buffer.clone(),
            [(r.req_pool_idx, r.mamba_pool_idx) for r in rs])


def assert_unchanged(pool, snap, rs):
    now = snapshot(pool, rs)
    for a, b in zip(now, snap):
        assert torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b
    pool.check_invariants()


def test_alloc_gives_rows_and_zeroed_slots(device):
    pool = hybrid(device)
    assert pool.req_index_to_mamba_index_mapping.shape == (5,)
    assert pool.req_index_to_mamba_index_mapping.dtype == torch.int32
    pool.mamba_pool.temporal_state.fill_(3.0)  # garbage in every slot
    rs = reqs(3)
    rows = pool.alloc(rs)
    assert rows == [r.req_pool_idx for r in rs]
    slots = [r.mamba_pool_idx for r in rs]
    assert len(set(slots)) == 3 and all(1 <= s <= 4 for s in slots)
    assert pool.req_index_to_mamba_index_mapping[torch.tensor(rows)].tolist() == slots
    assert pool.get_mamba_indices(torch.tensor([0] + rows, device=device)).tolist() == [0] + slots
    assert int(pool.mamba_pool.temporal_state[:, torch.tensor(slots)].count_nonzero()) == 0
    assert pool.available_size() == 1 and pool.mamba_pool.available_size() == 1
    pool.check_invariants(rs)
    # chunked prefill: the same requests keep row and slot
    assert pool.alloc(rs) == rows and [r.mamba_pool_idx for r in rs] == slots
    pool.check_invariants(rs)


def test_all_or_nothing_across_both_pools(device):
    rows_short = hybrid(device, size=2, mamba_size=4)
    slots_short = hybrid(device, size=4, mamba_size=2)
    for pool in (rows_short, slots_short):
        held = reqs(1)
        pool.alloc(held)
        new = reqs(2, start=10)
        snap = snapshot(pool, held + new)
        assert pool.alloc(held + new) is None
        assert_unchanged(pool, snap, held + new)
        assert pool.alloc(held + new[:1]) is not None
        pool.check_invariants(held + new[:1])


def test_free_frees_both_or_keeps_the_slot(device):
    pool = hybrid(device)
    a, b = reqs(2)
    pool.alloc([a, b])
    row_a, slot_a = a.req_pool_idx, a.mamba_pool_idx
    pool.free(a)
    assert a.req_pool_idx is None and a.mamba_pool_idx is None
    assert pool.available_size() == 3 and pool.mamba_pool.available_size() == 3
    assert pool.req_index_to_mamba_index_mapping[row_a].item() == 0
    assert bool(pool.mamba_pool.free_slots.is_free(torch.tensor([slot_a]))[0])
    pool.check_invariants([a, b])
    # free_mamba_cache=False: the row goes, the (allocated) slot stays with the request
    slot_b = b.mamba_pool_idx
    pool.mamba_pool.temporal_state[:, slot_b] = 7.0
    pool.free(b, free_mamba_cache=False)
    assert b.req_pool_idx is None and b.mamba_pool_idx == slot_b
    assert pool.mamba_pool.available_size() == 3
    pool.check_invariants([a, b])
    # re-alloc: a new row, the same slot, its state untouched (not zeroed)
    pool.alloc([b])
    assert b.mamba_pool_idx == slot_b
    assert pool.get_mamba_indices(b.req_pool_idx).item() == slot_b
    assert torch.all(pool.mamba_pool.temporal_state[:, slot_b] == 7.0)
    pool.check_invariants([a, b])


def test_bad_frees_unchanged(device):
    pool = hybrid(device)
    a, b = reqs(2)
    pool.alloc([a, b])
    snap = snapshot(pool, [a, b])
    with pytest.raises(InvalidArgumentError, match="no row"):
        pool.free(Req("none", np.arange(2, dtype=np.int32)))
    with pytest.raises(DoubleFreeError):
        pool.free(Req("ghost", np.arange(2, dtype=np.int32), req_pool_idx=4))
    with pytest.raises(InvalidIndexError):
        pool.free(Req("oob", np.arange(2, dtype=np.int32), req_pool_idx=5))
    liar = Req("liar", np.arange(2, dtype=np.int32), req_pool_idx=a.req_pool_idx,
               mamba_pool_idx=b.mamba_pool_idx)
    with pytest.raises(InvalidArgumentError, match="not the slot"):
        pool.free(liar)
    assert_unchanged(pool, snap, [a, b])


def test_bad_allocs_unchanged(device):
    pool = hybrid(device)
    a, b = reqs(2)
    pool.alloc([a])
    pool.alloc([b])
    pool.free(b, free_mamba_cache=False)  # b keeps slot, no row
    new = reqs(1, start=5)[0]
    snap = snapshot(pool, [a, b, new])
    R = lambda **kw: Req("x", np.arange(2, dtype=np.int32), **kw)  # noqa: E731
    cases = [
        [new, R(req_pool_idx=a.req_pool_idx)],  # a row but no slot
        [new, R(mamba_pool_idx=a.mamba_pool_idx)],  # a slot that a's row maps to
        [new, R(mamba_pool_idx=next(s for s in range(1, 5) if s not in (a.mamba_pool_idx, b.mamba_pool_idx)))],
        [b, R(mamba_pool_idx=b.mamba_pool_idx)],  # two requests, one slot
        [R(req_pool_idx=a.req_pool_idx, mamba_pool_idx=b.mamba_pool_idx)],  # not its row's slot
        [new, new],
    ]
    for case in cases:
        with pytest.raises(InvalidArgumentError):
            pool.alloc(case)
        assert_unchanged(pool, snap, [a, b, new])
    with pytest.raises(InvalidIndexError):
        pool.alloc([R(mamba_pool_idx=9)])
    assert_unchanged(pool, snap, [a, b, new])


def test_lookups_and_delegation(device):
    pool = hybrid(device)
    with pytest.raises(InvalidIndexError):
        pool.get_mamba_indices(torch.tensor([5], device=device))
    with pytest.raises(InvalidArgumentError):
        pool.get_mamba_indices(torch.tensor([1.0]))
    c = pool.mamba2_layer_cache(1)
    assert c.temporal.data_ptr() == pool.mamba_pool.temporal_state[1].data_ptr()
    assert c.conv[0].data_ptr() == pool.mamba_pool.conv_state[1].data_ptr()
    with pytest.raises(InvalidIndexError):
        pool.mamba2_layer_cache(ML)


def test_construct_from_an_existing_pool_and_clear(device):
    mp = MambaPool(3, CONV, TEMP, ML, torch.float32, device)
    pool = HybridReqToTokenPool(2, 8, mp, device=device)
    assert pool.mamba_pool is mp
    rs = reqs(2)
    pool.alloc(rs)
    pool.clear()
    assert pool.available_size() == 2 and mp.available_size() == 3
    assert int(pool.req_index_to_mamba_index_mapping.count_nonzero()) == 0
    pool.check_invariants()
    with pytest.raises(InvalidArgumentError):
        HybridReqToTokenPool(2, 8)  # neither a pool nor its arguments
    with pytest.raises(InvalidArgumentError):
        HybridReqToTokenPool(2, 8, mamba_pool="not a pool")
    with pytest.raises(InvalidArgumentError):
        HybridReqToTokenPool(2, 8, mp, device="meta")


def test_check_invariants_names_corrupted_rows_and_slots():
    pool = hybrid("cpu")
    a, b = reqs(2)
    pool.alloc([a, b])
    m = pool.req_index_to_mamba_index_mapping
    m[b.req_pool_idx] = a.mamba_pool_idx
    with pytest.raises(InvariantError, match=rf"two rows: \[{a.mamba_pool_idx}\]"):
        pool.check_invariants()
    m[b.req_pool_idx] = b.mamba_pool_idx
    pool.check_invariants()
    m[4] = 3  # a free row mapped
    with pytest.raises(InvariantError, match=r"free rows still mapped to mamba slots: \[4\]"):
        pool.check_invariants()
    m[4] = 0
    pool.mamba_pool.free(b.mamba_pool_idx)  # behind the pool's back
    with pytest.raises(InvariantError, match=rf"free mamba slots: rows \[{b.req_pool_idx}\]"):
        pool.check_invariants()


# -- HybridLinearKVPool ------------------------------------------------------------------
def kimi_like(device, mla=False):
    """12 layers: full attention at 0, 4, 8 (seed section 9), KDA everywhere else."""
    if mla:
        full = MLATokenToKVPool(16, 1, torch.float16, 8, 4, 3, device)
    else:
        full = MHATokenToKVPool(16, 1, torch.float16, 2, 4, 3, device)
    mp = MambaPool(4, CONV, TEMP, 9, torch.float32, device)
    return HybridLinearKVPool(full, [0, 4, 8], mp), full, mp


def test_layer_routing(device):
    pool, full, mp = kimi_like(device)
    assert pool.full_attention_layer_id_mapping == {0: 0, 4: 1, 8: 2}
    assert pool.linear_layer_id_mapping == {g: i for i, g in enumerate([1, 2, 3, 5, 6, 7, 9, 10, 11])}
    assert pool.get_key_buffer(4).data_ptr() == full.get_key_buffer(1).data_ptr()
    k, v = pool.get_kv_buffer(8)
    assert k.data_ptr() == full.k_buffer[2].data_ptr() and v.data_ptr() == full.v_buffer[2].data_ptr()
    assert pool.get_value_buffer(0).data_ptr() == full.v_buffer[0].data_ptr()
    loc = torch.tensor([3], device=device)
    pool.set_kv_buffer(4, loc, torch.ones(1, 2, 4, device=device), torch.full((1, 2, 4), 2.0, device=device))
    assert torch.all(full.v_buffer[1][3] == 2.0) and int(full.v_buffer[0].count_nonzero()) == 0
    assert pool.mamba2_layer_cache(5).temporal.data_ptr() == mp.temporal_state[3].data_ptr()
    assert pool.mamba2_layer_cache(11).conv[0].data_ptr() == mp.conv_state[8].data_ptr()
    assert pool.get_kv_size_bytes() == full.get_kv_size_bytes()
    assert pool.mem_usage == full.mem_usage and pool.nbytes == full.nbytes
    assert pool.layer_num == 12
    pool.check_invariants()


def test_routing_errors(device):
    pool, full, _ = kimi_like(device)
    before = full.arena.buffer.clone()
    for kda in (1, 5, 11):
        with pytest.raises(InvalidArgumentError, match="linear"):
            pool.get_kv_buffer(kda)
        with pytest.raises(InvalidArgumentError, match="linear"):
            pool.get_key_buffer(kda)
        with pytest.raises(InvalidArgumentError, match="linear"):
            pool.set_kv_buffer(kda, torch.tensor([1], device=device), torch.ones(1, 2, 4, device=device),
                               torch.ones(1, 2, 4, device=device))
    for f in (0, 4, 8):
        with pytest.raises(InvalidArgumentError, match="full attention"):
            pool.mamba2_layer_cache(f)
    for unknown in (12, -1):
        with pytest.raises(InvalidIndexError):
            pool.get_value_buffer(unknown)
        with pytest.raises(InvalidIndexError):
            pool.mamba2_layer_cache(unknown)
    with pytest.raises(InvalidArgumentError):
        pool.set_mla_kv_buffer(0, torch.tensor([1]), torch.ones(1, 1, 8), torch.ones(1, 1, 4))
    assert torch.equal(full.arena.buffer, before)


def test_mla_full_pool(device):
    pool, full, _ = kimi_like(device, mla=True)
    loc = torch.tensor([2], device=device)
    nope, rope = torch.randn(1, 1, 8, device=device), torch.randn(1, 1, 4, device=device)
    pool.set_mla_kv_buffer(8, loc, nope, rope)
    assert torch.equal(full.get_key_buffer(2)[2], torch.cat([nope, rope], -1)[0].to(torch.float16))
    assert torch.equal(pool.get_value_buffer(8)[2], nope[0].to(torch.float16))


def test_construction_validation():
    full = MHATokenToKVPool(16, 1, torch.float16, 2, 4, 2)
    mp = MambaPool(4, CONV, TEMP, 2)
    with pytest.raises(InvalidArgumentError):
        HybridLinearKVPool(full, [0], mp)  # one id for a 2-layer pool
    with pytest.raises(InvalidArgumentError):
        HybridLinearKVPool(full, [0, 0], mp)
    with pytest.raises(InvalidArgumentError):
        HybridLinearKVPool(full, [0, 7], mp)  # 7 >= 4 layers without linear ids
    with pytest.raises(InvalidArgumentError):
        HybridLinearKVPool(full, [0, 7], mp, linear_layer_ids=[1, 7])  # overlap
    with pytest.raises(InvalidArgumentError):
        HybridLinearKVPool(full, [0, 7], mp, linear_layer_ids=[1])
    with pytest.raises(InvalidArgumentError):
        HybridLinearKVPool(mp, [0, 1], mp)
    pool = HybridLinearKVPool(full, [0, 7], mp, linear_layer_ids=[9, 3])
    assert pool.linear_layer_id_mapping == {3: 0, 9: 1}
    assert pool.mamba2_layer_cache(9).temporal.data_ptr() == mp.temporal_state[1].data_ptr()
