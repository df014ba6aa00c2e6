"""One contiguous allocation per pool, carved into typed, aligned views.

A pool (the request-to-token table, a KV pool, a Mamba state pool) describes the tensors it
needs as ``(name, shape, dtype)`` entries. :func:`plan_layout` turns them into an
:class:`ArenaLayout`: a plain, serializable description (names, dtypes, shapes, byte
offsets) of where each tensor lives inside one flat ``uint8`` buffer. :class:`Arena` either
allocates that buffer on a device or *attaches* to a buffer the caller passes in (a
shared-memory file mapped on CPU, a CUDA IPC handle opened on GPU), then builds every
tensor as a view of it (``buffer[offset:offset + nbytes].view(dtype).view(shape)``): no
copies, and every write through a view lands in the one buffer.

Sharing a pool with another process therefore needs two things only: the bytes (one block
of memory) and ``layout.to_dict()`` (plain ints and strings, JSON-able). The other process
calls ``Arena(ArenaLayout.from_dict(d), buffer=its_mapping_of_the_same_bytes)`` and gets
views over the same memory with identical names, shapes and dtypes.
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, NamedTuple

import torch

from radixkv.errors import AlignmentError, InvalidArgumentError, InvariantError

DEFAULT_ALIGNMENT = 256  # bytes; a CUDA-friendly boundary, a multiple of every dtype's size

DTypeLike = torch.dtype | str


def dtype_name(dtype: DTypeLike) -> str:
    """The serializable name of a torch dtype (``torch.float16`` -> ``"float16"``)."""
    return str(parse_dtype(dtype)).replace("torch.", "")


def parse_dtype(dtype: DTypeLike) -> torch.dtype:
    """A torch dtype from a dtype or its name (``"float16"`` / ``"torch.float16"``).

    Raises:
        InvalidArgumentError: not a torch dtype name.
    """
    if isinstance(dtype, torch.dtype):
        return dtype
    if isinstance(dtype, str):
        found = getattr(torch, dtype.replace("torch.", ""), None)
        if isinstance(found, torch.dtype):
            return found
    raise InvalidArgumentError(f"not a torch dtype: {dtype!r}")


class TensorSpec(NamedTuple):
    """Where one named tensor lives in an arena (all plain ints / strings)."""

    name: str
    dtype: str  # torch dtype name, e.g. "float16"
    shape: tuple[int, ...]
    offset: int  # bytes from the start of the arena buffer
    nbytes: int

    @property
    def torch_dtype(self) -> torch.dtype:
        return parse_dtype(self.dtype)


class ArenaLayout(NamedTuple):
    """The full description of an arena: its tensors, total size and alignment.

    ``to_dict()`` / ``from_dict()`` round-trip it through plain Python data (JSON-able), which
    is what another process needs to rebuild identical views over the same bytes.
    """

    specs: tuple[TensorSpec, ...]
    total_bytes: int
    alignment: int

    def spec(self, name: str) -> TensorSpec:
        """The spec named ``name``. Raises ``InvalidArgumentError`` if there is none."""
        for s in self.specs:
            if s.name == name:
                return s
        raise InvalidArgumentError(f"arena layout has no tensor named {name!r}")

    def names(self) -> tuple[str, ...]:
        return tuple(s.name for s in self.specs)

    def to_dict(self) -> dict[str, Any]:
        """Plain-data form: ``{"alignment", "total_bytes", "tensors": [{name, dtype, shape,
        offset, nbytes}, ...]}``."""
        return {
            "alignment": int(self.alignment),
            "total_bytes": int(self.total_bytes),
            "tensors": [
                {
                    "name": s.name,
                    "dtype": s.dtype,
                    "shape": [int(d) for d in s.shape],
                    "offset": int(s.offset),
                    "nbytes": int(s.nbytes),
                }
                for s in self.specs
            ],
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ArenaLayout:
        """Rebuild a layout from ``to_dict()`` output, validating it (see :meth:`validate`)."""
        try:
            specs = tuple(
                TensorSpec(
                    name=str(t["name"]),
                    dtype=dtype_name(t["dtype"]),
                    shape=tuple(int(x) for x in t["shape"]),
                    offset=int(t["offset"]),
                    nbytes=int(t["nbytes"]),
                )
                for t in d["tensors"]
            )
            layout = cls(specs=specs, total_bytes=int(d["total_bytes"]), alignment=int(d["alignment"]))
        except (KeyError, TypeError, ValueError) as e:
            if isinstance(e, InvalidArgumentError):
                raise
            raise InvalidArgumentError(f"malformed arena layout: {e!r}") from None
        layout.validate()
        return layout

    def validate(self) -> None:
        """Check the layout is self-consistent.

        Raises:
            AlignmentError: alignment not a power of two, smaller than a dtype's item size, or
                an offset not a multiple of it.
            InvalidArgumentError: duplicate names, negative dims, ``nbytes`` not matching
                shape x item size, a tensor past ``total_bytes``, or two tensors overlapping.
        """
        _check_alignment(self.alignment)
        seen = set()
        for s in self.specs:
            if s.name in seen:
                raise InvalidArgumentError(f"duplicate tensor name {s.name!r} in arena layout")
            seen.add(s.name)
            dt = parse_dtype(s.dtype)
            if any(d < 0 for d in s.shape):
                raise InvalidArgumentError(f"tensor {s.name!r}: negative dimension in {s.shape}")
            if dt.itemsize > self.alignment:
                raise AlignmentError(
                    f"tensor {s.name!r}: item size {dt.itemsize} exceeds alignment {self.alignment}")
            if s.offset < 0 or s.offset % self.alignment:
                raise AlignmentError(
                    f"tensor {s.name!r}: offset {s.offset} is not a multiple of {self.alignment}")
            if s.nbytes != math.prod(s.shape) * dt.itemsize:
                raise InvalidArgumentError(
                    f"tensor {s.name!r}: nbytes {s.nbytes} != prod{s.shape} * {dt.itemsize}")
            if s.offset + s.nbytes > self.total_bytes:
                raise InvalidArgumentError(
                    f"tensor {s.name!r}: bytes [{s.offset}, {s.offset + s.nbytes}) exceed "
                    f"total_bytes {self.total_bytes}")
        spans = sorted((s.offset, s.offset + s.nbytes, s.name) for s in self.specs if s.nbytes)
        for (_a0, a1, an), (b0, _b1, bn) in zip(spans, spans[1:]):
            if b0 < a1:
                raise InvalidArgumentError(f"tensors {an!r} and {bn!r} overlap in the arena layout")


def _check_alignment(alignment: int) -> None:
    if not isinstance(alignment, int) or alignment < 1 or alignment & (alignment - 1):
        raise AlignmentError(f"alignment must be a power of two >= 1, got {alignment!r}")


def _round_up(x: int, a: int) -> int:
    return (x + a - 1) // a * a


def plan_layout(
    entries: Iterable[tuple[str, Sequence[int], DTypeLike]],
    alignment: int = DEFAULT_ALIGNMENT,
) -> ArenaLayout:
    """Pack ``(name, shape, dtype)`` entries, in order, each at an ``alignment``-byte boundary.

    O(number of entries). Raises ``AlignmentError`` / ``InvalidArgumentError`` as
    :meth:`ArenaLayout.validate` does.
    """
    _check_alignment(alignment)
    specs = []
    offset = 0
    for name, shape, dtype in entries:
        shape = tuple(int(d) for d in shape)
        dt = parse_dtype(dtype)
        nbytes = math.prod(shape) * dt.itemsize
        offset = _round_up(offset, alignment)
        specs.append(TensorSpec(str(name), dtype_name(dt), shape, offset, nbytes))
        offset += nbytes
    layout = ArenaLayout(tuple(specs), _round_up(offset, alignment), alignment)
    layout.validate()
    return layout


class Arena:
    """One flat ``uint8`` buffer on one device, and typed views of it named by a layout.

    ``Arena(layout, device)`` allocates ``layout.total_bytes`` (zero-filled, aligned);
    ``Arena(layout, buffer=t)`` attaches to the caller's buffer (1-D contiguous, at least
    ``total_bytes``, aligned) and leaves its bytes as they are: how a second process maps a pool
    another one created. Every view is O(1), no copies.

    Raises (constructor):
        InvalidArgumentError: the buffer is not a 1-D contiguous tensor, is too small, or lives
            on a different device than ``device`` (when both are given).
        AlignmentError: the buffer's start is not aligned to ``layout.alignment``.
    """

    def __init__(self, layout: ArenaLayout, device: str | torch.device | None = None,
                 buffer: torch.Tensor | None = None):
        layout.validate()
        self.layout = layout
        if buffer is None:
            self.device = torch.device(device if device is not None else "cpu")
            a = layout.alignment
            raw = torch.zeros(layout.total_bytes + a, dtype=torch.uint8, device=self.device)
            start = (-raw.data_ptr()) % a
            self._raw = raw
            self.buffer = raw[start:start + layout.total_bytes]
        else:
            self.buffer = self._attach(layout, buffer, device)
            self._raw = buffer
            self.device = self.buffer.device
        self.views: dict[str, torch.Tensor] = {
            s.name: self.buffer[s.offset:s.offset + s.nbytes].view(s.torch_dtype).view(s.shape)
            for s in layout.specs
        }

    @staticmethod
    def _attach(layout: ArenaLayout, buffer: torch.Tensor, device: str | torch.device | None) -> torch.Tensor:
        if not isinstance(buffer, torch.Tensor):
            raise InvalidArgumentError(f"arena buffer must be a torch.Tensor, got {type(buffer).__name__}")
        if buffer.dim() != 1 or not buffer.is_contiguous():
            raise InvalidArgumentError(
                f"arena buffer must be 1-D and contiguous, got shape {tuple(buffer.shape)}")
        if device is not None and torch.device(device) != buffer.device:
            want = torch.device(device)
            # "cuda" and "cuda:0" name the same device when the buffer is on the current one
            if not (want.type == buffer.device.type and want.index is None):
                raise InvalidArgumentError(f"arena buffer is on {buffer.device}, expected {want}")
        raw = buffer.view(torch.uint8) if buffer.dtype != torch.uint8 else buffer
        if raw.numel() < layout.total_bytes:
            raise InvalidArgumentError(
                f"arena buffer has {raw.numel()} bytes, layout needs {layout.total_bytes}")
        if raw.data_ptr() % layout.alignment:
            raise AlignmentError(
                f"arena buffer start is not aligned to {layout.alignment} bytes")
        return raw[:layout.total_bytes]

    def __getitem__(self, name: str) -> torch.Tensor:
        try:
            return self.views[name]
        except KeyError:
            raise InvalidArgumentError(f"arena has no tensor named {name!r}") from None

    def __contains__(self, name: str) -> bool:
        return name in self.views

    def __iter__(self) -> Iterator[str]:
        return iter(self.views)

    @property
    def nbytes(self) -> int:
        """Bytes of the arena (the layout's ``total_bytes``, alignment padding included)."""
        return self.layout.total_bytes

    def data_ptr(self) -> int:
        return self.buffer.data_ptr()

    def check_invariants(self) -> None:
        """Every view still aliases its slice of the buffer with the layout's shape and dtype.

        Raises ``InvariantError`` naming the offending tensors.
        """
        base = self.buffer.data_ptr()
        storage = self.buffer.untyped_storage().data_ptr()
        bad = []
        for s in self.layout.specs:
            v = self.views.get(s.name)
            if (v is None or tuple(v.shape) != s.shape or v.dtype != s.torch_dtype
                    or (s.nbytes and (v.data_ptr() != base + s.offset
                                      or v.untyped_storage().data_ptr() != storage))):
                bad.append(s.name)
        extra = sorted(set(self.views) - set(self.layout.names()))
        if bad or extra:
            raise InvariantError(f"arena views out of layout: {bad} ; views not in layout: {extra}")
        if self.buffer.numel() != self.layout.total_bytes:
            raise InvariantError(
                f"arena buffer has {self.buffer.numel()} bytes, layout says {self.layout.total_bytes}")

    def __repr__(self) -> str:
        return (f"Arena({len(self.layout.specs)} tensors, {self.layout.total_bytes} bytes, "
                f"device={self.device})")
