"""The host tier's page-first buffer: a page is one contiguous row holding every layer's K
and V of its tokens (an MLA pool: every layer's latent); batched stores and loads round-trip
bit for bit, through the compiled copy and the torch path alike."""
import numpy as np
import pytest
import torch

from radixkv.errors import InvalidArgumentError, LengthMismatchError
from radixkv.memory import native
from radixkv.memory.host_kv_pool import HostKVPool
from radixkv.memory.kv_pool import MHATokenToKVPool, MLATokenToKVPool


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


@pytest.mark.parametrize("ps", [1, 4, 16])
def test_the_compiled_copies_equal_the_torch_path_byte_for_byte(ps, monkeypatch):
    if native.copy_pages is None:
        pytest.skip(f"radixkv.memory._native is not built: {native.unavailable_reason}")
    out = {}
    for path in ("compiled", "torch"):
        if path == "torch":
            monkeypatch.setattr(native, "copy_pages", None)
        kv = MHATokenToKVPool(16 * ps, ps, torch.bfloat16, 2, 8, 3)
        for layer in range(3):
            g = torch.Generator().manual_seed(layer)
            kv.k_buffer[layer].copy_(torch.randn(kv.k_buffer[layer].shape, generator=g))
            kv.v_buffer[layer].copy_(-kv.k_buffer[layer])
        host = HostKVPool(kv, 12)
        gen = torch.Generator().manual_seed(7)
        for _ in range(20):
            n = int(torch.randint(1, 9, (1,), generator=gen))
            hp = torch.randperm(12, generator=gen)[:n] + 1
            dp = torch.randperm(16, generator=gen)[:n] + (0 if ps > 1 else 1)
            rows = (dp[:, None] * ps + torch.arange(ps)).reshape(-1)
            if torch.rand(1, generator=gen) < 0.5:
                host.store(hp, rows)
            else:
                host.load(hp, rows)
        out[path] = (host.buffer.clone(), [b.clone() for b in kv.k_buffer + kv.v_buffer])
    assert torch.equal(out["compiled"][0], out["torch"][0])
    assert all(torch.equal(a, b) for a, b in zip(out["compiled"][1], out["torch"][1]))


def test_the_compiled_copy_checks_every_id_before_a_byte_moves():
    if native.copy_pages is None:
        pytest.skip(f"radixkv.memory._native is not built: {native.unavailable_reason}")
    kv = _pool(ps=4)
    host = HostKVPool(kv, 4)
    bufs = tuple(b.data_ptr() for layer in range(3) for b in (kv.k_buffer[layer], kv.v_buffer[layer]))
    chunk = host.page_bytes // 6
    before = [b.clone() for b in kv.k_buffer]
    for hids, dids in (([1, 9], [0, 1]), ([1, 2], [0, 99]), ([1, -1], [0, 1])):
        with pytest.raises(ValueError, match="out of"):
            native.copy_pages(host.buffer.data_ptr(), 5, host.page_bytes, chunk, np.array(hids, np.int64), bufs,
                              8, np.array(dids, np.int64), True)
    with pytest.raises(ValueError, match="differ in length"):
        native.copy_pages(host.buffer.data_ptr(), 5, host.page_bytes, chunk, np.array([1], np.int64), bufs,
                          8, np.array([0, 1], np.int64), True)
    with pytest.raises(TypeError):
        native.copy_pages(host.buffer.data_ptr(), 5, host.page_bytes, chunk, np.array([1], np.int32), bufs,
                          8, np.array([0], np.int64), True)
    assert all(torch.equal(a, b) for a, b in zip(before, kv.k_buffer))


def _mla(ps=4, dtype=torch.bfloat16, layers=3, size=64):
    kv = MLATokenToKVPool(size, ps, dtype, kv_lora_rank=6, qk_rope_head_dim=2, layer_num=layers)
    g = torch.Generator().manual_seed(1)
    for layer in range(layers):
        kv.kv_buffer[layer].copy_(torch.randn(kv.kv_buffer[layer].shape, generator=g).to(dtype))
    return kv


def test_an_mla_page_is_one_row_of_every_layers_latent():
    kv = _mla(ps=2, dtype=torch.float32, layers=2)
    host = HostKVPool(kv, 3)
    assert host.page_bytes == 2 * 2 * 8 * 4  # layers x tokens x (rank + rope) x fp32: no V half
    host.store(torch.tensor([2]), torch.tensor([6, 7]))
    row = host.pages[2].view(torch.float32).view(2, 1, 2, 1, 8)  # layer, latent, token, head, dim
    assert torch.equal(row[1, 0], kv.kv_buffer[1][[6, 7]]) and torch.equal(row[0, 0], kv.kv_buffer[0][[6, 7]])
    assert torch.equal(host.gather(torch.tensor([6, 7]))[0], host.pages[2])


@pytest.mark.parametrize("ps", [1, 4, 16])
@pytest.mark.parametrize("path", ["compiled", "torch"])
def test_mla_stores_and_loads_round_trip_bit_for_bit(ps, path, monkeypatch):
    if path == "torch":
        monkeypatch.setattr(native, "copy_pages", None)
    elif native.copy_pages is None:
        pytest.skip(f"radixkv.memory._native is not built: {native.unavailable_reason}")
    kv = _mla(ps, size=16 * ps)
    host = HostKVPool(kv, 12)
    gen = torch.Generator().manual_seed(ps)
    model = {}  # host page -> the latent bytes it must hold
    for _ in range(30):
        n = int(torch.randint(1, 6, (1,), generator=gen))
        hp = torch.randperm(12, generator=gen)[:n] + 1
        dp = torch.randperm(15, generator=gen)[:n] + 1
        rows = (dp[:, None] * ps + torch.arange(ps)).reshape(-1)
        if torch.rand(1, generator=gen) < 0.5 or not model:
            host.store(hp, rows)
            for i, p in enumerate(hp.tolist()):
                model[p] = [b[rows[i * ps:(i + 1) * ps]].clone() for b in kv.kv_buffer]
        else:
            known = torch.tensor(sorted(model))[torch.randperm(len(model), generator=gen)[:n]]
            rows = rows[:known.numel() * ps]
            host.load(known, rows)
            for i, p in enumerate(known.tolist()):
                assert all(torch.equal(b[rows[i * ps:(i + 1) * ps]], want) for b, want in zip(kv.kv_buffer, model[p]))


def test_a_pool_of_another_kind_is_refused():
    with pytest.raises(InvalidArgumentError, match="MHA or MLA"):
        HostKVPool(object(), 4)  # type: ignore[arg-type]


def test_page_buffers_are_the_pages_rows_and_refuse_bad_ids():
    """A storage read's destinations: writing through a page's buffer fills exactly its row."""
    host = HostKVPool(_pool(), 4)
    bufs = host.page_buffers([3, 1])
    assert [len(b) for b in bufs] == [1, 1] and all(len(b[0]) == host.page_bytes for b in bufs)
    np.frombuffer(bufs[0][0], np.uint8)[:] = 7
    assert int(host.pages[3].min()) == 7 == int(host.pages[3].max())
    assert int(host.pages[1].abs().sum()) == int(host.pages[2].abs().sum()) == 0
    for bad in ([0], [host.num_pages + 1]):
        with pytest.raises(InvalidArgumentError):
            host.page_buffers(bad)
