"""The host tier's page-first buffer: a page is one contiguous row holding every layer's K
and V of its tokens; batched stores and loads round-trip bit for bit."""
import pytest
import torch

from radixkv.errors import InvalidArgumentError, LengthMismatchError
from radixkv.memory.host_kv_pool import HostKVPool
from radixkv.memory.kv_pool import MHATokenToKVPool


def _pool(ps=4, dtype=torch.float16, layers=3):
    kv = MHATokenToKVPool(32, ps, dtype, 2, 8, layers)
    g = torch.Generator().manual_seed(0)
    for layer in range(layers):
        kv.k_buffer[layer].copy_(torch.randn(kv.k_buffer[layer].shape, generator=g).to(dtype))
        kv.v_buffer[layer].copy_(torch.randn(kv.v_buffer[layer].shape, generator=g).to(dtype))
    return kv


@pytest.mark.parametrize("ps", [1, 4])
def test_store_then_load_round_trips_bit_for_bit(ps):
    kv = _pool(ps)
    host = HostKVPool(kv, 6)
    assert host.page_bytes == 2 * 3 * ps * 2 * 8 * 2 and not host.pinned
    src = torch.arange(ps, 3 * ps + ps)[: 3 * ps]  # three pages of device rows
    host.store(torch.tensor([5, 2, 4]), src)
    dst = torch.arange(4 * ps, 7 * ps)
    host.load(torch.tensor([5, 2, 4]), dst)
    for layer in range(3):
        assert torch.equal(kv.k_buffer[layer][dst], kv.k_buffer[layer][src])
        assert torch.equal(kv.v_buffer[layer][dst], kv.v_buffer[layer][src])


def test_a_page_is_one_contiguous_row_layer_major():
    kv = _pool(ps=2, dtype=torch.float32, layers=2)
    host = HostKVPool(kv, 2)
    host.store(torch.tensor([1]), torch.tensor([3, 4]))
    row = host.pages[1].view(torch.float32).view(2, 2, 2, 2, 8)  # layer, k/v, token, head, dim
    assert torch.equal(row[1, 0], kv.k_buffer[1][[3, 4]])
    assert torch.equal(row[0, 1], kv.v_buffer[0][[3, 4]])
    assert torch.equal(host.gather(torch.tensor([3, 4]))[0], host.pages[1])


def test_bad_arguments_raise_and_copy_nothing():
    kv = _pool(ps=2)
    host = HostKVPool(kv, 2)
    with pytest.raises(LengthMismatchError):
        host.store(torch.tensor([1]), torch.tensor([1, 2, 3]))
    with pytest.raises(InvalidArgumentError):
        host.store(torch.tensor([3]), torch.tensor([1, 2]))
    with pytest.raises(InvalidArgumentError):
        HostKVPool(kv, 0)
    assert not host.pages.any()


@pytest.mark.cuda
def test_cuda_loads_run_on_a_side_stream_and_complete_before_the_event():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    kv = MHATokenToKVPool(256, 16, torch.bfloat16, 4, 64, 4, "cuda")
    for layer in range(4):
        kv.k_buffer[layer].normal_()
        kv.v_buffer[layer].normal_()
    host = HostKVPool(kv, 8)
    assert host.pinned and host.buffer.is_pinned()
    src = torch.arange(16, 16 + 64, device="cuda")
    ev = host.store(torch.tensor([1, 2, 3, 4]), src)
    if ev is not None:
        ev.synchronize()
    dst = torch.arange(128, 192, device="cuda")
    ev = host.load(torch.tensor([1, 2, 3, 4]), dst)
    assert ev is not None
    ev.synchronize()  # what the engine does before a worker reads the rows
    for layer in range(4):
        assert torch.equal(kv.k_buffer[layer][dst], kv.k_buffer[layer][src])
        assert torch.equal(kv.v_buffer[layer][dst], kv.v_buffer[layer][src])
