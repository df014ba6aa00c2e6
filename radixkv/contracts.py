"""The contracts between radixkv's layers: read this module first.

The layers (bottom to top): ``errors``/``validation``/``contracts`` <- ``kernels`` <-
``allocator`` <- ``memory`` <- ``cache`` <- ``scheduler`` <- ``engine`` <- ``service``.
Code that takes an object of another layer names it by a ``Protocol`` here, not by its
concrete class (the engine and a pool's own free list excepted); ``tests/package/test_contracts.py``
checks that the concrete classes satisfy them, statically (mypy) and at run time. Which
SGLang class each Protocol stands for, and why: ``docs/internals.md`` ("The layer contracts").

Conventions every implementation keeps: ids are int64 tensors on the object's ``device``
(0 is the reserved padding slot / row / page); tokens are int32 numpy arrays; a call that
raises (a :mod:`radixkv.errors` type) leaves the object unchanged; ``check_invariants()``
raises ``InvariantError`` naming the exact leaked or double-freed ids.

This module imports only typing and numpy (torch for annotations only): any layer may import it.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any, Protocol, TypeAlias, runtime_checkable

import numpy as np

if TYPE_CHECKING:  # annotations only: importing the contracts never loads torch (~1.5 CPU-s)
    import torch

__all__ = [
    "IndexLike", "LayerLike", "HasLayerId", "Scale", "TableIndex",
    "KVAllocator", "PagedKVAllocator",
    "PoolRequest", "CacheRequest", "ReqToTokenTable", "HybridReqTable",
    "KVPool", "StatePool", "SlotFreeList", "Event", "PrefixMatch", "PrefixCache", "HybridPrefixCache",
    "StorageBackend", "ScatterStorageBackend", "PageBuffers", "WRITE_POLICIES", "STORAGE_ADMIT",
]

#: The host tier's write policies (SGLang HiCache's names): ``write_back`` copies a page to
#: the host when the device evicts it, ``write_through`` when it is inserted.
WRITE_POLICIES: tuple[str, ...] = ("write_back", "write_through")

#: Storage admission: ``all`` backs up every inserted page, ``reused`` a page once it is hit again.
STORAGE_ADMIT: tuple[str, ...] = ("all", "reused")

#: Ids as the pools and allocators accept them: an integer tensor or numpy array (any
#: shape, flattened), one int, or (pools only) a sequence of ints.
IndexLike: TypeAlias = "torch.Tensor | np.ndarray | int | Sequence[int]"


class HasLayerId(Protocol):
    """A layer object such as SGLang's ``RadixAttention``."""

    @property
    def layer_id(self) -> int: ...


#: A layer: its id, or an object with a ``layer_id``.
LayerLike = int | HasLayerId

#: A quantisation scale the K / V values are divided by before they are stored.
Scale: TypeAlias = "float | torch.Tensor"

#: An index into the request table as torch takes it: a row, or ``(rows, columns)`` with
#: each part an int, a slice or an integer tensor.
TablePart: TypeAlias = "int | slice | torch.Tensor"
TableIndex: TypeAlias = "TablePart | tuple[TablePart, ...]"

#: Where a storage read puts pages: per page, a list of contiguous uint8 CPU tensors or writable
#: byte memoryviews (cheaper to check) whose sizes sum to ``page_bytes`` (e.g. the page's
#: host-pool row), filled in order.
PageBuffers: TypeAlias = "Sequence[Sequence[torch.Tensor | memoryview]]"


# --------------------------------------------------------------------------- allocators


@runtime_checkable
class KVAllocator(Protocol):
    """KV slot ids ``1..size`` (page 0 reserved) handed out and taken back; bookkeeping
    only, the buffers live in a :class:`KVPool`. Used by the tree (``free``, ``is_free``,
    ``device``), the scheduler (``alloc``, ``available_size``, ``backup_state``) and the
    engine (everything)."""

    @property
    def size(self) -> int:
        """Usable slots (``num_pages * page_size``)."""
    @property
    def page_size(self) -> int: ...
    @property
    def device(self) -> torch.device: ...

    def available_size(self) -> int:
        """Free slots, counting those pending release. O(1)."""
    def alloc(self, need_size: int) -> torch.Tensor | None:
        """``need_size`` slots (whole pages when paged), or ``None`` when too few are free
        (then nothing changes)."""
    def free(self, free_index: IndexLike) -> None:
        """Give slots back (inside a free group: at :meth:`free_group_end`). Raises
        ``InvalidIndexError`` / ``DoubleFreeError`` naming the bad ids."""
    def is_free(self, indices: IndexLike) -> torch.Tensor:
        """A bool tensor: whether each slot is not in use."""
    def free_group_begin(self) -> None: ...
    def free_group_end(self) -> None: ...
    def backup_state(self) -> object:
        """An opaque snapshot for :meth:`restore_state` (the undo of a failed step)."""
    def restore_state(self, state: Any) -> None:
        """Return to a snapshot taken by :meth:`backup_state` (``state`` is opaque)."""
    def clear(self) -> None: ...
    def check_invariants(self) -> None: ...


@runtime_checkable
class PagedKVAllocator(KVAllocator, Protocol):
    """A :class:`KVAllocator` with pages: extend and decode allocate only the pages a
    request does not already touch (SGLang's ``alloc_extend`` / ``alloc_decode``)."""

    def alloc_extend(self, prefix_lens: torch.Tensor, seq_lens: torch.Tensor, last_loc: torch.Tensor,
                     extend_num_tokens: int) -> torch.Tensor | None: ...
    def alloc_decode(self, seq_lens: torch.Tensor, last_loc: torch.Tensor) -> torch.Tensor | None: ...


# --------------------------------------------------------------------------- requests


class PoolRequest(Protocol):
    """What the request table reads and writes of a request (``Req`` and its subclasses)."""

    rid: str
    req_pool_idx: int | None
    mamba_pool_idx: int | None
    # the track buffer of a hybrid row (radixkv.scheduler.track); None / 0 / None without one
    mamba_ping_pong_track_buffer: list[int] | None
    mamba_next_track_idx: int
    mamba_last_track_seqlen: int | None


class CacheRequest(PoolRequest, Protocol):
    """What the tree reads and writes of a request in ``cache_finished_req`` /
    ``cache_unfinished_req``."""

    extra_key: str | None
    priority: int
    prefix_indices: torch.Tensor | None
    last_node: Any  # the tree's node type: the tree layer names it
    kv_committed_len: int
    cache_protected_len: int

    @property
    def fill_ids(self) -> np.ndarray:
        """Prompt plus output tokens (int32)."""


# --------------------------------------------------------------------------- request table


@runtime_checkable
class ReqToTokenTable(Protocol):
    """The ``[size + 1, max_context_len]`` int32 table of KV slot ids, one row per running
    request (row 0 reserved), and its free rows."""

    @property
    def size(self) -> int: ...
    @property
    def max_context_len(self) -> int: ...
    @property
    def device(self) -> torch.device: ...
    @property
    def req_to_token(self) -> torch.Tensor: ...

    def available_size(self) -> int:
        """Free rows."""
    def alloc(self, reqs: Iterable[PoolRequest]) -> list[int] | None:
        """A row for each request without one (all or nothing); ``None`` when too few."""
    def free(self, req: PoolRequest) -> None:
        """Free the request's row and set its ``req_pool_idx`` to ``None``."""
    def write(self, indices: TableIndex, values: torch.Tensor | int) -> None:
        """``req_to_token[indices] = values`` with range checks (``indices`` as for a
        tensor: a row, or a ``(rows, columns)`` tuple of ints, slices and tensors)."""
    def clear(self) -> None: ...
    def check_invariants(self, reqs: Iterable[PoolRequest] | None = None) -> None: ...


@runtime_checkable
class HybridReqTable(ReqToTokenTable, Protocol):
    """A :class:`ReqToTokenTable` whose rows also own a Mamba state slot each."""

    @property
    def mamba_pool(self) -> StatePool: ...
    @property
    def req_index_to_mamba_index_mapping(self) -> torch.Tensor: ...

    def free(self, req: PoolRequest, free_mamba_cache: bool = True) -> None:
        """Free the row; its state slot too unless ``free_mamba_cache`` is False (the tree
        took it)."""
    def get_mamba_indices(self, req_pool_indices: IndexLike) -> torch.Tensor: ...


# --------------------------------------------------------------------------- the tree (as the scheduler sees it)


class PrefixMatch(Protocol):
    """What ``match_prefix`` returns (``MatchResult``): the KV slots of the longest cached
    prefix and the node to lock for it."""

    @property
    def device_indices(self) -> torch.Tensor: ...
    @property
    def last_node(self) -> Any: ...  # the tree's node type: the tree layer names it


class PrefixCache(Protocol):
    """The radix tree over the pools, as the scheduler flow uses it: match and lock a
    request's prefix, evict unlocked leaves, take a finished request's KV."""

    # A tree can run without pools (a hit-rate replay: None); the scheduler's tree has both.
    @property
    def req_to_token_pool(self) -> ReqToTokenTable | None: ...
    @property
    def token_to_kv_pool_allocator(self) -> KVAllocator | None: ...

    def match_prefix(self, key: Any) -> PrefixMatch:
        """The longest cached page-aligned prefix of ``key`` (a ``RadixKey``)."""
    def inc_lock_ref(self, node: Any) -> int: ...
    def dec_lock_ref(self, node: Any) -> int: ...
    def evict(self, num_tokens: int) -> object:
        """Free at least ``num_tokens`` KV slots of unlocked leaves (fewer when it runs out)."""
    def evictable_size(self) -> int: ...
    def protected_size(self) -> int: ...
    def all_values(self) -> torch.Tensor:
        """Every KV slot the tree holds (int64)."""
    def cache_finished_req(self, req: CacheRequest) -> bool | None:
        """Insert a finished request's KV, free duplicates, unlock; True when the tree kept
        its Mamba slot (hybrid trees)."""


class HybridPrefixCache(PrefixCache, Protocol):
    """A :class:`PrefixCache` that also holds Mamba states at its nodes."""

    def evict(self, num_tokens: int, num_states: int = 0) -> object: ...
    def mamba_evictable_size(self) -> int: ...
    def fork_states(self, nodes: Sequence[Any], reqs: Sequence[PoolRequest]) -> int:
        """Copy each node's state into its request's own slot."""


# --------------------------------------------------------------------------- events


class Event(Protocol):
    """A KV or state event the tree records (``BlockStored``, ``StateRemoved``, ...)."""

    def to_dict(self) -> dict[str, Any]:
        """The event as a JSON-able dict (its ``type`` names the kind)."""


# --------------------------------------------------------------------------- pools (device memory)


@runtime_checkable
class KVPool(Protocol):
    """Per-layer K and V buffers indexed by the slots a :class:`KVAllocator` hands out."""

    @property
    def device(self) -> torch.device: ...
    @property
    def nbytes(self) -> int: ...

    def get_key_buffer(self, layer_id: LayerLike) -> torch.Tensor: ...
    def get_value_buffer(self, layer_id: LayerLike) -> torch.Tensor: ...
    def get_kv_buffer(self, layer_id: LayerLike) -> tuple[torch.Tensor, torch.Tensor]: ...
    def set_kv_buffer(self, layer: LayerLike, loc: IndexLike, cache_k: torch.Tensor,
                      cache_v: torch.Tensor, k_scale: Scale | None = None,
                      v_scale: Scale | None = None) -> None:
        """Write the K and V rows of the tokens at slots ``loc`` of one layer."""
    def check_invariants(self) -> None: ...


class SlotFreeList(Protocol):
    """The free list of a :class:`StatePool`'s slots (``FreeSlots``), as the tree reads it to
    check that a slot handed to it is allocated."""

    def is_free(self, ids: IndexLike) -> torch.Tensor:
        """A bool tensor (flat, on the pool's device): whether each of ``ids`` is free."""
    def free_among(self, ids: Sequence[int]) -> list[int]:
        """The ids among ``ids`` that are free, in their order (a host read on CPU)."""
    def is_free_one(self, i: int) -> bool:
        """Whether the one slot ``i`` is free."""


@runtime_checkable
class StatePool(Protocol):
    """Linear-attention state slots ``1..size`` (slot 0 reserved): per layer a conv window
    and a temporal state, allocated per request and kept by the tree for cached prefixes."""

    @property
    def size(self) -> int: ...
    @property
    def device(self) -> torch.device: ...
    @property
    def num_layers(self) -> int: ...
    @property
    def conv_state(self) -> torch.Tensor:
        """``[num_layers, size + 1, *conv_state_shape]``."""
    @property
    def temporal_state(self) -> torch.Tensor:
        """``[num_layers, size + 1, *temporal_state_shape]``."""
    @property
    def conv_state_shape(self) -> tuple[int, ...]: ...
    @property
    def temporal_state_shape(self) -> tuple[int, ...]: ...
    @property
    def slot_bytes(self) -> tuple[int, int]:
        """Bytes of one slot's ``(conv, temporal)`` states in one layer."""
    @property
    def copy_backend(self) -> str:
        """How state copies run: ``"torch"`` or ``"triton"``."""
    @property
    def free_slots(self) -> SlotFreeList:
        """The slots' free list (read-only use: the tree checks the slots it is given)."""

    def available_size(self) -> int: ...
    def alloc(self, n: int) -> torch.Tensor | None: ...
    def alloc_one(self) -> int | None: ...
    def free(self, indices: IndexLike) -> None: ...
    def validate_allocated(self, indices: IndexLike, what: str = "slot") -> torch.Tensor:
        """The slots as an int64 tensor; ``InvalidArgumentError`` naming any that are free."""
    def copy_from(self, src_indices: IndexLike, dst_indices: IndexLike) -> None:
        """Copy every layer's states of ``src`` slots into ``dst`` slots."""
    def mamba2_layer_cache(self, layer_id: LayerLike) -> tuple[list[torch.Tensor], torch.Tensor]:
        """One layer's ``(conv, temporal)`` views (SGLang's ``Mamba2LayerCache``)."""
    def clear(self) -> None: ...
    def check_invariants(self) -> None: ...


@runtime_checkable
class StorageBackend(Protocol):
    """The storage tier (L3): whole pages by key, modelled on SGLang's ``HiCacheStorage`` v1.

    A key names one page (``radixkv.storage.keys.page_keys``: chained SHA-256 of the page's
    tokens, seeded with the namespace and the KV layout's fingerprint). A page travels as one
    contiguous row of bytes of a host buffer: ``src`` / ``dst`` are uint8 CPU tensors of shape
    ``[len(keys), page_bytes]``, rows of the buffer given to :meth:`register_buffer` when the
    backend copies zero-copy. A page read back is bit-equal to the one written, or it is a miss
    (``False``): a backend never returns partial or foreign bytes, and never raises for a
    missing, corrupt or unreachable page (it counts it). Calls may block on I/O: the tier
    controller runs them off the caller's path.
    """

    @property
    def name(self) -> str:
        """The backend's URL scheme (``file``, ``mooncake``, ...), for logs and metrics."""

    def register_buffer(self, buffer: torch.Tensor) -> None:
        """The host buffer (uint8, CPU) that ``src`` / ``dst`` rows will be views of."""
    def batch_exists(self, keys: Sequence[str]) -> int:
        """How many of ``keys``, from the first, are present (stops at the first absent)."""
    def batch_get(self, keys: Sequence[str], dst: torch.Tensor) -> list[bool]:
        """Read each page into its row of ``dst``; ``True`` where the row now holds it."""
    def batch_set(self, keys: Sequence[str], src: torch.Tensor) -> list[bool]:
        """Write each row of ``src`` under its key; ``True`` where it is stored."""
    def close(self) -> None:
        """Flush and release the backend; later calls miss."""


@runtime_checkable
class ConcurrentStorageBackend(StorageBackend, Protocol):
    """A :class:`StorageBackend` whose batch calls may run at once from several threads, each
    about as fast as alone (no lock around them): a controller splits large batches over
    threads (``StorageController(read_threads=N)``)."""

    concurrent_calls: bool


@runtime_checkable
class ScatterStorageBackend(StorageBackend, Protocol):
    """A :class:`StorageBackend` whose ``batch_get`` also reads each page straight into its
    own buffers (:data:`PageBuffers`, e.g. host-pool rows): no staging rows, no second copy.
    A ``False`` page's buffers hold no page (the caller gives them back)."""

    scatter_reads: bool

    def batch_get(self, keys: Sequence[str], dst: torch.Tensor | PageBuffers) -> list[bool]:
        """Read each page into its row of ``dst`` or its list of buffers."""
