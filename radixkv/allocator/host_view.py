"""Cached numpy views of the free lists' CPU tensors (their one-id and small-batch paths
update rings and masks through numpy instead of torch dispatch).

A view is made once and kept: the tensors are only ever written in place. Copies and
pickles drop the cached views (a copied view would not share memory with the copied
tensor); the next use makes a new one. On another device there is no view (``None``) and
callers use torch ops.
"""
from __future__ import annotations

import numpy as np
import torch

__all__ = ["HostViews", "set_mask"]


class HostViews:
    """Mixin for objects with a ``__dict__`` holding CPU-or-device tensors."""

    def host_view(self, name: str) -> np.ndarray | None:
        """The numpy view of tensor attribute ``name`` on CPU (cached), else ``None``. O(1)."""
        views = self.__dict__.get("_host_views")
        if views is None:
            views = self.__dict__["_host_views"] = {}
        view = views.get(name)
        if view is None:
            t = getattr(self, name)
            if t.device.type == "cpu":
                view = views[name] = t.numpy()
        return view

    def __getstate__(self) -> dict[str, object]:
        state = self.__dict__.copy()
        state.pop("_host_views", None)
        return state


def set_mask(mask: torch.Tensor, host: np.ndarray | None, ids: torch.Tensor, value: bool) -> None:
    """``mask[ids] = value``: through ``host`` (the mask's numpy view) when there is one
    and ``ids`` are on CPU, else one torch index_put. O(len(ids))."""
    if host is not None and ids.device.type == "cpu":
        host[ids.numpy()] = value
    else:
        mask[ids] = value
