"""KDA math: the fused decode step (torch and Triton under TRITON_INTERPRET=1) against an
explicit per-head formula, and the chunked prefill against the token-by-token recurrence."""
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

from radixkv.errors import InvalidArgumentError, InvalidIndexError, LengthMismatchError
from radixkv.kernels.triton_util import triton_runnable
from radixkv.reference.kda import kda_recurrent
from radixkv.reference.kda_chunk import kda_chunked
from radixkv.reference.kda_decode import kda_decode

BACKENDS = ["torch"] + (["triton"] if triton_runnable("cpu") else [])
TOL = {torch.float32: 2e-5, torch.float64: 1e-12}


def _inputs(batch, heads, d_k, d_v, dtype, device="cpu", seed=0, decay_scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    mk = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    q = F.normalize(mk(batch, heads, d_k), dim=-1)
    k = F.normalize(mk(batch, heads, d_k), dim=-1)
    v = mk(batch, heads, d_v)
    g = -F.softplus(mk(batch, heads, d_k) * decay_scale - 1.0)
    beta = torch.sigmoid(mk(batch, heads))
    return [t.to(device, dtype) for t in (q, k, v, g, beta)]


def _explicit_step(q, k, v, g, beta, state):
    """Matrix form per request and head, written independently of the kernels:
    S <- diag(exp g) S;  u = beta (v - S^T k);  S <- S + k u^T;  o = S^T q."""
    state = state.clone()
    out = torch.empty_like(v)
    for b in range(q.shape[0]):
        for h in range(q.shape[1]):
            s = torch.diag(torch.exp(g[b, h])) @ state[b, h]
            u = beta[b, h] * (v[b, h] - s.t() @ k[b, h])
            s = s + torch.outer(k[b, h], u)
            out[b, h] = s.t() @ q[b, h]
            state[b, h] = s
    return out, state


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("heads, d_k, d_v", [(2, 16, 16), (3, 24, 24), (1, 8, 40), (2, 64, 64)])
def test_decode_matches_explicit_formula(device, backend, dtype, heads, d_k, d_v):
    if backend == "triton" and not triton_runnable(device):
        pytest.skip("triton not runnable here")
    q, k, v, g, beta = _inputs(3, heads, d_k, d_v, dtype, device)
    states = torch.randn(6, heads, d_k, d_v, generator=torch.Generator().manual_seed(9),
                         dtype=torch.float64).to(device, dtype)
    idx = torch.tensor([4, 1, 5], device=device)
    others = states[[0, 2, 3]].clone()
    expect_o, expect_s = _explicit_step(q, k, v, g, beta, states[idx])
    o = kda_decode(q, k, v, g, beta, states, idx, backend=backend)
    assert o.dtype == dtype
    assert (o - expect_o).abs().max().item() <= TOL[dtype]
    assert (states[idx] - expect_s).abs().max().item() <= TOL[dtype]
    assert torch.equal(states[[0, 2, 3]], others)


@pytest.mark.skipif(len(BACKENDS) < 2, reason="needs the Triton interpreter")
@given(seed=st.integers(0, 10**6), batch=st.integers(1, 4), heads=st.integers(1, 3), d_k=st.integers(1, 33),
       d_v=st.integers(1, 33))
def test_decode_triton_equals_torch_random(seed, batch, heads, d_k, d_v):
    q, k, v, g, beta = _inputs(batch, heads, d_k, d_v, torch.float64, seed=seed, decay_scale=3.0)
    states = torch.randn(batch + 2, heads, d_k, d_v, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    idx = torch.randperm(batch + 1, generator=torch.Generator().manual_seed(seed))[:batch] + 1
    s_torch, s_triton = states.clone(), states.clone()
    o_torch = kda_decode(q, k, v, g, beta, s_torch, idx, backend="torch")
    o_triton = kda_decode(q, k, v, g, beta, s_triton, idx, backend="triton")
    assert (o_torch - o_triton).abs().max().item() <= 1e-12
    assert (s_torch - s_triton).abs().max().item() <= 1e-12


@pytest.mark.parametrize("backend", BACKENDS)
def test_fp32_state_with_fp32_math_and_padding_slot(backend):
    q, k, v, g, beta = _inputs(3, 2, 16, 16, torch.float32, seed=5)
    states = torch.zeros(4, 2, 16, 16)
    o = kda_decode(q, k, v, g, beta, states, torch.tensor([0, 0, 2]), backend=backend)  # 0 repeats: padding
    assert torch.isfinite(o).all()
    _, expect = _explicit_step(q[2:], k[2:], v[2:], g[2:], beta[2:], torch.zeros(1, 2, 16, 16))
    assert (states[2] - expect[0]).abs().max().item() <= 1e-6
    assert torch.equal(states[1], torch.zeros(2, 16, 16)) and torch.equal(states[3], torch.zeros(2, 16, 16))


@pytest.mark.parametrize("backend", BACKENDS)
def test_decode_steps_equal_recurrence(backend):
    T, H, D = 12, 2, 8
    q, k, v, g, beta = _inputs(T, H, D, D, torch.float64, seed=2)
    init = torch.randn(H, D, D, dtype=torch.float64)
    ref = kda_recurrent(q, k, v, g, beta, init)
    states = torch.zeros(3, H, D, D, dtype=torch.float64)
    states[1] = init
    outs = [kda_decode(q[t:t + 1], k[t:t + 1], v[t:t + 1], g[t:t + 1], beta[t:t + 1], states, torch.tensor([1]),
                       backend=backend) for t in range(T)]
    assert (torch.cat(outs) - ref.o).abs().max().item() <= 1e-12
    assert (states[1] - ref.final_state).abs().max().item() <= 1e-12


@given(
    seed=st.integers(0, 10**6),
    length=st.integers(1, 70),
    chunk=st.sampled_from([1, 3, 8, 16, 64]),
    decay_scale=st.sampled_from([0.5, 3.0, 12.0]),
    with_state=st.booleans(),
)
def test_chunked_equals_recurrent(seed, length, chunk, decay_scale, with_state):
    heads, d = 2, 8
    q, k, v, g, beta = _inputs(length, heads, d, d, torch.float64, seed=seed, decay_scale=decay_scale)
    init = torch.randn(heads, d, d, generator=torch.Generator().manual_seed(seed),
                       dtype=torch.float64) if with_state else None
    a = kda_recurrent(q, k, v, g, beta, init)
    b = kda_chunked(q, k, v, g, beta, init, chunk)
    assert (a.o - b.o).abs().max().item() <= 1e-10
    assert (a.final_state - b.final_state).abs().max().item() <= 1e-10


def test_chunked_fp32_and_extreme_decay_stay_finite():
    q, k, v, g, beta = _inputs(50, 2, 16, 16, torch.float32, seed=7, decay_scale=40.0)  # g down to ~-100
    a = kda_recurrent(q, k, v, g, beta)
    b = kda_chunked(q, k, v, g, beta, None, 16)
    assert torch.isfinite(b.o).all() and torch.isfinite(b.final_state).all()
    assert (a.o - b.o).abs().max().item() <= 1e-5
    assert (a.final_state - b.final_state).abs().max().item() <= 1e-5


@pytest.mark.parametrize("backend", BACKENDS)
def test_decode_bad_inputs_leave_states_unchanged(backend):
    q, k, v, g, beta = _inputs(2, 2, 8, 8, torch.float32)
    states = torch.randn(4, 2, 8, 8)
    before = states.clone()
    good = dict(q=q, k=k, v=v, g=g, beta=beta, ssm_states=states, cache_indices=torch.tensor([1, 2]))
    cases = [
        (dict(cache_indices=torch.tensor([1])), LengthMismatchError),
        (dict(cache_indices=torch.tensor([1, 4])), InvalidIndexError),
        (dict(cache_indices=torch.tensor([2, 2])), InvalidArgumentError),
        (dict(cache_indices=torch.tensor([1.0, 2.0])), InvalidArgumentError),
        (dict(k=k[:, :, :4]), InvalidArgumentError),
        (dict(beta=beta[:, :1]), InvalidArgumentError),
        (dict(v=v.double()), InvalidArgumentError),
        (dict(q=q[0]), InvalidArgumentError),
        (dict(ssm_states=states[:, :1]), InvalidArgumentError),
    ]
    for change, err in cases:
        args = dict(good)
        args.update(change)
        with pytest.raises(err):
            kda_decode(**args, backend=backend)
        assert torch.equal(states, before), change
