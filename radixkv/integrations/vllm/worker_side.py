"""The worker half of the connector: copies between the manager's KV pool and vLLM's cache.

The manager's pools are mapped zero-copy once per manager epoch (a session is opened just to
read the layout) and pre-faulted then, not in a request. A step's loads run before the forward,
its saves after it, each one gather and one scatter per layer and part over all the step's
tokens. Tensor parallel: a rank copies only its ``HeadShard`` of the rows (which hold every
head). An op of an epoch this worker cannot map is reported failed (vLLM recomputes the load,
the scheduler releases the save); a load from a mapped epoch is done even if that manager died
(the memory stays mapped and the rows were locked). Hybrid models: :meth:`WorkerSide.copy_states`
copies whole recurrent states between the manager's state slots and vLLM's state blocks (byte
rows of each layer's raw pages). See ``docs/vllm.md``, "The worker side".
"""
from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from radixkv.errors import InvalidArgumentError
from radixkv.integrations.vllm.layout import (
    HeadShard,
    KVShape,
    LayoutMismatchError,
    RowGeometry,
    check_same_shape,
    manager_kv_shape,
    paged_kv_views,
    row_geometry,
    state_page_views,
)
from radixkv.integrations.vllm.link import ManagerLink
from radixkv.integrations.vllm.scheduler_side import CopyOp, StateOp

if TYPE_CHECKING:  # pragma: no cover
    from radixkv.engine.buffers import WorkerBuffers

__all__ = ["WorkerSide", "SaveReport"]

logger = logging.getLogger("radixkv.integrations.vllm")

_KEEP_EPOCHS = 2  # mapped epochs kept (the current one and the one before a restart)


@dataclass
class SaveReport:
    """Workers -> scheduler, one step: ``saved[req_id]``: saved up to this token; ``failed``:
    requests whose save failed; ``ranks[req_id]``: how many workers reported it saved. Each
    tensor-parallel rank copies its own heads, so a save is done only when every rank's is."""

    saved: dict[str, int] = field(default_factory=dict)
    failed: set[str] = field(default_factory=set)
    ranks: dict[str, int] = field(default_factory=dict)

    def add(self, saved: dict[str, int], failed: set[str]) -> None:
        """One worker's own ``WorkerSide.save`` result (several calls of a step merge)."""
        self.saved.update(saved)
        self.failed |= failed
        self.ranks.update(dict.fromkeys(saved, 1))

    def merged(self, other: SaveReport) -> tuple[dict[str, int], set[str], dict[str, int]]:
        """``(saved, failed, ranks)`` of this and another worker's report: a request is saved as
        far as both saved it; the ranks add up."""
        saved, ranks = dict(self.saved), dict(self.ranks)
        for k, v in other.saved.items():
            saved[k] = min(saved[k], v) if k in saved else v
            ranks[k] = ranks.get(k, 0) + other.ranks.get(k, 0)
        return saved, self.failed | other.failed, ranks

    def complete(self, world_size: int) -> tuple[dict[str, int], set[str]]:
        """``(saved, failed)`` for the scheduler: a request fewer than ``world_size`` workers
        reported saved counts as failed (released, never committed)."""
        short = {k for k in self.saved if self.ranks.get(k, 0) < world_size}
        return {k: v for k, v in self.saved.items() if k not in short}, self.failed | short


def _kv_buffer(wb: WorkerBuffers, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K, V of the manager's ``layer``-th attention layer (a hybrid pool numbers layers globally)."""
    pool = getattr(wb.kv_pool, "full_kv_pool", wb.kv_pool)
    k, v = pool.get_kv_buffer(layer)
    return k, v


class WorkerSide:
    """See the module doc. ``link``: the worker's :class:`ManagerLink` (no keep-alive, no background reconnect);
    ``shape``: the model's KV shape, all heads (checked against every manager mapped); ``shard``:
    this rank's heads (default: all); ``copy_threads``: torch intra-op threads of the copies on
    CPU (0: torch's setting, vLLM's OpenMP threads)."""

    def __init__(self, link: ManagerLink, shape: KVShape, shard: HeadShard | None = None, copy_threads: int = 1):
        self.link = link
        self.shape = shape
        self.copy_threads = copy_threads
        self.shard = shard if shard is not None else HeadShard(0, shape.kv_heads)
        if not (0 <= self.shard.first and self.shard.num >= 1
                and self.shard.first + self.shard.num <= shape.kv_heads):
            raise LayoutMismatchError(f"head shard {tuple(self.shard)} outside the model's {shape.kv_heads} KV heads")
        self._heads = slice(self.shard.first, self.shard.first + self.shard.num)
        self._whole = self.shard.num == shape.kv_heads  # the manager's rows copied whole
        self._views: list[tuple[torch.Tensor, ...]] = []  # per layer: (K, V), or (latent,) for MLA
        self._rows: list[torch.Tensor] = []  # each layer as rows of head_dim (with _geometry)
        self._geometry: RowGeometry | None = None  # the same in every layer, or None: index the views
        self._buffers: dict[int, WorkerBuffers] = {}  # epoch -> the manager's pools, mapped
        self._states: list[tuple[int, torch.Tensor, torch.Tensor]] = []  # per state layer: (group, conv, temporal)
        self.counters: dict[str, int] = {"loaded_tokens": 0, "saved_tokens": 0, "failed_load_tokens": 0,
                                         "failed_save_tokens": 0, "mapped_epochs": 0}

    # ------------------------------------------------------------------ set-up
    def register(self, layers: Sequence[tuple[str, torch.Tensor]],
                 states: Sequence[tuple[str, int, torch.Tensor]] = ()) -> None:
        """vLLM's per-layer KV tensors in layer order; a hybrid model's recurrent layers in
        ``states`` (name, its state group's ordinal, raw pages). Raises ``LayoutMismatchError``
        when the tensors are not a layout this connector reads, or when the manager is up and
        its pools have another shape (names both)."""
        st = self.shape.state
        if len(states) != (st.layers if st is not None else 0):
            raise LayoutMismatchError(f"vLLM registered {len(states)} recurrent state layers, the model config "
                                      f"has {st.layers if st is not None else 0}")
        if st is not None:
            self._states = [(g, *state_page_views(t, st, name)) for name, g, t in states]
        if len(layers) != self.shape.layers:
            raise LayoutMismatchError(f"vLLM registered {len(layers)} KV cache layers, its model config "
                                      f"has {self.shape.layers}")
        s = self.shape
        self._views = [paged_kv_views(t, s.page_size, self.shard.num, s.head_dim, name, s.latent) for name, t in layers]
        geos = {row_geometry(t, parts, s.head_dim) for (_, t), parts in zip(layers, self._views, strict=True)}
        self._geometry = geos.pop() if len(geos) == 1 else None
        self._rows = [t.view(-1, s.head_dim) for _, t in layers] if self._geometry is not None else []
        for name, t in layers:
            if str(t.dtype).removeprefix("torch.") != s.dtype:
                raise LayoutMismatchError(f"vLLM KV cache of {name} is {t.dtype}, expected {s.dtype}")
        self._map_current(strict=True)

    def _map_current(self, strict: bool = False) -> int | None:
        """Attach, map the manager's pools, detach. Returns the epoch mapped (None: the
        manager is down or refused). ``strict``: raise a layout mismatch."""
        got = self.link.get(force=True)
        if got is None:
            return None
        client, info = got
        epoch = int(info.session.epoch)
        try:
            check_same_shape(self.shape, manager_kv_shape(info.layout["config"]))
            wb = client.worker_buffers(info)
            dev = self._views[0][0].device if self._views else wb.device
            if torch.device(wb.device).type != dev.type:
                raise LayoutMismatchError(f"the radixkv manager's KV pool is on {wb.device}, vLLM's KV "
                                          f"cache on {dev}: start the manager on the engine's device")
        except LayoutMismatchError:
            self.link.close()
            if strict:
                raise
            logger.error("radixkv: manager %s refused", self.link.cfg.address, exc_info=True)
            return None
        except Exception as e:
            self.link.fail(e)
            return None
        self.link.close()  # the layout is all the worker needs from a session
        try:
            self._warm(wb)
        except Exception as e:  # best effort: a cold pool is slower, not wrong
            logger.warning("radixkv: warming the mapped pool failed (%s: %s)", type(e).__name__, e)
        self._buffers[epoch] = wb
        self.counters["mapped_epochs"] += 1
        for old in sorted(self._buffers)[:-_KEEP_EPOCHS]:
            del self._buffers[old]
        return epoch

    def _warm(self, wb: WorkerBuffers) -> None:
        """At mapping (engine start, or a new manager), not in a request: read one element of
        every page of the manager's mapped pools (a CPU pool's first touch of each page is a
        page fault: the first requests' copies paid them, about a second per instance for the
        benchmark's pool; a hybrid's state pool too), and run the copy kernels once on one row of scratch; with vLLM's
        tensors registered, the save path once from vLLM's block 0 into the manager's padding
        slot 0, and the load's scatter once of vLLM's own row onto itself (no value changes)."""
        one = torch.zeros(1, dtype=torch.int64, device=wb.device)
        for layer in range(self.shape.layers):
            for m in self._manager_parts(wb, layer):
                flat = m.reshape(-1)
                if flat.device.type == "cpu":
                    flat[::max(1, 4096 // flat.element_size())].sum()
                row = m.index_select(0, one)
                row.index_copy_(0, one, row.clone())
        wb.req_to_token.reshape(-1)[::1024].sum()
        if wb.mamba_pool is not None and self._states:  # a hybrid's state pool: its pages too
            for t in (wb.mamba_pool.conv_state, wb.mamba_pool.temporal_state):
                if t.device.type == "cpu":
                    t.reshape(-1)[::max(1, 4096 // t.element_size())].sum()
        if self._geometry is not None:
            zero = torch.zeros(1, dtype=torch.int64, device=self._views[0][0].device)
            if self.shard.writes:
                self._copy_rows(wb, zero, zero, zero, to_vllm=False)
            for flat in self._rows:
                for at in self._geometry.rows(zero, zero, self.shard.num):
                    flat.index_copy_(0, at, flat.index_select(0, at))

    def _buffers_of(self, epoch: int) -> WorkerBuffers | None:
        wb = self._buffers.get(epoch)
        if wb is None:  # a new manager: map it (an op of a manager gone before we mapped it fails)
            self._map_current()
            wb = self._buffers.get(epoch)
        return wb

    # ------------------------------------------------------------------ copies
    def _indices(self, wb: WorkerBuffers, ops: Sequence[CopyOp]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(manager slots, vLLM blocks, offsets) of ``ops``, on the KV device. Every index the
        manager named is checked before any copy (negative ones included: Python would wrap
        them onto another request's row or block): the row in ``[1, rows)`` (row 0 is the
        padding row), ``0 <= start <= end <= width``, ``end - start`` vLLM slots each in
        ``[0, vLLM's slots)``, the manager slots read from the row in ``[0, pool)``. Raises
        ``InvalidArgumentError`` naming the op (nothing copied)."""
        table = wb.req_to_token
        n_rows, width = int(table.shape[0]), int(table.shape[1])
        vllm_cap = int(self._views[0][0].shape[0]) * self.shape.page_size
        for op in ops:
            slots = op.slots
            if not (1 <= op.row < n_rows and 0 <= op.start <= op.end <= width) or len(slots) != op.end - op.start \
                    or (len(slots) and (int(slots.min()) < 0 or int(slots.max()) >= vllm_cap)):
                raise InvalidArgumentError(
                    f"request {op.req_id!r}: row {op.row}, tokens [{op.start}, {op.end}), {len(slots)} vLLM slots "
                    f"outside req_to_token {n_rows} x {width} or vLLM's {vllm_cap} slots")
        rows = torch.cat([table[op.row, op.start:op.end] for op in ops]).to(torch.int64)
        cap = self._views_capacity(wb)
        if rows.numel() and (int(rows.min()) < 0 or int(rows.max()) >= cap):
            raise InvalidArgumentError(f"manager rows out of range [0, {cap})")
        dev = self._views[0][0].device
        slots_all = torch.from_numpy(np.concatenate([op.slots for op in ops])).to(dev)
        return rows.to(dev), slots_all // self.shape.page_size, slots_all % self.shape.page_size

    @staticmethod
    def _views_capacity(wb: WorkerBuffers) -> int:
        return int(_kv_buffer(wb, 0)[0].shape[0])

    def _copy(self, ops: Sequence[CopyOp], to_vllm: bool) -> tuple[list[CopyOp], list[CopyOp]]:
        """``_copy_ops`` with ``copy_threads`` intra-op threads on CPU: a step's copies are small,
        and OpenMP's fork/join over vLLM's threads cost more than the copy (20-50x a one-thread
        ``index_select`` + ``index_copy_`` of a 512-token prompt's rows, measured at load ~9)."""
        threads = torch.get_num_threads()
        cpu = bool(self._views) and self._views[0][0].device.type == "cpu"
        narrow = cpu and 0 < self.copy_threads < threads
        if narrow:
            torch.set_num_threads(self.copy_threads)
        try:
            return self._copy_ops(ops, to_vllm)
        finally:
            if narrow:
                torch.set_num_threads(threads)

    def copy_states(self, ops: Sequence[StateOp], to_vllm: bool) -> set[str]:
        """Whole recurrent states of every state layer: manager slot ``op.slots[0]`` -> vLLM
        state blocks ``op.blocks`` (``to_vllm``), or those blocks -> every slot of ``op.slots``.
        Every index is checked before any copy. Returns the req ids whose copy failed."""
        failed: set[str] = set()
        by: dict[int, list[StateOp]] = {}
        for op in ops:
            by.setdefault(op.epoch, []).append(op)
        for epoch, group in by.items():
            try:
                self._copy_state_group(self._buffers_of(epoch), group, to_vllm)
            except Exception as e:  # never fail the engine's step: report, recompute / not cache
                logger.warning("radixkv: state %s of %d requests failed (%s: %s)", "load" if to_vllm else "save",
                               len(group), type(e).__name__, e)
                failed.update(op.req_id for op in group)
        return failed

    def _copy_state_group(self, wb: WorkerBuffers | None, ops: Sequence[StateOp], to_vllm: bool) -> None:
        if wb is None or wb.mamba_pool is None or not self._states:
            raise InvalidArgumentError("no mapped manager state pool or no registered vLLM state layers")
        pool, n_blocks = wb.mamba_pool, int(self._states[0][1].shape[0])
        n_groups = 1 + max(g for g, _, _ in self._states)
        for op in ops:
            if not op.slots or any(not 1 <= s <= pool.size for s in op.slots) or len(op.blocks) != n_groups \
                    or any(not 0 <= b < n_blocks for b in op.blocks):
                raise InvalidArgumentError(f"request {op.req_id!r}: state slots {op.slots} / blocks {op.blocks} "
                                           f"outside the manager's {pool.size} slots or vLLM's {n_blocks} blocks")
        dev = self._states[0][1].device
        pairs = [(op.slots[0], op.blocks) for op in ops] if to_vllm else \
            [(s, op.blocks) for op in ops for s in op.slots]
        slots = torch.tensor([s for s, _ in pairs], dtype=torch.int64, device=dev)
        blocks = torch.tensor([b for _, b in pairs], dtype=torch.int64, device=dev)  # [n, groups]
        for j, (g, conv, temporal) in enumerate(self._states):
            for mine, theirs in ((conv, pool.conv_state[j]), (temporal, pool.temporal_state[j])):
                rows = theirs.view(-1).view(torch.int8).view(pool.size + 1, -1)
                if to_vllm:
                    mine.index_copy_(0, blocks[:, g], rows.index_select(0, slots))
                else:
                    rows.index_copy_(0, slots, mine.index_select(0, blocks[:, g]))

    def _copy_ops(self, ops: Sequence[CopyOp], to_vllm: bool) -> tuple[list[CopyOp], list[CopyOp]]:
        """Run ``ops`` (one batch per manager epoch): manager -> vLLM (``to_vllm``) or back,
        one gather and one scatter per layer and K/V. Returns (done ops, failed ops)."""
        by: dict[int, list[CopyOp]] = {}
        for op in ops:
            by.setdefault(op.epoch, []).append(op)
        done: list[CopyOp] = []
        failed: list[CopyOp] = []
        for epoch, group in by.items():
            wb = self._buffers_of(epoch)
            try:
                if wb is None:
                    raise InvalidArgumentError(f"manager epoch {epoch} is not mapped")
                rows, blk, off = self._indices(wb, group)
                if self._geometry is not None and (to_vllm or self.shard.writes):
                    self._copy_rows(wb, rows, blk, off, to_vllm)
                elif to_vllm or self.shard.writes:
                    hs = self._heads
                    for layer, parts in enumerate(self._views):
                        for part, m in zip(parts, self._manager_parts(wb, layer), strict=True):
                            if to_vllm:
                                part[blk, off] = m.index_select(0, rows)[:, hs]
                            else:
                                m[:, hs].index_copy_(0, rows, part[blk, off])
                if rows.is_cuda:
                    torch.cuda.current_stream(rows.device).synchronize()
                done.extend(group)
            except Exception as e:  # never fail the engine's step: report, recompute / not cache
                logger.warning("radixkv: %s of %d tokens failed (%s: %s)", "load" if to_vllm else "save",
                               sum(op.end - op.start for op in group), type(e).__name__, e)
                failed.extend(group)
        return done, failed

    def _manager_parts(self, wb: WorkerBuffers, layer: int) -> tuple[torch.Tensor, ...]:
        """The manager's buffers of ``layer`` matching vLLM's parts: ``(K, V)``, or the MLA
        latent alone (the pool's "V" is a view of the latent's first columns)."""
        k, v = _kv_buffer(wb, layer)
        return (k,) if self.shape.latent else (k, v)

    def _copy_rows(self, wb: WorkerBuffers, rows: torch.Tensor, blk: torch.Tensor, off: torch.Tensor,
                   to_vllm: bool) -> None:
        """The copies by row index (see ``row_geometry``): per layer and part one
        ``index_select`` and one ``index_copy_``, row indices computed once for all layers.
        The manager's buffer is seen as rows of all heads (whole shard) or of one head."""
        assert self._geometry is not None
        h, d, n_all = self.shard.num, self.shape.head_dim, self.shape.kv_heads
        part_rows = self._geometry.rows(blk, off, h)
        if self._whole:
            m_rows, width = rows, n_all * d
        else:  # this rank's heads of each slot: row slot * heads + head
            m_rows = (rows[:, None] * n_all + torch.arange(self.shard.first, self.shard.first + h,
                                                           device=rows.device)[None, :]).reshape(-1)
            width = d
        for layer, flat in enumerate(self._rows):
            for at, m in zip(part_rows, self._manager_parts(wb, layer), strict=True):
                mflat = m.view(-1, width)
                if to_vllm:
                    flat.index_copy_(0, at, mflat.index_select(0, m_rows).view(-1, d))
                else:
                    mflat.index_copy_(0, m_rows, flat.index_select(0, at).view(-1, width))

    def load(self, ops: Sequence[CopyOp]) -> set[int]:
        """Copy the ops' manager rows into vLLM's blocks. Returns the vLLM block ids that
        could not be loaded (vLLM recomputes them)."""
        failed = self._load_ops(ops)
        if not failed:
            return set()
        slots = np.concatenate([op.slots for op in failed])
        return set(np.unique(slots // self.shape.page_size).tolist())

    def _load_ops(self, ops: Sequence[CopyOp]) -> list[CopyOp]:
        """Copy the ops' manager rows into vLLM's blocks, counted. Returns the failed ops."""
        done, failed = self._copy(ops, to_vllm=True)
        self.counters["loaded_tokens"] += sum(op.end - op.start for op in done)
        self.counters["failed_load_tokens"] += sum(op.end - op.start for op in failed)
        return failed

    def load_requests(self, ops: Sequence[CopyOp], state_ops: Sequence[StateOp]) -> set[str]:
        """The loads and state loads of whole requests (a hybrid model's asynchronous loads).
        Returns the req ids whose KV or state did not load: vLLM recomputes them whole."""
        failed = {op.req_id for op in self._load_ops(ops)}
        return failed | (self.copy_states(state_ops, to_vllm=True) if state_ops else set())

    def save(self, ops: Sequence[CopyOp]) -> tuple[dict[str, int], set[str]]:
        """Copy vLLM's blocks of the ops into the manager rows. Returns (saved: req id ->
        end token, failed req ids)."""
        done, failed = self._copy(ops, to_vllm=False)
        self.counters["saved_tokens"] += sum(op.end - op.start for op in done)
        self.counters["failed_save_tokens"] += sum(op.end - op.start for op in failed)
        saved: dict[str, int] = {}
        for op in done:
            saved[op.req_id] = max(saved.get(op.req_id, 0), op.end)
        return saved, {op.req_id for op in failed}
