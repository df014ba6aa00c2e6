"""MambaPool (state slots: alloc zeroes, free, copy_from fork, layer views) and
KimiLinearStateShape (the seed's section 8.2 example)."""
import pytest
import torch

from radixkv.errors import (
    DoubleFreeError,
    InvalidArgumentError,
    InvalidIndexError,
    InvariantError,
    LengthMismatchError,
)
from radixkv.memory import KimiLinearStateShape, MambaPool

SIZE, LAYERS, CONV, TEMP = 5, 3, (3, 8), (2, 4, 4)


def pool_on(device, **kw):
    return MambaPool(SIZE, CONV, TEMP, LAYERS, torch.float32, device, **kw)


def snapshot(pool):
    ids = torch.arange(0, pool.size + 1, device=pool.device)
    return pool.available_size(), pool.free_slots.is_free(ids).clone(), pool.arena.buffer.clone()


def assert_unchanged(pool, snap):
    now = snapshot(pool)
    assert now[0] == snap[0] and torch.equal(now[1], snap[1]) and torch.equal(now[2], snap[2])
    pool.check_invariants()


# -- KimiLinearStateShape ----------------------------------------------------------------
def test_seed_example_conv_3x4096_temporal_32x128x128():
    """Seed 8.2, without extra arguments: conv kernel 4 -> (3, 4096) (one projection of
    32 * 128 channels, the seed's proj_size formula); 32 heads of 128 -> (32, 128, 128)."""
    s = KimiLinearStateShape.create(num_heads=32, head_dim=128, conv_kernel_size=4)
    assert s.conv == (3, 4096) and s.proj_size == 4096
    assert s.temporal == (32, 128, 128)
    assert s.pool_conv == (3, 3 * 4096)  # q, k and v windows in the pool's one conv tensor


def test_seed_example_slot_size_is_2_mib_per_layer():
    """Seed 8.6: 32 heads x 128 x 128 x 4 B = 2 MB of temporal state per request and layer;
    the conv windows of q, k and v are three (3, 4096) states."""
    s = KimiLinearStateShape.create(32, 128, 4)
    pool = MambaPool.from_state_shape(1, s, 1, torch.float32)
    assert pool.slot_bytes.temporal_bytes == 2 * 1024 * 1024
    assert pool.slot_bytes.conv_bytes == 3 * (3 * 4096 * 4)
    assert pool.temporal_state.shape == (1, 2, 32, 128, 128)
    assert pool.conv_state.shape == (1, 2, 3, 3 * 4096)


def test_cache_params_seed_example():
    from radixkv.memory import KimiLinearCacheParams, Mamba2StateDType

    s = KimiLinearStateShape.create(32, 128, 4)
    p = KimiLinearCacheParams(shape=s, layers=[0, 1, 2, 4], dtype=Mamba2StateDType("float32", torch.float32))
    assert p.num_layers == 4 and p.layers == (0, 1, 2, 4)
    assert p.mamba_cache_per_req == 4 * (2 * 1024 * 1024 + 3 * 3 * 4096 * 4)
    pool = KimiLinearCacheParams(KimiLinearStateShape.create(2, 8, 4), [1, 3]).pool(3)
    assert pool.conv_state.shape == (2, 4, 3, 48) and pool.temporal_state.shape == (2, 4, 2, 8, 8)
    for bad in (dict(shape=(3, 4), layers=[0]), dict(shape=s, layers=[]), dict(shape=s, layers=[2, 1]),
                dict(shape=s, layers=[0], dtype=("int9", "float32"))):
        with pytest.raises(InvalidArgumentError):
            KimiLinearCacheParams(**bad)


def test_default_proj_size_and_tp_divides():
    s = KimiLinearStateShape.create(32, 128, 4)
    assert s.proj_size == 32 * 128 and s.conv == (3, 4096)
    s2 = KimiLinearStateShape.create(32, 128, 4, tp_world_size=4)
    assert s2.conv == (3, 1024) and s2.temporal == (8, 128, 128) and s2.pool_conv == (3, 3072)
    with pytest.raises(InvalidArgumentError, match="num_heads"):
        KimiLinearStateShape.create(32, 128, 4, tp_world_size=3)
    with pytest.raises(InvalidArgumentError, match="proj_size"):
        KimiLinearStateShape.create(32, 128, 4, proj_size=4098, tp_world_size=4)
    for bad in (dict(num_heads=0, head_dim=8, conv_kernel_size=4),
                dict(num_heads=2, head_dim=8, conv_kernel_size=1),
                dict(num_heads=2, head_dim=8, conv_kernel_size=4, tp_world_size=0),
                dict(num_heads=2, head_dim=8, conv_kernel_size=4, proj_size=-3)):
        with pytest.raises(InvalidArgumentError):
            KimiLinearStateShape.create(**bad)


# -- MambaPool ---------------------------------------------------------------------------
def test_shapes_dtypes_and_one_arena(device):
    pool = pool_on(device, conv_dtype=torch.bfloat16)
    assert pool.conv_state.shape == (LAYERS, SIZE + 1) + CONV
    assert pool.temporal_state.shape == (LAYERS, SIZE + 1) + TEMP
    assert pool.conv_state.dtype == torch.bfloat16 and pool.temporal_state.dtype == torch.float32
    storage = pool.arena.buffer.untyped_storage().data_ptr()
    assert pool.conv_state.untyped_storage().data_ptr() == storage
    assert pool.temporal_state.untyped_storage().data_ptr() == storage
    assert pool.available_size() == SIZE
    conv_b, temp_b = pool.get_state_size_bytes()
    assert conv_b == LAYERS * (SIZE + 1) * 24 * 2 and temp_b == LAYERS * (SIZE + 1) * 32 * 4
    assert pool.mem_usage == (conv_b + temp_b) / (1 << 30)
    assert conv_b + temp_b <= pool.nbytes
    pool.check_invariants()


def test_alloc_zeroes_reused_slots(device):
    pool = pool_on(device)
    ids = pool.alloc(SIZE)
    assert sorted(ids.tolist()) == list(range(1, SIZE + 1)) and ids.dtype == torch.int64
    pool.conv_state[:, ids] = 1.0
    pool.temporal_state[:, ids] = 2.0
    pool.free(ids[:3])
    again = pool.alloc(3)
    assert sorted(again.tolist()) == sorted(ids[:3].tolist())
    assert int(pool.conv_state[:, again].count_nonzero()) == 0
    assert int(pool.temporal_state[:, again].count_nonzero()) == 0
    # the other slots kept their state
    assert torch.all(pool.temporal_state[:, ids[3:]] == 2.0)
    assert pool.alloc(0).numel() == 0


def test_alloc_none_when_short_unchanged(device):
    pool = pool_on(device)
    pool.alloc(4)
    snap = snapshot(pool)
    assert pool.alloc(2) is None
    assert_unchanged(pool, snap)
    with pytest.raises(InvalidArgumentError):
        pool.alloc(-1)
    assert_unchanged(pool, snap)


def test_free_validates_unchanged(device):
    pool = pool_on(device)
    ids = pool.alloc(3)
    pool.free(ids[:1])
    snap = snapshot(pool)
    for bad, error in ((ids[:1], DoubleFreeError), (torch.stack([ids[1], ids[1]]), DoubleFreeError),
                       (torch.tensor([0]), InvalidIndexError), (torch.tensor([SIZE + 1]), InvalidIndexError),
                       (torch.tensor([ids[1].item(), 4, 5]), DoubleFreeError),
                       (torch.tensor([1.0]), InvalidArgumentError)):
        with pytest.raises(error):
            pool.free(bad.to(device) if bad.dtype != torch.float32 else bad)
        assert_unchanged(pool, snap)
    pool.free([int(ids[1]), int(ids[2])])
    assert pool.available_size() == SIZE


def test_one_slot_paths_zero_and_validate_like_the_general_ones(device):
    """alloc(1) / alloc_one zero the slot like alloc(n); free(int) / free([int]) take the
    one-slot path with the same errors, state unchanged on each."""
    pool = pool_on(device)
    ids = pool.alloc(SIZE)
    pool.conv_state[:, ids] = 1.0
    pool.temporal_state[:, ids] = 2.0
    pool.free([int(ids[0])])
    pool.free(int(ids[1]))
    one = pool.alloc(1)
    assert one.dtype == torch.int64 and one.tolist() == [int(ids[0])]
    i = pool.alloc_one()
    assert i == int(ids[1])
    for slot in (int(one[0]), i):
        assert int(pool.conv_state[:, slot].count_nonzero()) == 0
        assert int(pool.temporal_state[:, slot].count_nonzero()) == 0
    assert torch.all(pool.temporal_state[:, ids[2:]] == 2.0)
    assert pool.alloc_one() is None and pool.alloc(1) is None
    pool.free(i)
    snap = snapshot(pool)
    for bad, error in ((i, DoubleFreeError), ([i], DoubleFreeError), (0, InvalidIndexError),
                       ([SIZE + 1], InvalidIndexError), (True, InvalidArgumentError)):
        with pytest.raises(error):
            pool.free(bad)
        assert_unchanged(pool, snap)


def test_copy_from_forks_state(device):
    pool = pool_on(device)
    src = pool.alloc(2)
    dst = pool.alloc(2)
    pool.conv_state[:, src] = torch.randn(LAYERS, 2, *CONV, device=device)
    pool.temporal_state[:, src] = torch.randn(LAYERS, 2, *TEMP, device=device)
    pool.copy_from(src, dst)
    assert torch.equal(pool.conv_state[:, dst], pool.conv_state[:, src])
    assert torch.equal(pool.temporal_state[:, dst], pool.temporal_state[:, src])
    src_state = pool.temporal_state[:, src].clone()
    pool.temporal_state[:, dst] += 1.0  # later writes to the fork ...
    pool.mamba2_layer_cache(0).conv[0][dst] = -5.0
    assert torch.equal(pool.temporal_state[:, src], src_state)  # ... leave the source alone
    assert not torch.any(pool.conv_state[0, src] == -5.0)


def test_copy_from_overlapping_indices_gathers_first(device):
    pool = pool_on(device)
    a, b = pool.alloc(2).tolist()
    pool.temporal_state[:, a] = 1.0
    pool.temporal_state[:, b] = 2.0
    pool.copy_from([a, b], [b, a])  # swap
    assert torch.all(pool.temporal_state[:, a] == 2.0) and torch.all(pool.temporal_state[:, b] == 1.0)


def test_copy_from_validates_unchanged(device):
    pool = pool_on(device)
    ids = pool.alloc(3).tolist()
    pool.temporal_state[:, ids] = torch.arange(3.0, device=device).view(1, 3, 1, 1, 1)
    free_slot = next(i for i in range(1, SIZE + 1) if i not in ids)
    snap = snapshot(pool)
    cases = [
        (LengthMismatchError, ([ids[0], ids[1]], [ids[2]])),
        (InvalidArgumentError, ([free_slot], [ids[0]])),  # source not allocated
        (InvalidArgumentError, ([ids[0]], [free_slot])),  # destination not allocated
        (InvalidArgumentError, ([ids[0], ids[1]], [ids[2], ids[2]])),  # repeated destination
        (InvalidIndexError, ([0], [ids[0]])),
        (InvalidIndexError, ([ids[0]], [SIZE + 1])),
        (InvalidArgumentError, (torch.tensor([1.0]), [ids[0]])),
    ]
    for error, (src, dst) in cases:
        with pytest.raises(error):
            pool.copy_from(src, dst)
        assert_unchanged(pool, snap)
    pool.copy_from([], [])
    assert_unchanged(pool, snap)


def test_mamba2_layer_cache_views(device):
    pool = pool_on(device)
    cache = pool.mamba2_layer_cache(2)
    assert isinstance(cache.conv, list) and len(cache.conv) == 1
    assert cache.conv[0].shape == (SIZE + 1,) + CONV
    assert cache.temporal.shape == (SIZE + 1,) + TEMP
    cache.conv[0][4, 1, 2] = 9.0
    cache.temporal[3, 0, 1, 1] = 8.0
    assert pool.conv_state[2, 4, 1, 2].item() == 9.0 and pool.temporal_state[2, 3, 0, 1, 1].item() == 8.0
    assert int(pool.conv_state[:2].count_nonzero()) == 0
    assert pool.mamba_cache.conv[0] is pool.conv_state
    for bad in (LAYERS, -1):
        with pytest.raises(InvalidIndexError):
            pool.mamba2_layer_cache(bad)


def test_clear_and_invariants(device):
    pool = pool_on(device)
    pool.alloc(3)
    pool.clear()
    assert pool.available_size() == SIZE
    pool.check_invariants()
    pool.alloc(2)
    pool.free_slots._free[0] = True  # the padding slot marked free
    with pytest.raises(InvariantError, match="reserved id 0"):
        pool.check_invariants()


def test_bad_constructor_arguments():
    for args in ((0, CONV, TEMP, LAYERS), (SIZE, (3, 0), TEMP, LAYERS), (SIZE, CONV, 5, LAYERS),
                 (SIZE, CONV, TEMP, 0)):
        with pytest.raises(InvalidArgumentError):
            MambaPool(*args)
    with pytest.raises(InvalidArgumentError):
        MambaPool(SIZE, CONV, TEMP, LAYERS, temporal_dtype="float99")


def test_check_invariants_names_states_that_left_the_arena():
    pool = pool_on("cpu")
    pool.temporal_state = pool.temporal_state.clone()
    with pytest.raises(InvariantError, match="not the arena's views"):
        pool.check_invariants()


@pytest.mark.parametrize("pairs", [([1, 2], [3, 4]), ([2, 2, 1], [3, 5, 4]), ([1, 2], [2, 1])])
def test_copy_from_triton_backend_matches_torch(device, pairs):
    """The Triton state copy (interpreter on CPU) gives the same states as torch indexing;
    overlapping pairs (the swap) fall back to the gathering torch path."""
    pools = [pool_on(device, copy_backend=b) for b in ("torch", "triton")]
    g = torch.Generator().manual_seed(0)
    conv = torch.randn((LAYERS, SIZE + 1) + CONV, generator=g).to(device)
    temp = torch.randn((LAYERS, SIZE + 1) + TEMP, generator=g).to(device)
    for p in pools:
        p.alloc(SIZE)
        p.conv_state.copy_(conv)
        p.temporal_state.copy_(temp)
        p.copy_from(*pairs)
    assert torch.equal(pools[0].conv_state, pools[1].conv_state)
    assert torch.equal(pools[0].temporal_state, pools[1].temporal_state)
    src, dst = pairs
    assert torch.equal(pools[1].temporal_state[:, dst], temp[:, src])
    with pytest.raises(InvalidArgumentError):
        pool_on(device, copy_backend="cuda-magic")


def test_slot_views_zero_and_copy_write_the_slot_in_every_layer_only():
    """The kept per-slot views (alloc_one's zero fill, the tree's one-state fork) write
    exactly the slot's states in every layer, and stay current across writes."""
    from radixkv.memory.mamba_pool import SlotViews

    pool = MambaPool(4, (3, 2), (2, 2), num_layers=2)
    a, b = pool.alloc_one(), pool.alloc_one()
    pool.conv_state[:, a] = 7.0
    pool.temporal_state[:, a] = 5.0
    before_c, before_t = pool.conv_state.clone(), pool.temporal_state.clone()
    views = pool.slot_views
    assert isinstance(views, SlotViews)
    views.copy(a, b)
    assert torch.equal(pool.conv_state[:, b], before_c[:, a])
    assert torch.equal(pool.temporal_state[:, b], before_t[:, a])
    others = [s for s in range(pool.size + 1) if s != b]
    assert torch.equal(pool.conv_state[:, others], before_c[:, others])
    pool.conv_state[:, a] = 3.0  # a write through the pool tensor shows in the kept view
    assert torch.equal(views[a][0], pool.conv_state[:, a])
    views.zero(a)
    assert not pool.conv_state[:, a].any() and not pool.temporal_state[:, a].any()
    assert torch.equal(pool.conv_state[:, b], before_c[:, a])
    ids = pool.alloc(1)
    assert ids.dtype == torch.int64 and ids.shape == (1,) and not pool.conv_state[:, int(ids[0])].any()
