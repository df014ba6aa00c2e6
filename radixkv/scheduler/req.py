"""``Req``: the per-request record that the pools, the cache and the scheduler flow share.

Field names follow SGLang's ``Req`` so its users feel at home. Token ids are kept as int32
numpy arrays (the container the RadixCache prefers); ``fill_ids`` is the prompt plus the
output generated so far, i.e. every token whose KV row the request holds or will hold.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from radixkv.validation import as_token_array

if TYPE_CHECKING:
    from radixkv.cache.tree_node import TreeNode


@dataclass(eq=False)
class Req:
    """One request as the memory layers see it.

    Attributes: ``rid``; ``origin_input_ids`` / ``output_ids`` (int32); ``req_pool_idx`` (its
    ``req_to_token`` row, ``None`` until allocated); ``prefix_indices`` (KV rows of the matched
    prefix); ``last_node`` (the node locked for it); ``extra_key`` (cache namespace);
    ``priority``; ``mamba_pool_idx`` (its state slot, hybrid); ``kv_committed_len`` (tokens of
    ``fill_ids`` with KV written in its row); ``cache_protected_len`` (head of its row owned by
    the tree); ``mamba_ping_pong_track_buffer``, ``mamba_next_track_idx``,
    ``mamba_last_track_seqlen`` (:mod:`radixkv.scheduler.track`); ``decode_reserve`` (int64 KV
    slots held ahead for decode, front first, in no row and not in the tree;
    :mod:`radixkv.scheduler.decode_reserve`).
    """

    rid: str
    origin_input_ids: np.ndarray
    output_ids: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=np.int32))
    req_pool_idx: int | None = None
    prefix_indices: torch.Tensor | None = None
    last_node: TreeNode | None = None
    extra_key: str | None = None
    priority: int = 0
    mamba_pool_idx: int | None = None
    kv_committed_len: int = 0
    cache_protected_len: int = 0
    finished: bool = False
    mamba_ping_pong_track_buffer: list[int] | None = None
    mamba_next_track_idx: int = 0
    mamba_last_track_seqlen: int | None = None
    decode_reserve: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=np.int64))

    def __post_init__(self) -> None:
        self.origin_input_ids = as_token_array(self.origin_input_ids)
        self.output_ids = as_token_array(self.output_ids)

    @property
    def fill_ids(self) -> np.ndarray:
        """Prompt + output tokens (int32)."""
        if self.output_ids.size == 0:
            return self.origin_input_ids
        return np.concatenate([self.origin_input_ids, self.output_ids])

    @property
    def seq_len(self) -> int:
        return int(self.origin_input_ids.size + self.output_ids.size)

    @property
    def prefix_len(self) -> int:
        return 0 if self.prefix_indices is None else int(self.prefix_indices.numel())

    def append_output(self, token_id: int) -> None:
        self.output_ids = np.append(self.output_ids, np.int32(token_id))
