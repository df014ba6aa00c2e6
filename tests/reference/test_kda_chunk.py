"""Chunked KDA prefill over a variable-length batch (``cu_seqlens``): the torch reference
equals the token-by-token recurrence, and the Triton kernel (chunk 64; under
``TRITON_INTERPRET=1`` on CPU) equals the torch reference -- fp64 to 1e-12, fp32 to 1e-5 --
for sequences shorter than, equal to and longer than a chunk, with and without initial
states. Bad input raises before anything runs."""
import pytest
import torch
import torch.nn.functional as F

from radixkv.errors import InvalidArgumentError, LengthMismatchError
from radixkv.kernels.triton_util import triton_runnable
from radixkv.reference.kda import kda_recurrent
from radixkv.reference.kda_chunk import CHUNK, chunk_kda


def batch(lens, heads=2, d_k=8, d_v=8, dtype=torch.float64, seed=0, decay=1.0):
    gen = torch.Generator().manual_seed(seed)
    t = sum(lens)

    def r(*s):
        return torch.randn(*s, generator=gen, dtype=torch.float64)

    q = F.normalize(r(t, heads, d_k), dim=-1)
    k = F.normalize(r(t, heads, d_k), dim=-1)
    v = r(t, heads, d_v)
    g = -decay * torch.rand(t, heads, d_k, generator=gen, dtype=torch.float64)
    beta = torch.rand(t, heads, generator=gen, dtype=torch.float64)
    h0 = r(len(lens), heads, d_k, d_v) * 0.5
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    return [x.to(dtype) for x in (q, k, v, g, beta)], cu, h0.to(dtype)


@pytest.mark.parametrize("with_state", [False, True])
def test_torch_varlen_equals_recurrence(with_state):
    lens = [1, 63, 64, 65, 130]
    (q, k, v, g, beta), cu, h0 = batch(lens)
    out = chunk_kda(q, k, v, g, beta, cu, h0 if with_state else None, backend="torch")
    for n in range(len(lens)):
        sl = slice(int(cu[n]), int(cu[n + 1]))
        ref = kda_recurrent(q[sl], k[sl], v[sl], g[sl], beta[sl], h0[n] if with_state else None)
        assert (out.o[sl] - ref.o).abs().max().item() <= 1e-10
        assert (out.final_state[n] - ref.final_state).abs().max().item() <= 1e-10


@pytest.mark.skipif(not triton_runnable("cpu"), reason="needs the Triton interpreter")
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 1e-5)])
@pytest.mark.parametrize("lens,with_state,decay", [([5, 64, 70, 1], True, 1.0), ([129], False, 4.0),
                                                   ([64, 0, 3], True, 0.1)])
def test_triton_equals_torch(dtype, tol, lens, with_state, decay):
    (q, k, v, g, beta), cu, h0 = batch(lens, dtype=dtype, seed=len(lens), decay=decay)
    h0 = h0 if with_state else None
    a = chunk_kda(q, k, v, g, beta, cu, h0, backend="torch")
    b = chunk_kda(q, k, v, g, beta, cu, h0, backend="triton")
    assert a.o.dtype == b.o.dtype and a.final_state.shape == b.final_state.shape == (len(lens), 2, 8, 8)
    assert (a.o - b.o).abs().max().item() <= tol
    assert (a.final_state - b.final_state).abs().max().item() <= tol


def test_bad_input_raises():
    (q, k, v, g, beta), cu, h0 = batch([3, 4])
    with pytest.raises(InvalidArgumentError):
        chunk_kda(q, k, v, g, beta, torch.tensor([0, 4, 3]))
    with pytest.raises(InvalidArgumentError):
        chunk_kda(q, k, v, g, beta, torch.tensor([0, 3, 6]))  # does not end at T
    with pytest.raises(LengthMismatchError):
        chunk_kda(q, k, v[:5], g, beta, cu)
    with pytest.raises(LengthMismatchError):
        chunk_kda(q, k, v, g, beta, cu, h0[:1])
    with pytest.raises(InvalidArgumentError):
        chunk_kda(q, k.float(), v, g, beta, cu)
    if triton_runnable("cpu"):
        with pytest.raises(InvalidArgumentError, match=str(CHUNK)):
            chunk_kda(q, k, v, g, beta, cu, chunk_size=16, backend="triton")


@pytest.mark.skipif(not triton_runnable("cpu"), reason="needs the Triton interpreter")
def test_reference_model_extend_runs_the_kernel():
    """``HybridModel.extend`` prefills through ``chunk_kda`` (the Triton kernel with
    ``backend="triton"``, chunk 64): logits of a 70-token extend, tracked at 64, equal a
    from-scratch run, and the tracked state equals the state of a 64-token extend."""
    import numpy as np

    from radixkv.memory import MambaPool, MHATokenToKVPool
    from radixkv.memory.hybrid_kv import HybridLinearKVPool
    from radixkv.reference import HybridConfig, HybridModel, ModelCache

    cfg = HybridConfig(vocab=40, hidden=16, num_heads=2, head_dim=8, layer_pattern="KFK")
    assert cfg.chunk_size == CHUNK
    model = HybridModel(cfg, backend="triton")
    kv = MHATokenToKVPool(128, 1, cfg.dtype, cfg.num_heads, cfg.head_dim, 1, "cpu")
    mamba = MambaPool(4, cfg.conv_state_shape, cfg.temporal_state_shape, 2, cfg.dtype)
    hkv = HybridLinearKVPool(kv, list(cfg.full_layer_ids), mamba)
    pools = ModelCache(hkv, hkv.mamba2_layer_cache)
    toks = np.random.default_rng(0).integers(0, 40, 70).astype(np.int32)
    rows = torch.arange(1, 71)
    out = model.extend(toks, 0, rows[:0], rows, 1, pools, track_slot=2, track_seqlen=64)
    assert (out - model.forward_reference(toks)).abs().max().item() <= 1e-9
    model.extend(toks[:64], 0, rows[:0], rows[:64], 3, pools)
    assert torch.allclose(mamba.temporal_state[:, 2], mamba.temporal_state[:, 3], atol=1e-12, rtol=0)
    assert torch.equal(mamba.conv_state[:, 2], mamba.conv_state[:, 3])
