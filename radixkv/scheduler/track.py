"""State tracking at aligned positions (SGLang's ``mamba_ping_pong_track_buffer``).

The tree keeps states only at page ends, while a request's own slot sits after its last token.
With ``enable_mamba_extra_buffer`` each request holds two more slots, written alternately: a
step whose tokens pass an aligned position ``a`` (a multiple of ``mamba_track_interval``) has
the model write the state after ``a`` tokens into the next one. :func:`prepare_track` records
it in the batch (``mamba_track_indices`` / ``mamba_track_seqlens``; 0 / -1: none) and the
request, so ``cache_*_req`` read the slot just written while the next step may write the
other. Only positions the step computes (``a > prefix``) are tracked. Cost: O(batch) host
work per flow call. Why a pair: ``docs/internals.md``, "State tracking at aligned positions".
"""
from __future__ import annotations

from typing import Any

import torch

from radixkv.errors import InvalidArgumentError
from radixkv.scheduler.req import Req

__all__ = ["track_interval", "prepare_track"]


def track_interval(pool: Any, page_size: int) -> int | None:
    """The tracking interval of a request pool (``None``: it has no track buffer):
    ``pool.mamba_track_interval``, default ``page_size``. Raises InvalidArgumentError when it
    is not a multiple of ``page_size`` (a state between page ends could not be cached)."""
    if not getattr(pool, "enable_mamba_extra_buffer", False):
        return None
    iv = getattr(pool, "mamba_track_interval", None) or page_size
    if iv % page_size:
        raise InvalidArgumentError(f"mamba_track_interval {iv} is not a multiple of the page size {page_size}")
    return int(iv)


def prepare_track(batch: Any, reqs: list[Req], starts: torch.Tensor, ends: torch.Tensor) -> None:
    """Set ``batch.mamba_track_indices`` (int64 on the device, the slot the step writes the
    tracked state into, 0 for none: slot 0 is padding) and ``batch.mamba_track_seqlens``
    (int64 host, the position, -1 for none) for a step computing tokens ``starts[i] ..
    ends[i]`` of ``reqs[i]``; advance the requests' track fields. Without a track buffer both
    stay ``None``. Called by the flow after everything else succeeded."""
    iv = track_interval(batch.req_to_token_pool, batch.page_size)
    if iv is None:
        batch.mamba_track_indices = batch.mamba_track_seqlens = None
        return
    aligned = torch.div(ends, iv, rounding_mode="floor") * iv
    hit = aligned > starts
    slots = torch.zeros(len(reqs), dtype=torch.int64)
    for i in torch.nonzero(hit).flatten().tolist():
        r = reqs[i]
        pair = r.mamba_ping_pong_track_buffer
        if not pair:
            raise InvalidArgumentError(f"request {r.rid!r} holds a row but no track buffer")
        slots[i] = int(pair[r.mamba_next_track_idx])
        r.mamba_last_track_seqlen = int(aligned[i])
        r.mamba_next_track_idx ^= 1
    batch.mamba_track_indices = slots.to(batch.device)
    batch.mamba_track_seqlens = torch.where(hit, aligned, torch.full_like(aligned, -1))
