"""MHA / MLA KV pools: layout in one arena, set/get, casting, validation, byte accounting."""
import pytest
import torch

from radixkv.errors import InvalidArgumentError, InvalidIndexError, InvariantError, LengthMismatchError
from radixkv.memory import MHATokenToKVPool, MLATokenToKVPool

SIZE, PAGE, H, D, L = 12, 4, 2, 8, 3


class FakeLayer:
    """Stands in for SGLang's RadixAttention: only ``layer_id`` is read."""

    def __init__(self, layer_id):
        self.layer_id = layer_id


def mha(device, dtype=torch.float16, **kw):
    return MHATokenToKVPool(SIZE, PAGE, dtype, H, D, L, device, **kw)


def mla(device, dtype=torch.bfloat16, rank=16, rope=4):
    return MLATokenToKVPool(SIZE, PAGE, dtype, rank, rope, L, device)


def test_mha_buffers_shapes_and_one_arena(device):
    pool = mha(device)
    assert len(pool.k_buffer) == len(pool.v_buffer) == L
    base, end = pool.arena.buffer.data_ptr(), pool.arena.buffer.data_ptr() + pool.nbytes
    storage = pool.arena.buffer.untyped_storage().data_ptr()
    for t in pool.k_buffer + pool.v_buffer:
        assert t.shape == (SIZE + PAGE, H, D) and t.dtype == torch.float16
        assert t.device.type == device.type
        assert base <= t.data_ptr() and t.data_ptr() + t.nbytes <= end
        assert t.untyped_storage().data_ptr() == storage
    ptrs = sorted(t.data_ptr() for t in pool.k_buffer + pool.v_buffer)
    assert all(b - a >= pool.k_buffer[0].nbytes for a, b in zip(ptrs, ptrs[1:]))  # disjoint
    pool.check_invariants()


def test_mha_set_get_round_trip_casts_to_pool_dtype(device):
    pool = mha(device)
    loc = torch.tensor([1, 5, 15], device=device)
    k = torch.randn(3, H, D, device=device)  # float32 in, float16 stored
    v = torch.randn(3, H, D, device=device)
    k_in = k.clone()
    pool.set_kv_buffer(1, loc, k, v, k_scale=2.0)
    assert torch.equal(k, k_in)  # the caller's tensor is not modified
    kb, vb = pool.get_kv_buffer(1)
    assert kb.dtype == torch.float16
    assert torch.equal(kb[loc], (k / 2.0).to(torch.float16))
    assert torch.equal(vb[loc], v.to(torch.float16))
    assert torch.equal(pool.get_key_buffer(1), kb) and torch.equal(pool.get_value_buffer(1), vb)
    # only those rows of only that layer changed
    assert int(pool.get_key_buffer(0).count_nonzero()) == 0
    mask = torch.ones(SIZE + PAGE, dtype=torch.bool, device=device)
    mask[loc] = False
    assert int(kb[mask].count_nonzero()) == 0
    # a layer object with .layer_id works like its id
    pool.set_kv_buffer(FakeLayer(2), loc[:1], k[:1], v[:1])
    assert torch.equal(pool.get_value_buffer(FakeLayer(2))[1], v[0].to(torch.float16))


def test_mha_getters_are_views(device):
    pool = mha(device)
    pool.get_key_buffer(0)[3].fill_(7)
    assert pool.k_buffer[0][3, 0, 0].item() == 7


def test_mha_set_kv_buffer_rejects_bad_input_unchanged(device):
    pool = mha(device)
    pool.set_kv_buffer(0, torch.tensor([2], device=device), torch.ones(1, H, D, device=device),
                       torch.ones(1, H, D, device=device))
    before = pool.arena.buffer.clone()
    loc = torch.tensor([1, 2], device=device)
    good = torch.randn(2, H, D, device=device)
    cases = [
        (InvalidIndexError, (L, loc, good, good)),
        (InvalidIndexError, (-1, loc, good, good)),
        (InvalidIndexError, (FakeLayer(L + 5), loc, good, good)),
        (InvalidArgumentError, ("0", loc, good, good)),
        (InvalidIndexError, (0, torch.tensor([1, SIZE + PAGE], device=device), good, good)),
        (InvalidIndexError, (0, torch.tensor([-1, 2], device=device), good, good)),
        (InvalidArgumentError, (0, torch.tensor([1.0, 2.0], device=device), good, good)),
        (LengthMismatchError, (0, loc, good[:1], good)),
        (LengthMismatchError, (0, loc, good, torch.randn(3, H, D, device=device))),
        (InvalidArgumentError, (0, loc, torch.randn(2, H, D + 1, device=device), good)),
        (InvalidArgumentError, (0, loc, good, torch.randn(2, H * D, device=device))),
        (InvalidArgumentError, (0, loc, torch.ones(2, H, D, dtype=torch.int32, device=device), good)),
        (InvalidArgumentError, (0, loc, good.cpu().numpy(), good)),
        (InvalidArgumentError, (0, loc, good, good.to("meta"))),
    ]
    for error, args in cases:
        with pytest.raises(error):
            pool.set_kv_buffer(*args)
        assert torch.equal(pool.arena.buffer, before), (error, args)
    with pytest.raises(InvalidIndexError):
        pool.get_key_buffer(L)
    with pytest.raises(InvalidIndexError):
        pool.get_kv_buffer(-1)


def test_mha_byte_accounting(device):
    pool = mha(device)
    per = (SIZE + PAGE) * H * D * 2  # float16
    assert pool.get_kv_size_bytes() == (L * per, L * per)
    k, v = pool.get_kv_size_bytes()
    assert pool.get_kv_size_bytes().k_bytes == k
    assert pool.mem_usage == (k + v) / (1 << 30)
    assert k + v <= pool.nbytes <= k + v + 2 * L * pool.arena.layout.alignment
    assert pool.nbytes == pool.arena.buffer.numel()


def test_fp8_pool_stores_uint8_and_reads_fp8(device):
    if not hasattr(torch, "float8_e4m3fn"):
        pytest.skip("no fp8 dtype in this torch")
    pool = mha(device, torch.float8_e4m3fn)
    assert pool.store_dtype == torch.uint8 and pool.k_buffer[0].dtype == torch.uint8
    loc = torch.tensor([3], device=device)
    pool.set_kv_buffer(0, loc, torch.full((1, H, D), 1.5, device=device),
                       torch.full((1, H, D), -2.0, device=device))
    k, v = pool.get_kv_buffer(0)
    assert k.dtype == torch.float8_e4m3fn
    assert torch.all(k[3].float() == 1.5) and torch.all(v[3].float() == -2.0)
    assert pool.get_kv_size_bytes() == (L * (SIZE + PAGE) * H * D, L * (SIZE + PAGE) * H * D)


def test_mla_layout_value_is_a_view_of_the_latent(device):
    pool = mla(device)
    lat = pool.get_key_buffer(1)
    assert lat.shape == (SIZE + PAGE, 1, 20) and lat.dtype == torch.bfloat16
    val = pool.get_value_buffer(1)
    assert val.shape == (SIZE + PAGE, 1, 16)
    assert val.data_ptr() == lat.data_ptr()
    lat[2, 0, 5] = 3.0
    assert val[2, 0, 5].item() == 3.0
    k, v = pool.get_kv_buffer(1)
    assert torch.equal(k, lat) and torch.equal(v, val)
    assert pool.get_kv_size_bytes() == (L * (SIZE + PAGE) * 20 * 2, 0)
    pool.check_invariants()


def test_mla_set_kv_buffer_and_set_mla_kv_buffer(device):
    pool = mla(device)
    loc = torch.tensor([4, 9], device=device)
    full = torch.randn(2, 1, 20, device=device)
    pool.set_kv_buffer(0, loc, full, None)
    assert torch.equal(pool.get_key_buffer(0)[loc], full.to(torch.bfloat16))
    nope, rope = torch.randn(2, 1, 16, device=device), torch.randn(2, 1, 4, device=device)
    pool.set_mla_kv_buffer(FakeLayer(2), loc, nope, rope)
    got = pool.get_key_buffer(2)[loc]
    assert torch.equal(got[..., :16], nope.to(torch.bfloat16))
    assert torch.equal(got[..., 16:], rope.to(torch.bfloat16))
    assert torch.equal(pool.get_value_buffer(2)[loc], nope.to(torch.bfloat16))


def test_mla_rejects_bad_input_unchanged(device):
    pool = mla(device)
    before = pool.arena.buffer.clone()
    loc = torch.tensor([1, 2], device=device)
    with pytest.raises(InvalidArgumentError):
        pool.set_kv_buffer(0, loc, torch.randn(2, 1, 16, device=device))  # nope only
    with pytest.raises(LengthMismatchError):
        pool.set_mla_kv_buffer(0, loc, torch.randn(2, 1, 16, device=device), torch.randn(1, 1, 4, device=device))
    with pytest.raises(InvalidArgumentError):
        pool.set_mla_kv_buffer(0, loc, torch.randn(2, 1, 15, device=device), torch.randn(2, 1, 4, device=device))
    with pytest.raises(InvalidIndexError):
        pool.set_mla_kv_buffer(L, loc, torch.randn(2, 1, 16, device=device), torch.randn(2, 1, 4, device=device))
    with pytest.raises(InvalidIndexError):
        pool.set_kv_buffer(0, torch.tensor([SIZE + PAGE], device=device), torch.randn(1, 1, 20, device=device))
    assert torch.equal(pool.arena.buffer, before)


def test_checks_off_skips_the_range_check_only(device):
    pool = mha(device, checks=False)
    pool.set_kv_buffer(0, torch.tensor([SIZE + PAGE - 1], device=device),
                       torch.ones(1, H, D, device=device), torch.ones(1, H, D, device=device))
    with pytest.raises(LengthMismatchError):  # shape checks stay on
        pool.set_kv_buffer(0, torch.tensor([1], device=device), torch.ones(2, H, D, device=device),
                           torch.ones(2, H, D, device=device))


def test_bad_constructor_arguments():
    with pytest.raises(InvalidArgumentError):
        MHATokenToKVPool(0, 1, torch.float16, H, D, L)
    with pytest.raises(InvalidArgumentError):
        MHATokenToKVPool(SIZE, 0, torch.float16, H, D, L)
    with pytest.raises(InvalidArgumentError):
        MHATokenToKVPool(SIZE, 1, torch.int32, H, D, L)
    with pytest.raises(InvalidArgumentError):
        MHATokenToKVPool(SIZE, 1, torch.float16, 0, D, L)
    with pytest.raises(InvalidArgumentError):
        MHATokenToKVPool(SIZE, 1, "float17", H, D, L)
    with pytest.raises(InvalidArgumentError):
        MLATokenToKVPool(SIZE, 1, torch.float16, 0, 4, L)


def test_pool_attached_to_another_pools_buffer_sees_its_writes():
    owner = mha("cpu")
    worker = MHATokenToKVPool(SIZE, PAGE, "float16", H, D, L, "cpu", buffer=owner.arena.buffer)
    assert worker.arena.layout == owner.arena.layout
    owner.set_kv_buffer(2, torch.tensor([7]), torch.ones(1, H, D), torch.full((1, H, D), 3.0))
    assert torch.all(worker.get_value_buffer(2)[7] == 3.0)


def test_check_invariants_names_a_buffer_that_left_the_arena():
    pool = mha("cpu")
    pool.check_invariants()
    pool.v_buffer[1] = pool.v_buffer[1].clone()
    with pytest.raises(InvariantError, match=r"\['v.1'\]"):
        pool.check_invariants()
    lat = mla("cpu")
    lat.kv_buffer[2] = torch.zeros_like(lat.kv_buffer[2])
    with pytest.raises(InvariantError, match=r"\['kv.2'\]"):
        lat.check_invariants()
