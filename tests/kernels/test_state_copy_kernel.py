"""copy_states (the state fork) and the slot-index contract: Triton (interpreter on CPU) vs
torch vs a plain per-slot model, and bad inputs that must leave every state untouched."""
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from radixkv.errors import InvalidArgumentError, InvalidIndexError, LengthMismatchError
from radixkv.kernels.state_copy import copy_states, resolve_backend, validate_slot_indices
from radixkv.kernels.triton_util import triton_runnable

BACKENDS = ["torch"] + (["triton"] if triton_runnable("cpu") else [])


def _states(layers=3, slots=7, dtype=torch.float32, device="cpu", seed=0):
    gen = torch.Generator().manual_seed(seed)
    conv = torch.randn(layers, slots + 1, 3, 20, generator=gen).to(device=device, dtype=dtype)
    temporal = torch.randn(layers, slots + 1, 2, 5, 6, generator=gen).to(device=device, dtype=dtype)
    return conv, temporal


def _model_copy(tensors, src, dst):
    """The plain model: slot by slot, reading every source before any write."""
    saved = [[t[:, s].clone() for s in src] for t in tensors]
    for t, rows in zip(tensors, saved):
        for d, row in zip(dst, rows):
            t[:, d] = row


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.int32])
def test_copy_matches_model(device, backend, dtype):
    if backend == "triton" and not triton_runnable(device):
        pytest.skip("triton not runnable here")
    conv, temporal = _states(dtype=torch.float32, device=device)
    if dtype == torch.int32:
        conv, temporal = (t.mul(100).to(dtype) for t in (conv, temporal))
    else:
        conv, temporal = conv.to(dtype), temporal.to(dtype)
    expect = [conv.clone(), temporal.clone()]
    src, dst = [1, 1, 4, 2], [3, 5, 6, 7]
    _model_copy(expect, src, dst)
    copy_states(conv, temporal, torch.tensor(src, device=device), torch.tensor(dst, device=device), backend=backend)
    assert torch.equal(conv, expect[0]) and torch.equal(temporal, expect[1])
    assert torch.equal(conv[:, 5], conv[:, 1]) and not torch.equal(conv[:, 5], conv[:, 2])


@pytest.mark.parametrize("backend", BACKENDS)
def test_conv_as_list_and_no_temporal(backend):
    conv, temporal = _states()
    other = conv.clone() * 2
    before_t = temporal.clone()
    copy_states([conv, other], None, torch.tensor([2], dtype=torch.int32), torch.tensor([6]), backend=backend)
    assert torch.equal(conv[:, 6], conv[:, 2]) and torch.equal(other[:, 6], other[:, 2])
    assert torch.equal(temporal, before_t)


@pytest.mark.parametrize("backend", BACKENDS)
def test_large_state_spans_several_programs(backend):
    # 2 * 160 * 257 = 82,240 elements per slot > one program's chunk (65,536) -> split grid
    temporal = torch.randn(2, 4, 2, 160, 257)
    conv = torch.randn(2, 4, 3, 7)
    expect = [conv.clone(), temporal.clone()]
    _model_copy(expect, [3], [1])
    copy_states(conv, temporal, torch.tensor([3]), torch.tensor([1]), backend=backend)
    assert torch.equal(temporal, expect[1]) and torch.equal(conv, expect[0])


@given(pairs=st.lists(st.tuples(st.integers(1, 9), st.integers(1, 9)), max_size=6), seed=st.integers(0, 3))
def test_random_forks_triton_equals_torch_equals_model(pairs, seed):
    src = [s for s, _ in pairs]
    dst = []
    for _, d in pairs:  # make dst distinct and disjoint from src, as the contract requires
        if d not in dst and d not in src:
            dst.append(d)
    src = src[: len(dst)]
    conv, temporal = _states(slots=9, dtype=torch.float64, seed=seed)
    expect = [conv.clone(), temporal.clone()]
    _model_copy(expect, src, dst)
    results = []
    for backend in BACKENDS:
        c, t = conv.clone(), temporal.clone()
        copy_states(c, t, torch.tensor(src, dtype=torch.int64), torch.tensor(dst, dtype=torch.int64), backend=backend)
        results.append((c, t))
    for c, t in results:
        assert torch.equal(c, expect[0]) and torch.equal(t, expect[1])


@pytest.mark.parametrize(
    "src, dst, err",
    [
        ([1, 2], [3], LengthMismatchError),
        ([0], [3], InvalidIndexError),  # padding slot as source
        ([1], [0], InvalidIndexError),  # padding slot as destination
        ([1], [8], InvalidIndexError),  # past the last slot
        ([-1], [3], InvalidIndexError),
        ([1, 2], [3, 3], InvalidArgumentError),  # a destination twice
        ([1, 2], [2, 3], InvalidArgumentError),  # slot 2 both read and written
    ],
)
@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_indices_leave_states_unchanged(src, dst, err, backend):
    conv, temporal = _states()
    before = conv.clone(), temporal.clone()
    with pytest.raises(err):
        copy_states(conv, temporal, torch.tensor(src), torch.tensor(dst), backend=backend)
    assert torch.equal(conv, before[0]) and torch.equal(temporal, before[1])


def test_bad_tensors_and_backends():
    conv, temporal = _states()
    with pytest.raises(InvalidArgumentError):  # float indices
        copy_states(conv, temporal, torch.tensor([1.0]), torch.tensor([2.0]))
    with pytest.raises(InvalidArgumentError):  # slot axes differ
        copy_states(conv, temporal[:, :5], torch.tensor([1]), torch.tensor([2]))
    with pytest.raises(InvalidArgumentError):  # layer counts differ
        copy_states(conv, temporal[:2], torch.tensor([1]), torch.tensor([2]))
    with pytest.raises(InvalidArgumentError):
        copy_states([], None, torch.tensor([1]), torch.tensor([2]))
    with pytest.raises(InvalidArgumentError):
        copy_states(conv, temporal, torch.tensor([1]), torch.tensor([2]), backend="cuda-graph")


def test_non_contiguous_state_explicit_triton_raises_auto_uses_torch():
    base = torch.randn(2, 5, 4, 6)
    strided = base.transpose(2, 3)  # per-slot state no longer one contiguous block
    before = strided.clone()
    if triton_runnable("cpu"):
        with pytest.raises(InvalidArgumentError):
            copy_states(strided, None, torch.tensor([1]), torch.tensor([2]), backend="triton")
        assert torch.equal(strided, before)
    copy_states(strided, None, torch.tensor([1]), torch.tensor([2]))  # default on CPU: torch
    assert torch.equal(strided[:, 2], before[:, 1])


def test_validate_slot_indices_contract():
    dev = torch.device("cpu")
    out = validate_slot_indices(torch.tensor([0, 0, 3], dtype=torch.int32), 4, name="i", device=dev)
    assert out.dtype == torch.int64 and out.tolist() == [0, 0, 3]  # padding may repeat
    with pytest.raises(InvalidArgumentError, match=r"repeats slots \[3\]"):
        validate_slot_indices(torch.tensor([3, 1, 3]), 4, name="i", device=dev)
    with pytest.raises(InvalidIndexError, match=r"\[4\]"):
        validate_slot_indices(torch.tensor([4]), 4, name="i", device=dev)
    with pytest.raises(InvalidIndexError):
        validate_slot_indices(torch.tensor([0]), 4, name="i", device=dev, allow_padding=False)
    with pytest.raises(InvalidArgumentError):
        validate_slot_indices(torch.tensor([[1]]), 4, name="i", device=dev)
    assert resolve_backend(None, dev) == "torch"  # CPU default
