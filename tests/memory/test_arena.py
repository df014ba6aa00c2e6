"""Arena: one flat buffer, typed aligned views, a serializable layout, attach to a buffer."""
import json

import pytest
import torch

from radixkv.errors import AlignmentError, InvalidArgumentError, InvariantError
from radixkv.memory.arena import Arena, ArenaLayout, TensorSpec, plan_layout

ENTRIES = [
    ("a", (3, 5), torch.float16),
    ("b", (7,), torch.int32),
    ("c", (2, 3, 4), torch.float32),
    ("d", (5,), torch.uint8),
    ("e", (0, 4), torch.float64),
]


def test_plan_layout_offsets_aligned_and_disjoint():
    layout = plan_layout(ENTRIES, alignment=64)
    assert layout.names() == ("a", "b", "c", "d", "e")
    assert layout.total_bytes % 64 == 0
    ends = 0
    for spec, (_name, shape, dtype) in zip(layout.specs, ENTRIES):
        assert spec.offset % 64 == 0
        assert spec.offset >= ends  # in order, no overlap
        assert spec.nbytes == torch.empty(shape, dtype=dtype).nbytes
        assert spec.shape == shape and spec.torch_dtype == dtype
        ends = spec.offset + spec.nbytes
    assert ends <= layout.total_bytes


@pytest.mark.parametrize("alignment", [1, 8, 256, 4096])
def test_views_are_aligned(device, alignment):
    layout = plan_layout([(n, s, d) for n, s, d in ENTRIES if d.itemsize <= alignment], alignment)
    arena = Arena(layout, device)
    for name, view in arena.views.items():
        if view.numel():
            assert view.data_ptr() % alignment == 0, name
    arena.check_invariants()


def test_views_alias_one_buffer(device):
    arena = Arena(plan_layout(ENTRIES), device)
    assert arena.buffer.dtype == torch.uint8 and arena.buffer.dim() == 1
    assert arena.nbytes == arena.layout.total_bytes == arena.buffer.numel()
    base = arena.buffer.data_ptr()
    for spec in arena.layout.specs:
        v = arena[spec.name]
        assert tuple(v.shape) == spec.shape and v.dtype == spec.torch_dtype
        assert v.untyped_storage().data_ptr() == arena.buffer.untyped_storage().data_ptr()
        if v.numel():
            assert v.data_ptr() == base + spec.offset
    # writing through a view changes the flat buffer, at the view's bytes only
    before = arena.buffer.clone()
    arena["c"][1, 2, 3] = 1.5
    spec = arena.layout.spec("c")
    changed = torch.nonzero(arena.buffer != before).flatten().cpu()
    elem = spec.offset + (1 * 12 + 2 * 4 + 3) * 4
    assert changed.tolist() and set(changed.tolist()) <= set(range(elem, elem + 4))
    got = arena.buffer[elem:elem + 4].view(torch.float32)
    assert got.item() == 1.5
    # and writing the flat buffer shows through the view
    b = arena.layout.spec("b")
    arena.buffer[b.offset:b.offset + 4].view(torch.int32).fill_(123456)
    assert arena["b"][0].item() == 123456


def test_fresh_arena_is_zeroed(device):
    arena = Arena(plan_layout(ENTRIES), device)
    assert int(arena.buffer.count_nonzero()) == 0


def test_layout_round_trips_through_json_and_rebuilds_aliasing_views(device):
    a = Arena(plan_layout(ENTRIES, alignment=128), device)
    d = json.loads(json.dumps(a.layout.to_dict()))
    layout = ArenaLayout.from_dict(d)
    assert layout == a.layout
    b = Arena(layout, buffer=a.buffer)  # attach: same bytes, views rebuilt from the description
    for name in a:
        assert b[name].shape == a[name].shape and b[name].dtype == a[name].dtype
        if a[name].numel():
            assert b[name].data_ptr() == a[name].data_ptr()
    a["a"][2, 4] = 3.0
    assert b["a"][2, 4].item() == 3.0
    b["b"][6] = -7
    assert a["b"][6].item() == -7
    b.check_invariants()


def test_attach_does_not_zero_and_accepts_typed_buffers():
    layout = plan_layout([("x", (4,), torch.int32)], alignment=16)
    raw = torch.full((layout.total_bytes // 4,), 9, dtype=torch.int32)
    arena = Arena(layout, buffer=raw)
    assert arena["x"].tolist() == [9, 9, 9, 9]
    arena["x"][0] = 1
    assert raw[0].item() == 1


def test_two_mappings_of_one_shared_file_alias(tmp_path):
    """What a worker process does: map the same shared file and carve it with the layout."""
    layout = plan_layout(ENTRIES, alignment=256)
    path = str(tmp_path / "pool.bin")
    with open(path, "wb") as f:
        f.write(b"\0" * layout.total_bytes)
    m1 = torch.from_file(path, shared=True, size=layout.total_bytes, dtype=torch.uint8)
    m2 = torch.from_file(path, shared=True, size=layout.total_bytes, dtype=torch.uint8)
    owner = Arena(layout, buffer=m1)
    worker = Arena(ArenaLayout.from_dict(json.loads(json.dumps(layout.to_dict()))), buffer=m2)
    assert owner["c"].data_ptr() != worker["c"].data_ptr()  # two mappings ...
    owner["c"][0, 1, 2] = 42.0
    assert worker["c"][0, 1, 2].item() == 42.0  # ... of the same bytes


def test_attach_rejects_bad_buffers():
    layout = plan_layout(ENTRIES, alignment=64)
    good = Arena(layout).buffer
    with pytest.raises(InvalidArgumentError, match="bytes"):
        Arena(layout, buffer=torch.zeros(layout.total_bytes - 1, dtype=torch.uint8))
    with pytest.raises(InvalidArgumentError, match="1-D"):
        Arena(layout, buffer=torch.zeros(2, layout.total_bytes, dtype=torch.uint8))
    with pytest.raises(InvalidArgumentError, match="1-D"):
        Arena(layout, buffer=torch.zeros(2 * layout.total_bytes, dtype=torch.uint8)[::2])
    big = torch.zeros(layout.total_bytes + 64, dtype=torch.uint8)
    with pytest.raises(AlignmentError):
        Arena(layout, buffer=big[1:])
    with pytest.raises(InvalidArgumentError, match="expected meta"):
        Arena(layout, device="meta", buffer=good)
    with pytest.raises(InvalidArgumentError):
        Arena(layout, buffer=[0] * layout.total_bytes)


def _layout_dict():
    return plan_layout([("x", (4,), torch.float32), ("y", (8,), torch.int64)], alignment=32).to_dict()


@pytest.mark.parametrize(
    "mutate, error",
    [
        (lambda d: d["tensors"][1].update(offset=8), AlignmentError),  # misaligned
        (lambda d: d["tensors"][1].update(offset=0), InvalidArgumentError),  # overlaps x
        (lambda d: d["tensors"][0].update(nbytes=12), InvalidArgumentError),  # != shape * itemsize
        (lambda d: d["tensors"][0].update(dtype="float7"), InvalidArgumentError),
        (lambda d: d["tensors"][1].update(name="x"), InvalidArgumentError),  # duplicate name
        (lambda d: d.update(total_bytes=64), InvalidArgumentError),  # y past the end
        (lambda d: d.update(alignment=24), AlignmentError),  # not a power of two
        (lambda d: d["tensors"][0].update(shape=[-4]), InvalidArgumentError),
        (lambda d: d["tensors"][0].pop("offset"), InvalidArgumentError),
        (lambda d: d.update(alignment=4), AlignmentError),  # int64 needs 8
    ],
)
def test_from_dict_validates(mutate, error):
    d = _layout_dict()
    ArenaLayout.from_dict(d)  # the unmodified one is fine
    mutate(d)
    with pytest.raises(error):
        ArenaLayout.from_dict(d)


def test_plan_layout_rejects_bad_alignment():
    with pytest.raises(AlignmentError):
        plan_layout(ENTRIES, alignment=0)
    with pytest.raises(AlignmentError):
        plan_layout([("x", (2,), torch.float64)], alignment=4)
    with pytest.raises(InvalidArgumentError):
        plan_layout([("x", (2,), "not_a_dtype")])


def test_check_invariants_names_the_broken_view():
    arena = Arena(plan_layout(ENTRIES))
    arena.check_invariants()
    arena.views["c"] = arena.views["c"].clone()  # no longer aliases the buffer
    with pytest.raises(InvariantError, match="'c'"):
        arena.check_invariants()


def test_spec_lookup_errors():
    arena = Arena(plan_layout(ENTRIES))
    assert isinstance(arena.layout.spec("a"), TensorSpec)
    with pytest.raises(InvalidArgumentError):
        arena.layout.spec("zz")
    with pytest.raises(InvalidArgumentError):
        arena["zz"]
