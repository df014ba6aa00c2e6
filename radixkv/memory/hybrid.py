"""Pools of hybrid models (linear-attention KDA / Mamba layers mixed with full attention).

* :class:`HybridReqToTokenPool` -- a :class:`ReqToTokenPool` whose requests also hold one
  :class:`MambaPool` slot each; ``req_index_to_mamba_index_mapping[row]`` is the slot of the
  request holding ``row`` (0 for a free row). With ``enable_mamba_extra_buffer`` each row
  also holds a ``mamba_ping_pong_track_buffer``: two more slots, written alternately by the
  model with the state at the last ``mamba_track_interval``-aligned position the request
  passed (see :mod:`radixkv.scheduler.track`), so the tree can cache a state at a position
  it can hold (a page end) although the request's own state sits past it.
* :class:`HybridLinearKVPool` (in :mod:`radixkv.memory.hybrid_kv`) --
  routes global layer ids: full-attention layers to a KV pool, linear (KDA) layers to the
  Mamba pool's layers.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import cast

import torch

from radixkv.contracts import IndexLike, LayerLike, PoolRequest
from radixkv.errors import DoubleFreeError, InvalidArgumentError, InvariantError, describe_ids
from radixkv.memory.arena import DEFAULT_ALIGNMENT
from radixkv.memory.mamba_pool import Mamba2LayerCache, MambaPool
from radixkv.memory.req_to_token import ReqToTokenPool
from radixkv.validation import check_range, index_tensor

MAPPING = "req_index_to_mamba_index_mapping"
OWNER = "mamba_index_to_req_index"
TRACK = "mamba_ping_pong_track_buffer"
TRACK_SIZE = 2  # ping-pong: the step being prepared writes one while the last one is read


class HybridReqToTokenPool(ReqToTokenPool):
    """Request rows plus one Mamba state slot per request.

    Pass an existing ``mamba_pool`` or the arguments to build one. The arena also holds the
    row -> slot map ``req_index_to_mamba_index_mapping`` and its inverse (slot -> row, 0 when
    unmapped), so the "slot already mapped" check is O(1) per request. A slot freed with
    ``free_mamba_cache=False`` outlives its row and is kept by the request's next ``alloc``.
    ``enable_mamba_extra_buffer``: each row also takes ``TRACK_SIZE`` (2) ping-pong track slots,
    allocated and freed with it, all or nothing. Details: ``docs/internals.md``, "Hybrid request
    rows".
    """

    def __init__(self, size: int, max_context_len: int, mamba_pool: MambaPool | None = None, *,
                 mamba_size: int | None = None, conv_state_shape: Sequence[int] | None = None,
                 temporal_state_shape: Sequence[int] | None = None,
                 num_mamba_layers: int | None = None,
                 mamba_dtype: torch.dtype | str = torch.float32,
                 conv_dtype: torch.dtype | str | None = None,
                 temporal_dtype: torch.dtype | str | None = None,
                 device: str | torch.device = "cpu", checks: bool = True,
                 buffer: torch.Tensor | None = None, alignment: int = DEFAULT_ALIGNMENT,
                 enable_mamba_extra_buffer: bool = False, mamba_track_interval: int | None = None,
                 enable_memory_saver: bool = False):
        device = torch.device(device)
        if mamba_track_interval is not None and (isinstance(mamba_track_interval, bool) or not isinstance(
                mamba_track_interval, int) or mamba_track_interval < 1):
            raise InvalidArgumentError(f"mamba_track_interval must be an int >= 1, got {mamba_track_interval!r}")
        self.enable_mamba_extra_buffer = bool(enable_mamba_extra_buffer)
        self.mamba_track_interval = mamba_track_interval
        if mamba_pool is None:
            if conv_state_shape is None or temporal_state_shape is None or num_mamba_layers is None:
                raise InvalidArgumentError("pass a mamba_pool, or conv_state_shape, temporal_state_shape "
                                           "and num_mamba_layers to build one")
            mamba_pool = MambaPool(size if mamba_size is None else mamba_size, conv_state_shape,
                                   temporal_state_shape, num_mamba_layers, mamba_dtype, device,
                                   conv_dtype=conv_dtype, temporal_dtype=temporal_dtype, checks=checks)
        elif not isinstance(mamba_pool, MambaPool):
            raise InvalidArgumentError(f"mamba_pool must be a MambaPool, got {type(mamba_pool).__name__}")
        elif mamba_pool.device.type != device.type:
            raise InvalidArgumentError(f"mamba_pool is on {mamba_pool.device}, the pool on {device}")
        self.mamba_pool = mamba_pool
        super().__init__(size, max_context_len, device, checks=checks, buffer=buffer, alignment=alignment,
                         enable_memory_saver=enable_memory_saver)
        self.req_index_to_mamba_index_mapping: torch.Tensor = self.arena[MAPPING]
        self._slot_owner: torch.Tensor = self.arena[OWNER]
        self.mamba_ping_pong_track_buffer: torch.Tensor | None = (
            self.arena[TRACK] if self.enable_mamba_extra_buffer else None)

    def _extra_entries(self) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
        extra: list[tuple[str, tuple[int, ...], torch.dtype]] = [(MAPPING, (self.size + 1,), torch.int32),
                 (OWNER, (self.mamba_pool.size + 1,), torch.int32)]
        if self.enable_mamba_extra_buffer:
            extra.append((TRACK, (self.size + 1, TRACK_SIZE), torch.int32))
        return extra

    def track_slots_per_row(self) -> int:
        """Extra state slots a row takes: ``TRACK_SIZE`` with the track buffer, else 0."""
        return TRACK_SIZE if self.enable_mamba_extra_buffer else 0

    # -- alloc / free ---------------------------------------------------------------------
    def _validate_slots(self, reqs: list[PoolRequest]) -> None:
        """Every held slot is allocated, held by one request, and consistent with its row."""
        orphan = [r.rid for r in reqs if r.req_pool_idx is not None and r.mamba_pool_idx is None]
        if orphan:
            raise InvalidArgumentError(f"requests hold a row but no mamba slot: {orphan!r}")
        held = [r.mamba_pool_idx for r in reqs if r.mamba_pool_idx is not None]
        if not held:
            return
        slots = self.mamba_pool.validate_allocated(held, "mamba_pool_idx")
        if len(set(int(h) for h in held)) != len(held):
            raise InvalidArgumentError(f"two requests hold the same mamba slot: {sorted(held)}")
        owners = self._slot_owner[slots].cpu().tolist()
        for r, owner in zip((r for r in reqs if r.mamba_pool_idx is not None), owners):
            if r.req_pool_idx is None and owner != 0:
                raise InvalidArgumentError(
                    f"request {r.rid!r} holds mamba slot {r.mamba_pool_idx} that row {owner} maps to")
            if r.req_pool_idx is not None and owner != r.req_pool_idx:
                raise InvalidArgumentError(
                    f"request {r.rid!r}: row {r.req_pool_idx} does not map to its mamba slot "
                    f"{r.mamba_pool_idx}")

    def alloc(self, reqs: Iterable[PoolRequest]) -> list[int] | None:
        """Give each request without a row a row, and each request without a Mamba slot a
        (zeroed) slot; record row -> slot in ``req_index_to_mamba_index_mapping`` and set
        ``req.mamba_pool_idx``. All or nothing across both pools.

        Returns:
            Every request's row, or ``None`` when rows or slots run out (nothing changes).
        Raises (nothing changes): as ``ReqToTokenPool.alloc``, plus ``InvalidArgumentError``
            when a held slot is free, shared, mapped to another row, or not its row's slot.
        """
        reqs = list(reqs)
        self._held_rows(reqs)
        self._validate_slots(reqs)
        new_rows = [r for r in reqs if r.req_pool_idx is None]
        new_slots = [r for r in reqs if r.mamba_pool_idx is None]
        n_track = self.track_slots_per_row() * len(new_rows)
        if len(new_rows) > self.available_size() \
                or len(new_slots) + n_track > self.mamba_pool.available_size():
            return None
        if new_slots:
            slots = cast(torch.Tensor, self.mamba_pool.alloc(len(new_slots)))  # checked: enough free
            for r, s in zip(new_slots, slots.tolist()):
                r.mamba_pool_idx = int(s)
        if n_track:
            track = cast(torch.Tensor, self.mamba_pool.alloc(n_track)).view(len(new_rows), TRACK_SIZE)
            for r, pair in zip(new_rows, track.tolist()):
                _set_track(r, [int(t) for t in pair])
        if new_rows:
            rows = cast(torch.Tensor, self.free_slots.alloc(len(new_rows)))  # checked: enough free
            for r, row in zip(new_rows, rows.tolist()):
                r.req_pool_idx = int(row)
            rows_t = rows.to(self.device)
            slots_t = torch.tensor([r.mamba_pool_idx for r in new_rows], dtype=torch.int64, device=self.device)
            self.req_index_to_mamba_index_mapping[rows_t] = slots_t.to(torch.int32)
            self._slot_owner[slots_t] = rows_t.to(torch.int32)
            if n_track:
                cast(torch.Tensor, self.mamba_ping_pong_track_buffer)[rows_t] = track.to(self.device, torch.int32)
        return cast(list[int], [r.req_pool_idx for r in reqs])  # every request holds a row now

    def free(self, req: PoolRequest, free_mamba_cache: bool = True) -> None:
        """Free ``req``'s row (and unmap its slot); with ``free_mamba_cache`` also free the slot
        and set ``req.mamba_pool_idx = None``, else the request keeps the (allocated) slot.

        Raises (nothing changes): as ``ReqToTokenPool.free``, plus ``InvalidArgumentError``
        when ``req.mamba_pool_idx`` is not the slot its row maps to.
        """
        row = self._host_row(req)
        if bool(self.free_slots.is_free(torch.tensor([row]))[0]):
            raise DoubleFreeError(f"row {row} of request {getattr(req, 'rid', req)!r} is already free")
        slot = int(self.req_index_to_mamba_index_mapping[row])
        if req.mamba_pool_idx is None or int(req.mamba_pool_idx) != slot:
            raise InvalidArgumentError(
                f"request {getattr(req, 'rid', req)!r}: mamba_pool_idx {req.mamba_pool_idx} is not "
                f"the slot {slot} its row {row} maps to")
        track = self.mamba_ping_pong_track_buffer
        pair = [int(t) for t in track[row].tolist()] if track is not None else []
        if pair and getattr(req, "mamba_ping_pong_track_buffer", None) not in (None, pair):
            raise InvalidArgumentError(f"request {getattr(req, 'rid', req)!r}: its track buffer "
                                       f"{req.mamba_ping_pong_track_buffer} is not its row's {pair}")
        self.req_index_to_mamba_index_mapping[row] = 0
        self._slot_owner[slot] = 0
        self.free_slots.free(torch.tensor([row], dtype=torch.int64))
        req.req_pool_idx = None
        if pair:
            cast(torch.Tensor, track)[row] = 0
            self.mamba_pool.free(pair)
            _set_track(req, None)
        if free_mamba_cache:
            self.mamba_pool.free(slot)
            req.mamba_pool_idx = None

    def clear(self) -> None:
        """Every row and every Mamba slot free again, the mappings zeroed."""
        super().clear()
        self.mamba_pool.clear()
        self.req_index_to_mamba_index_mapping.zero_()
        self._slot_owner.zero_()
        if self.mamba_ping_pong_track_buffer is not None:
            self.mamba_ping_pong_track_buffer.zero_()

    # -- lookups --------------------------------------------------------------------------
    def get_mamba_indices(self, req_pool_indices: IndexLike) -> torch.Tensor:
        """The Mamba slots (int32) of rows ``req_pool_indices`` (row 0 -> slot 0).
        Raises ``InvalidIndexError`` for a row outside ``[0, size]`` (with ``checks``)."""
        idx = index_tensor(req_pool_indices, self.device, "req_pool_indices")
        if self.checks:
            check_range(idx, 0, self.size + 1, "req_pool_indices")
        return self.req_index_to_mamba_index_mapping[idx]

    def get_track_slots(self, req_pool_indices: IndexLike) -> torch.Tensor:
        """The ``mamba_ping_pong_track_buffer`` rows (int32 ``[n, 2]``) of ``req_pool_indices``.
        Raises ``InvalidArgumentError`` without the track buffer, ``InvalidIndexError`` for a
        row outside ``[0, size]`` (with ``checks``)."""
        if self.mamba_ping_pong_track_buffer is None:
            raise InvalidArgumentError("this pool has no track buffer (enable_mamba_extra_buffer=False)")
        idx = index_tensor(req_pool_indices, self.device, "req_pool_indices")
        if self.checks:
            check_range(idx, 0, self.size + 1, "req_pool_indices")
        return self.mamba_ping_pong_track_buffer[idx]

    def mamba2_layer_cache(self, layer_id: LayerLike) -> Mamba2LayerCache:
        """The Mamba pool's views of linear layer ``layer_id`` (see ``MambaPool``)."""
        return self.mamba_pool.mamba2_layer_cache(layer_id)

    # -- invariants -----------------------------------------------------------------------
    def check_invariants(self, reqs: Iterable[PoolRequest] | None = None) -> None:
        """Rows and slots sound, and the mapping consistent with them: every row in use maps
        to a distinct allocated slot that maps back to it; free rows map to 0; no slot maps to
        a free row. Given ``reqs`` (every live request), also as ``ReqToTokenPool``, and each
        request's ``mamba_pool_idx`` is its row's slot (or, without a row, an allocated slot no
        row maps to), no slot held twice. O(size). Raises ``InvariantError`` naming the ids."""
        if reqs is not None:
            reqs = list(reqs)
        super().check_invariants(reqs)
        self.mamba_pool.check_invariants()
        rows = torch.arange(1, self.size + 1, dtype=torch.int64)
        in_use = ~self.free_slots.is_free(rows).cpu()
        mapping = self.req_index_to_mamba_index_mapping.cpu().to(torch.int64)
        owner = self._slot_owner.cpu().to(torch.int64)
        m = mapping[1:]
        if int(mapping[0]) != 0:
            raise InvariantError(f"padding row 0 maps to mamba slot {int(mapping[0])}")
        stale = rows[~in_use & (m != 0)]
        if stale.numel():
            raise InvariantError(f"free rows still mapped to mamba slots: {describe_ids(stale.tolist())}")
        bad = rows[in_use & ((m < 1) | (m > self.mamba_pool.size))]
        if bad.numel():
            raise InvariantError(f"rows in use without a valid mamba slot: {describe_ids(bad.tolist())}")
        used_rows, slots = rows[in_use], m[in_use]
        s, _ = torch.sort(slots)
        dup = torch.unique(s[1:][s[1:] == s[:-1]])
        if dup.numel():
            raise InvariantError(f"mamba slots mapped by two rows: {describe_ids(dup.tolist())}")
        if slots.numel():
            free_slot = self.mamba_pool.free_slots.is_free(slots.to(self.mamba_pool.device)).cpu()
            if bool(free_slot.any()):
                raise InvariantError(f"rows mapped to free mamba slots: rows "
                                     f"{describe_ids(used_rows[free_slot].tolist())}")
            back = owner[slots] != used_rows
            if bool(back.any()):
                raise InvariantError(f"mamba slots whose owner is not their row: "
                                     f"{describe_ids(slots[back].tolist())}")
        self._check_track(in_use, slots)
        owned = torch.nonzero(owner).flatten()
        if int(owner[0]) != 0 or owned.numel() != slots.numel():
            extra = owned[~torch.isin(owned, slots)] if owned.numel() else owned
            raise InvariantError(f"mamba slots owned by no row in use: {describe_ids(extra.tolist())}")
        if reqs is not None:
            self._check_req_slots(reqs, mapping, owner)

    def _check_track(self, in_use: torch.Tensor, slots: torch.Tensor) -> None:
        """Rows in use hold two allocated track slots, distinct from every other slot held
        by a row; free rows hold none."""
        if self.mamba_ping_pong_track_buffer is None:
            return
        track = self.mamba_ping_pong_track_buffer.cpu().to(torch.int64)[1:]
        stale = torch.nonzero(~in_use & (track != 0).any(1)).flatten() + 1
        if stale.numel():
            raise InvariantError(f"free rows still holding track slots: {describe_ids(stale.tolist())}")
        used = track[in_use].flatten()
        bad = used[(used < 1) | (used > self.mamba_pool.size)]
        if bad.numel():
            raise InvariantError(f"rows in use with track slots out of range: {describe_ids(bad.tolist())}")
        every, _ = torch.sort(torch.cat([used, slots]))
        dup = torch.unique(every[1:][every[1:] == every[:-1]])
        if dup.numel():
            raise InvariantError(f"track slots held twice (or also a row's state slot): "
                                 f"{describe_ids(dup.tolist())}")
        if used.numel():
            free = self.mamba_pool.free_slots.is_free(used.to(self.mamba_pool.device)).cpu()
            if bool(free.any()):
                raise InvariantError(f"track slots that are free: {describe_ids(used[free].tolist())}")

    def track_slot_owners(self) -> dict[int, int]:
        """``{track slot: row}`` for every row in use (empty without the track buffer). O(size)."""
        if self.mamba_ping_pong_track_buffer is None:
            return {}
        rows = torch.arange(1, self.size + 1, dtype=torch.int64)
        in_use = ~self.free_slots.is_free(rows).cpu()
        track = self.mamba_ping_pong_track_buffer.cpu().to(torch.int64)[1:][in_use]
        return {int(s): int(r) for r, pair in zip(rows[in_use].tolist(), track.tolist()) for s in pair}

    def _check_req_slots(self, reqs: list[PoolRequest], mapping: torch.Tensor, owner: torch.Tensor) -> None:
        held = [int(r.mamba_pool_idx) for r in reqs if r.mamba_pool_idx is not None]
        if len(set(held)) != len(held):
            dup = sorted({h for h in held if held.count(h) > 1})
            raise InvariantError(f"mamba slots held by two requests: {describe_ids(dup)}")
        bad_rows = [r.req_pool_idx for r in reqs if r.req_pool_idx is not None
                    and (r.mamba_pool_idx is None or int(mapping[r.req_pool_idx]) != int(r.mamba_pool_idx))]
        if bad_rows:
            raise InvariantError(f"rows whose request's mamba_pool_idx is not their slot: "
                                 f"{describe_ids(bad_rows)}")
        detached = [int(r.mamba_pool_idx) for r in reqs
                    if r.req_pool_idx is None and r.mamba_pool_idx is not None]
        if detached:
            t = torch.tensor(detached, dtype=torch.int64)
            if bool((t < 1).any()) or bool((t > self.mamba_pool.size).any()):
                raise InvariantError(f"held mamba slots out of range: {describe_ids(detached)}")
            free = self.mamba_pool.free_slots.is_free(t.to(self.mamba_pool.device)).cpu()
            mapped = owner[t] != 0
            if bool(free.any()) or bool(mapped.any()):
                raise InvariantError(f"slots held without a row that are free: "
                                     f"{describe_ids(t[free].tolist())}; or mapped by a row: "
                                     f"{describe_ids(t[mapped].tolist())}")


def _set_track(req: PoolRequest, pair: list[int] | None) -> None:
    """A request's track buffer (SGLang's ``Req`` fields): its two slots, which one the next
    tracked step writes, and the position the last written one holds (none yet)."""
    req.mamba_ping_pong_track_buffer = pair
    req.mamba_next_track_idx = 0
    req.mamba_last_track_seqlen = None
