"""Causal depthwise conv1d: the decode update (torch and Triton under TRITON_INTERPRET=1), the
prefill function, and their agreement with an explicit per-tap formula and with F.conv1d."""
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

from radixkv.errors import InvalidArgumentError, InvalidIndexError, LengthMismatchError
from radixkv.kernels.triton_util import triton_runnable
from radixkv.reference.causal_conv1d import causal_conv1d_fn, causal_conv1d_update

BACKENDS = ["torch"] + (["triton"] if triton_runnable("cpu") else [])
TOL = {torch.float32: 1e-5, torch.float64: 1e-12}


def _data(batch, channels, kw, slots, dtype, device="cpu", seed=0):
    gen = torch.Generator().manual_seed(seed)
    mk = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64).to(device, dtype)  # noqa: E731
    return mk(batch, channels), mk(slots + 1, kw - 1, channels), mk(channels, kw), mk(channels)


def _explicit_update(x, state, weight, bias, activation):
    """Per-request, per-tap formula: y = bias + sum_j w[:, j] * window[j], window = state | x."""
    kw = weight.shape[1]
    ys = []
    for b in range(x.shape[0]):
        window = [state[b, j] for j in range(kw - 1)] + [x[b]]
        y = sum(weight[:, j] * window[j] for j in range(kw))
        y = y + (bias if bias is not None else 0)
        ys.append(F.silu(y) if activation == "silu" else y)
    return torch.stack(ys)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("kw, channels", [(2, 5), (3, 64), (4, 96), (4, 300)])
@pytest.mark.parametrize("activation, with_bias", [("silu", True), (None, False)])
def test_update_matches_explicit_formula(device, backend, dtype, kw, channels, activation, with_bias):
    if backend == "triton" and not triton_runnable(device):
        pytest.skip("triton not runnable here")
    x, state, weight, bias = _data(3, channels, kw, 6, dtype, device)
    bias = bias if with_bias else None
    idx = torch.tensor([5, 2, 0], device=device)  # 0: a padded batch entry
    untouched = state[[1, 3, 4, 6]].clone()
    expect_y = _explicit_update(x, state[idx], weight, bias, activation)
    expect_state = torch.cat([state[idx][:, 1:], x[:, None]], dim=1)
    y = causal_conv1d_update(x, state, weight, bias, activation, idx, backend=backend)
    assert y.dtype == dtype and y.shape == x.shape
    assert (y - expect_y).abs().max().item() <= TOL[dtype]
    assert torch.equal(state[idx], expect_state)  # exact: a shift is a copy
    assert torch.equal(state[[1, 3, 4, 6]], untouched)


@pytest.mark.skipif(len(BACKENDS) < 2, reason="needs the Triton interpreter")
@given(seed=st.integers(0, 10**6), kw=st.integers(2, 5), channels=st.integers(1, 70), batch=st.integers(1, 5))
def test_triton_equals_torch_random(seed, kw, channels, batch):
    slots = 6
    x, state, weight, bias = _data(batch, channels, kw, slots, torch.float64, seed=seed)
    idx = torch.randperm(slots, generator=torch.Generator().manual_seed(seed))[:batch] + 1
    s_torch, s_triton = state.clone(), state.clone()
    y_torch = causal_conv1d_update(x, s_torch, weight, bias, "silu", idx, backend="torch")
    y_triton = causal_conv1d_update(x, s_triton, weight, bias, "silu", idx, backend="triton")
    assert (y_torch - y_triton).abs().max().item() <= 1e-12
    assert torch.equal(s_torch, s_triton)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_fn_matches_conv1d_and_chains(device, dtype):
    T, C, kw = 23, 12, 4
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(T, C, generator=gen, dtype=torch.float64).to(device, dtype)
    weight = torch.randn(C, kw, generator=gen, dtype=torch.float64).to(device, dtype)
    bias = torch.randn(C, generator=gen, dtype=torch.float64).to(device, dtype)
    whole = causal_conv1d_fn(x, weight, bias, None, "silu")
    direct = F.silu(F.conv1d(x.t()[None], weight[:, None], bias, padding=kw - 1, groups=C)[0, :, :T].t())
    assert (whole.y - direct).abs().max().item() <= TOL[dtype]
    assert torch.equal(whole.final_state, x[-(kw - 1):])
    # chained calls (including pieces shorter than K-1) equal one call
    state, ys = None, []
    for a, b in [(0, 1), (1, 2), (2, 9), (9, 23)]:
        out = causal_conv1d_fn(x[a:b], weight, bias, state, "silu")
        ys.append(out.y)
        state = out.final_state
    assert (torch.cat(ys) - whole.y).abs().max().item() <= TOL[dtype]
    assert torch.equal(state, whole.final_state)


@pytest.mark.parametrize("backend", BACKENDS)
def test_decode_steps_equal_prefill(backend):
    T, C, kw = 9, 10, 4
    x, _, weight, bias = _data(T, C, kw, 1, torch.float64, seed=3)
    init = torch.randn(kw - 1, C, dtype=torch.float64)
    full = causal_conv1d_fn(x, weight, bias, init, "silu")
    state = torch.zeros(3, kw - 1, C, dtype=torch.float64)
    state[2] = init
    ys = [causal_conv1d_update(x[t:t + 1], state, weight, bias, "silu", torch.tensor([2]),
                               backend=backend) for t in range(T)]
    assert (torch.cat(ys) - full.y).abs().max().item() <= 1e-12
    assert torch.equal(state[2], full.final_state)


@pytest.mark.parametrize("backend", BACKENDS)
def test_update_bad_inputs_leave_state_unchanged(backend):
    x, state, weight, bias = _data(2, 8, 4, 4, torch.float32)
    before = state.clone()
    cases = [
        (dict(conv_state_indices=torch.tensor([1])), LengthMismatchError),
        (dict(conv_state_indices=torch.tensor([1, 5])), InvalidIndexError),
        (dict(conv_state_indices=torch.tensor([-1, 2])), InvalidIndexError),
        (dict(conv_state_indices=torch.tensor([3, 3])), InvalidArgumentError),
        (dict(conv_state_indices=torch.tensor([1.0, 2.0])), InvalidArgumentError),
        (dict(weight=weight[:, :3]), InvalidArgumentError),
        (dict(bias=bias[:4]), InvalidArgumentError),
        (dict(activation="gelu"), InvalidArgumentError),
        (dict(x=x.to(torch.int32)), InvalidArgumentError),
        (dict(conv_state=state[:, :, :4]), InvalidArgumentError),
    ]
    for change, err in cases:
        args = dict(x=x, conv_state=state, weight=weight, bias=bias, activation="silu",
                    conv_state_indices=torch.tensor([1, 2]))
        args.update(change)
        with pytest.raises(err):
            causal_conv1d_update(**args, backend=backend)
        assert torch.equal(state, before), change


def test_fn_bad_inputs():
    x = torch.randn(5, 6)
    weight = torch.randn(6, 3)
    with pytest.raises(InvalidArgumentError):
        causal_conv1d_fn(x, weight, None, torch.zeros(3, 6))  # state must be [K-1, C]
    with pytest.raises(InvalidArgumentError):
        causal_conv1d_fn(x[:, None], weight)
    with pytest.raises(InvalidArgumentError):
        causal_conv1d_fn(x, torch.randn(6, 1))  # K >= 2
    with pytest.raises(InvalidArgumentError):
        causal_conv1d_fn(x, weight, activation="relu")
