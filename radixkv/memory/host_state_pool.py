"""``HostStatePool``: the host tier's buffer of Mamba states, shaped as the device
:class:`~radixkv.memory.mamba_pool.MambaPool`'s slots.

``conv`` ``[num_layers, num_slots + 1, *conv_state_shape]`` and ``temporal`` likewise (slot 0 is
padding, never handed out), in the device pool's dtypes: pinned memory when the device is CUDA,
plain on the CPU. Copies only (which host slot holds which node's state is bookkeeping:
:mod:`radixkv.cache.hybrid.host_states`). A copy is exact (bytes moved, no arithmetic), so a
state loaded back is bit-equal to the one demoted. Both directions are synchronous: a demoted
device slot is freed, and a loaded one forked, right after. Cost: one indexed read and one
indexed write per tensor per batch.
"""
from __future__ import annotations

import torch

from radixkv.contracts import StatePool
from radixkv.errors import InvalidArgumentError, LengthMismatchError

__all__ = ["HostStatePool"]


class HostStatePool:
    """``num_slots`` host copies of ``mamba_pool``'s states: :meth:`store` (device -> host),
    :meth:`load` (host -> device), one batch per call. Host slots are ``1..num_slots``."""

    def __init__(self, mamba_pool: StatePool, num_slots: int) -> None:
        if isinstance(num_slots, bool) or not isinstance(num_slots, int) or num_slots < 1:
            raise InvalidArgumentError(f"num_slots must be an int >= 1, got {num_slots!r}")
        self.mamba_pool = mamba_pool
        self.num_slots = num_slots
        self.device = torch.device(mamba_pool.device)
        self.pinned = self.device.type == "cuda"
        conv, temporal = mamba_pool.conv_state, mamba_pool.temporal_state
        self.conv = torch.zeros((conv.shape[0], num_slots + 1, *conv.shape[2:]), dtype=conv.dtype,
                                pin_memory=self.pinned)
        self.temporal = torch.zeros((temporal.shape[0], num_slots + 1, *temporal.shape[2:]),
                                    dtype=temporal.dtype, pin_memory=self.pinned)

    @property
    def nbytes(self) -> int:
        return int(self.conv.nbytes + self.temporal.nbytes)

    @property
    def slot_bytes(self) -> int:
        """Bytes of one state (every layer's conv and temporal state)."""
        return self.nbytes // (self.num_slots + 1)

    def device_state_bytes(self, device_slot: int) -> torch.Tensor:
        """The state in ``device_slot`` as ``slot_bytes`` bytes (uint8, CPU, a fresh tensor):
        every layer's conv state, then every layer's temporal state (the storage tier's
        format). One copy per tensor."""
        pool = self.mamba_pool
        parts = [t[:, device_slot].cpu().contiguous().reshape(-1).view(torch.uint8)
                 for t in (pool.conv_state, pool.temporal_state)]
        return torch.cat(parts)

    def write_state_bytes(self, host_slot: int, data: torch.Tensor) -> None:
        """Put a state read from storage (``device_state_bytes``' format: at least
        ``slot_bytes`` uint8, the rest ignored) into ``host_slot``. Raises (nothing written)
        for a slot out of range or too few bytes."""
        if not 1 <= host_slot <= self.num_slots:
            raise InvalidArgumentError(f"host state slots must lie in [1, {self.num_slots}]")
        flat = data.reshape(-1)
        if flat.dtype != torch.uint8 or flat.numel() < self.slot_bytes:
            raise LengthMismatchError(f"a state is {self.slot_bytes} bytes (uint8), got {flat.numel()} "
                                      f"of {flat.dtype}")
        at = 0
        for host in (self.conv, self.temporal):
            dst = host[:, host_slot]
            n = dst.numel() * dst.element_size()
            dst.copy_(flat[at:at + n].clone().view(host.dtype).view(dst.shape))
            at += n

    def _ids(self, host_slots: list[int], device_slots: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        if len(host_slots) != len(device_slots):
            raise LengthMismatchError(f"{len(host_slots)} host slots for {len(device_slots)} device slots")
        h = torch.tensor(host_slots, dtype=torch.int64)
        if h.numel() and (int(h.min()) < 1 or int(h.max()) > self.num_slots):
            raise InvalidArgumentError(f"host state slots must lie in [1, {self.num_slots}]")
        d = torch.tensor(device_slots, dtype=torch.int64)
        if d.numel() and (int(d.min()) < 1 or int(d.max()) > self.mamba_pool.size):
            raise InvalidArgumentError(f"device state slots must lie in [1, {self.mamba_pool.size}]")
        return h, d.to(self.device)

    def store(self, host_slots: list[int], device_slots: list[int]) -> None:
        """Copy the states of ``device_slots[i]`` into ``host_slots[i]``. Raises (nothing
        copied) for mismatched lengths or ids out of range."""
        self._move(host_slots, device_slots, to_host=True)

    def load(self, host_slots: list[int], device_slots: list[int]) -> None:
        """Copy the states of ``host_slots[i]`` into ``device_slots[i]``. Raises (nothing
        copied) for mismatched lengths or ids out of range."""
        self._move(host_slots, device_slots, to_host=False)

    def _move(self, host_slots: list[int], device_slots: list[int], to_host: bool) -> None:
        h, d = self._ids(host_slots, device_slots)
        if not h.numel():
            return
        pool = self.mamba_pool
        for host, dev in ((self.conv, pool.conv_state), (self.temporal, pool.temporal_state)):
            if self.device.type == "cpu":  # one strided copy per state: no gather, no staging
                for hs, ds in zip(host_slots, device_slots):
                    (host[:, hs] if to_host else dev[:, ds]).copy_(dev[:, ds] if to_host else host[:, hs])
            elif to_host:  # one gather and one transfer per batch
                host.index_copy_(1, h, dev.index_select(1, d).cpu())
            else:
                dev.index_copy_(1, d, host.index_select(1, h).to(self.device, non_blocking=True))
