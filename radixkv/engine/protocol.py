"""The cache-engine protocol: what a scheduler needs from the cache for one step, in batch form.

Two implementations, one contract: ``radixkv.CacheEngine`` (in-process) and
``radixkv.connect(address, token=...)`` (over gRPC to ``radixkv serve``);
``tests/conformance/`` checks they agree call for call, errors included. A request (``rid``,
per session) holds a ``req_to_token`` row, KV slots for its committed tokens and, for hybrid
models, a state slot. Only token ids and indices travel (int32 / int64 numpy), never KV
bytes. ``attach`` opens a session (id, epoch, lease TTL) kept alive by calls and
``heartbeat``; when it ends, everything its requests held is reclaimed and later calls raise
``StaleSessionError``; a session sees only its own rids. Errors: ``InvalidArgumentError``,
``CapacityError`` (requested / available), ``StaleSessionError``, ``NotFoundError``; a call
that raises changes nothing. The vocabulary and rules: ``docs/internals.md``, "The
cache-engine protocol".
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple, Protocol, runtime_checkable

import numpy as np

_NO_SLOTS = np.empty(0, dtype=np.int64)
_NO_SLOTS.flags.writeable = False  # the shared default of the result fields below

__all__ = [
    "Session", "AttachInfo", "MatchQuery", "MatchInfo", "ExtendItem", "ExtendResult",
    "DecodeItem", "DecodeResult", "CacheResult", "EvictResult", "EngineStats",
    "CacheEngineAPI",
]


class Session(NamedTuple):
    """A worker's handle: pass it to every call. ``epoch`` changes when the manager restarts.

    ``secret``: what binds the handle to its attacher. The remote manager returns it with the
    session and refuses a call naming a live session without it (the id alone is no
    credential); the embedded engine (one process, no boundary) leaves it empty. Its repr
    hides it."""

    session_id: str
    epoch: int
    lease_ttl_s: float
    secret: bytes = b""

    def __repr__(self) -> str:
        return f"Session(session_id={self.session_id!r}, epoch={self.epoch}, lease_ttl_s={self.lease_ttl_s})"


class AttachInfo(NamedTuple):
    """What ``attach`` returns: the session and the layout of the shared buffers.

    ``layout`` is a plain, JSON-able dict: the engine config (model shape, page size, pool
    sizes, device, dtypes) and, per pool, its arena layout (tensor names, shapes, dtypes,
    offsets) plus how to map it (``"embedded"`` in-process, a shared-memory file on CPU, CUDA
    IPC handles on GPU). ``radixkv.engine.buffers.attach_buffers(layout)`` turns it into
    tensors that alias the manager's memory.
    """

    session: Session
    layout: dict[str, Any]


class MatchQuery(NamedTuple):
    """A read-only probe: how much of ``token_ids`` is cached (no lock, no allocation)."""

    token_ids: np.ndarray  # int32
    extra_key: str | None = None


class MatchInfo(NamedTuple):
    """``prefix_len``: tokens whose KV rows (and, for hybrid models, state) can be reused.
    ``kv_prefix_len``: tokens whose KV rows are cached (>= prefix_len; equal for KV-only
    models). With the host tier, ``host_len`` of ``prefix_len`` are not on the device (an
    ``alloc_extend`` loads them) and ``storage_len`` of those were read from storage by this
    probe (they are in host memory now)."""

    prefix_len: int
    kv_prefix_len: int
    host_len: int = 0
    storage_len: int = 0


class ExtendItem(NamedTuple):
    """One request of an extend (prefill) step.

    ``token_ids`` (int32) are appended to the request's tokens: for a new ``rid`` its prompt
    (or first chunk), for a known one the next chunk. The step gives KV slots to every token
    of the request that has none yet. ``extra_key`` and ``priority`` are read for new
    requests only.
    """

    rid: str
    token_ids: np.ndarray
    extra_key: str | None = None
    priority: int = 0


class ExtendResult(NamedTuple):
    """Where request ``rid`` stands after ``alloc_extend``.

    The worker computes tokens ``start .. seq_len`` (their KV goes to ``out_cache_loc``, which
    are also written into ``req_to_token[req_pool_idx, start:seq_len]``); tokens before
    ``start`` already have KV (``prefix_len`` of them reused from the cache by this call, the
    rest committed by earlier chunks). For hybrid models ``mamba_slot`` holds the recurrent
    state after ``start`` tokens (a copy-on-write fork of the cached state on a hit, zeros for
    a fresh start); ``-1`` for KV-only models. With state tracking
    (``EngineConfig.mamba_track_interval``) the worker also writes the state after
    ``track_seqlen`` tokens into slot ``track_slot`` (0 / -1: this step passes no boundary).
    With the host tier, ``host_len`` tokens of ``prefix_len`` were loaded from host memory
    by this call and ``storage_len`` of those read from storage (the rest were on the device).
    """

    rid: str
    req_pool_idx: int
    prefix_len: int
    start: int
    seq_len: int
    out_cache_loc: np.ndarray  # int64, seq_len - start entries
    mamba_slot: int = -1
    reserved: np.ndarray = _NO_SLOTS  # int64: its decode reserve after the call, front first
    track_slot: int = 0
    track_seqlen: int = -1
    host_len: int = 0
    storage_len: int = 0


class DecodeItem(NamedTuple):
    """One request of a decode step: ``token_id`` is the token fed in this step (the one the
    request generated last); it gets one KV slot."""

    rid: str
    token_id: int


class DecodeResult(NamedTuple):
    """Per request (in call order): the new token's KV slot and the length after the step;
    and each request's decode reserve after the step (``EngineConfig.decode_reserve``).
    ``track_slots`` (state tracking, else empty): where the worker also copies the request's
    new state (it sits at an interval boundary), 0 for none."""

    out_cache_loc: np.ndarray  # int64 [B]
    seq_lens: np.ndarray  # int64 [B]
    req_pool_indices: np.ndarray  # int64 [B]
    mamba_slots: np.ndarray  # int64 [B], -1 for KV-only models
    reserved: np.ndarray = _NO_SLOTS  # int64: the requests' decode reserves after the call, concatenated
    reserved_lens: np.ndarray = _NO_SLOTS  # int64 [B]: each request's share of ``reserved``
    track_slots: np.ndarray = _NO_SLOTS  # int64 [B] with state tracking, else empty


class CacheResult(NamedTuple):
    """After ``cache_unfinished`` / ``cache_finished``: ``cached_len`` tokens of ``rid`` are
    in the tree (page-aligned); for unfinished requests its row now points at the tree's
    rows for them."""

    rid: str
    cached_len: int


class EvictResult(NamedTuple):
    tokens: int
    states: int


class EngineStats(NamedTuple):
    """Counters of the whole engine. ``kv_*`` in tokens, ``state_*`` in Mamba slots.

    Conservation (checked at idle): ``kv_available + kv_evictable + kv_protected + kv_held ==
    kv_capacity`` and likewise for states; ``host_available + host_used == host_capacity``.
    The tier fields (0 with the tiers off; ``docs/tiers.md``, "Stats and metrics"): ``tier_hit_*``
    split ``hit_tokens`` by tier; ``host_loaded_*`` / ``storage_loaded_*`` count the pages (and
    bytes, and microseconds spent) moved host -> device and storage -> host; ``storage_*`` the
    storage queue (pages); ``host_state_*`` the host state tier of a hybrid model (slots, states,
    matches whose hit ended at a host state and their tokens past the device state hit).
    """

    kv_capacity: int
    kv_available: int
    kv_evictable: int
    kv_protected: int
    kv_held: int
    state_capacity: int
    state_available: int
    state_evictable: int
    state_protected: int
    state_held: int
    rows_capacity: int
    rows_available: int
    sessions: int
    requests: int
    queries: int
    queried_tokens: int
    hit_tokens: int
    inserted_tokens: int
    evicted_tokens: int
    host_capacity: int = 0
    host_available: int = 0
    host_used: int = 0
    tier_hit_device: int = 0
    tier_hit_host: int = 0
    tier_hit_storage: int = 0
    host_loaded_pages: int = 0
    host_loaded_bytes: int = 0
    host_load_us: int = 0
    host_demoted_pages: int = 0
    host_dropped_pages: int = 0
    storage_loaded_pages: int = 0
    storage_loaded_bytes: int = 0
    storage_load_us: int = 0
    storage_written_pages: int = 0
    storage_write_failed: int = 0
    storage_backup_dropped: int = 0
    storage_fetch_timeouts: int = 0
    storage_errors: int = 0
    storage_pending: int = 0
    host_state_slots: int = 0
    host_state_used: int = 0
    host_state_hits: int = 0
    host_state_hit_tokens: int = 0
    host_state_loaded: int = 0
    host_state_demoted: int = 0
    host_state_dropped: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0


@runtime_checkable
class CacheEngineAPI(Protocol):
    """The contract both engines implement. Every method validates its input first and
    changes nothing when it raises."""

    def attach(self, worker_name: str = "") -> AttachInfo: ...

    def heartbeat(self, session: Session) -> float:
        """Renew the lease; returns the seconds it now has left."""

    def detach(self, session: Session) -> None:
        """End the session, reclaiming everything its requests hold."""

    def match(self, session: Session, queries: Sequence[MatchQuery]) -> list[MatchInfo]: ...

    def alloc_extend(self, session: Session, items: Sequence[ExtendItem]) -> list[ExtendResult]:
        """All or nothing: new requests are matched and locked, get a row (and a state
        slot), and every request gets KV slots for its uncommitted tokens, evicting from the
        tree as needed; ``CapacityError`` when that cannot be done."""

    def alloc_decode(self, session: Session, items: Sequence[DecodeItem]) -> DecodeResult: ...

    def cache_unfinished(self, session: Session, rids: Sequence[str]) -> list[CacheResult]:
        """Chunked prefill: put each request's committed tokens into the tree (for hybrid
        models with a fork of its current state) and move its lock there."""

    def cache_finished(self, session: Session, rids: Sequence[str]) -> list[CacheResult]:
        """The requests are done: cache their tokens (and final state), free their rows."""

    def release(self, session: Session, rids: Sequence[str]) -> None:
        """Abort: drop the requests without caching; everything they held is freed."""

    def evict(self, session: Session, num_tokens: int, num_states: int = 0) -> EvictResult: ...

    def stats(self, session: Session | None = None) -> EngineStats: ...

    def flush(self, session: Session) -> bool:
        """Empty the tree; refused (False) while any request is running."""

    def take_events(self, session: Session, max_events: int = 0) -> list[dict[str, Any]]:
        """Drain KV events (``to_dict()`` form of BlockStored / BlockRemoved /
        AllBlocksCleared); ``max_events=0`` means all."""

    def check_invariants(self) -> None:
        """Every pool, the tree and the session table agree (raises ``InvariantError``)."""
