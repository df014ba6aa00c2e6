"""Invariant checks shared by the free lists (O(pool size); for tests and debugging)."""
from __future__ import annotations

from collections.abc import Mapping

import torch

from radixkv.errors import InvariantError, describe_ids


def check_free_lists(
    owner: str,
    free_mask: torch.Tensor,
    lists: Mapping[str, torch.Tensor],
    kind: str = "id",
) -> None:
    """Check that the ids held in ``lists`` (name -> 1-D id tensor) are exactly the ids
    ``i >= 1`` with ``free_mask[i]`` True, each held once, all within ``1..len(mask)-1``,
    and that id 0 is never free. O(pool size + listed ids).

    Raises:
        InvariantError: naming the offending ids: out of range, held twice (within a list
            or across lists), marked in use but listed as free, or marked free but held by
            no list (leaked).
    """
    n = free_mask.numel() - 1
    if bool(free_mask[0]):
        raise InvariantError(f"{owner}: reserved {kind} 0 is marked free")
    parts = [t.reshape(-1).to(torch.int64) for t in lists.values()]
    held = torch.cat(parts) if parts else free_mask.new_zeros(0, dtype=torch.int64)
    oob = (held < 1) | (held > n)
    if bool(oob.any()):
        where = [name for name, t in lists.items() if bool(((t < 1) | (t > n)).any())]
        raise InvariantError(
            f"{owner}: free {kind}s out of range 1..{n} in {where}: "
            f"{describe_ids(held[oob].tolist())}"
        )
    counts = torch.bincount(held, minlength=n + 1)
    dup = torch.nonzero(counts > 1).reshape(-1)
    if dup.numel():
        raise InvariantError(
            f"{owner}: {kind}s held twice across {list(lists)} (duplicated): "
            f"{describe_ids(dup.tolist())}"
        )
    listed = counts > 0
    in_use_but_listed = torch.nonzero(listed & ~free_mask).reshape(-1)
    if in_use_but_listed.numel():
        raise InvariantError(
            f"{owner}: {kind}s both in a free list and marked in use: "
            f"{describe_ids(in_use_but_listed.tolist())}"
        )
    leaked = torch.nonzero(free_mask & ~listed).reshape(-1)
    if leaked.numel():
        raise InvariantError(
            f"{owner}: {kind}s marked free but held by no free list (leaked): "
            f"{describe_ids(leaked.tolist())}"
        )
