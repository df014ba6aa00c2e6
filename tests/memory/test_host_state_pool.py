"""HostStatePool: device <-> host copies of Mamba states, exact (bit-equal) both ways, batched,
refusing bad ids with nothing copied; pinned host memory on CUDA."""
import pytest
import torch

from radixkv.errors import InvalidArgumentError, LengthMismatchError
from radixkv.memory import MambaPool
from radixkv.memory.host_state_pool import HostStatePool


def _pool(device="cpu", dtype=torch.float64):
    pool = MambaPool(4, (3, 4), (2, 3, 3), 2, dtype=dtype, device=device)
    g = torch.Generator().manual_seed(0)
    pool.conv_state.copy_(torch.randn(pool.conv_state.shape, generator=g, dtype=dtype))
    pool.temporal_state.copy_(torch.randn(pool.temporal_state.shape, generator=g, dtype=dtype))
    return pool


def test_round_trip_is_bit_equal():
    pool = _pool()
    host = HostStatePool(pool, 3)
    conv, temporal = pool.conv_state[:, [1, 3]].clone(), pool.temporal_state[:, [1, 3]].clone()
    host.store([3, 1], [1, 3])
    pool.conv_state.zero_()
    pool.temporal_state.zero_()
    host.load([3, 1], [2, 4])
    assert torch.equal(pool.conv_state[:, [2, 4]], conv) and torch.equal(pool.temporal_state[:, [2, 4]], temporal)
    assert not pool.conv_state[:, [1, 3]].any()  # only the named slots were written
    assert host.slot_bytes == (2 * 3 * 4 + 2 * 2 * 3 * 3) * 8 and not host.pinned


@pytest.mark.parametrize("args", [([1], [1, 2]), ([0], [1]), ([4], [1]), ([1], [5])])
def test_bad_ids_copy_nothing(args):
    pool = _pool()
    host = HostStatePool(pool, 3)
    before = host.conv.clone()
    with pytest.raises((InvalidArgumentError, LengthMismatchError)):
        host.store(*args)
    assert torch.equal(host.conv, before)


def test_bad_size_is_refused():
    with pytest.raises(InvalidArgumentError):
        HostStatePool(_pool(), 0)


@pytest.mark.cuda
def test_cuda_round_trip_through_pinned_memory():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    pool = _pool("cuda")
    host = HostStatePool(pool, 2)
    assert host.pinned and host.conv.is_pinned() and host.temporal.is_pinned()
    want = pool.temporal_state[:, 2].clone()
    host.store([1], [2])
    host.load([1], [4])
    assert torch.equal(pool.temporal_state[:, 4], want)
