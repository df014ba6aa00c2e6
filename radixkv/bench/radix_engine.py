"""The real :class:`~radixkv.cache.RadixCache` as a hit-rate replay engine (``--engine radix``).

Each prompt runs the scheduler's cycle (``match_prefix -> inc_lock_ref -> evict -> alloc ->
insert -> free duplicate rows -> dec_lock_ref``) over a ``TokenToKVPoolAllocator`` of
``capacity`` slots, with the block simulator's semantics. The last partial page is padded
with :data:`PAD_TOKEN` (``2**31 - 1``, never a real token) whose *virtual* rows
(:class:`PaddedPoolAllocator`) are never allocated, so the pool counts real tokens only. The
remaining difference from the simulator: the tree evicts whole leaf nodes. Named ``radix``
in :data:`radixkv.bench.hitrate.ENGINES`. Details: ``docs/hitrate.md``, "The real
RadixCache".
"""
from __future__ import annotations

import inspect
from typing import NamedTuple

import numpy as np
import torch

from radixkv.allocator import TokenToKVPoolAllocator
from radixkv.cache import RadixCache, RadixKey
from radixkv.cache.eviction import EvictionPolicy, make_policy
from radixkv.cache.policies.aplru import AdaptiveProbationLRUPolicy
from radixkv.cache.tree_node import TreeNode
from radixkv.contracts import IndexLike
from radixkv.errors import CapacityError, InvalidArgumentError, InvariantError

__all__ = ["PAD_TOKEN", "PaddedPoolAllocator", "RadixReplayEngine", "PendingMatch",
           "default_policy_name", "make_radix_policy"]

#: Token used to pad a prompt's last partial page (int32 max; not a real token id).
PAD_TOKEN = int(np.iinfo(np.int32).max)
_ROW_LIMIT = 1 << 31


def default_policy_name() -> str:
    """The policy ``RadixCache`` uses when none is given (what ``--policy default`` names),
    read from its signature so that the two can never disagree."""
    return str(inspect.signature(RadixCache.__init__).parameters["eviction_policy"].default)


def make_radix_policy(policy: str | EvictionPolicy, capacity_tokens: int) -> EvictionPolicy:
    """A fresh RadixCache policy for a registry name (``default`` = the RadixCache default).
    ``aplru`` is told the pool size (its ghost window and bonus are relative to it).

    Raises:
        InvalidArgumentError: an unknown name.
    """
    if isinstance(policy, str):
        name = policy.strip().lower()
        if name == "default":
            name = default_policy_name()
        if name == AdaptiveProbationLRUPolicy.name:
            return AdaptiveProbationLRUPolicy(capacity_tokens=max(int(capacity_tokens), 1))
        return make_policy(name)
    return make_policy(policy)


class PaddedPoolAllocator(TokenToKVPoolAllocator):
    """A :class:`TokenToKVPoolAllocator` of ``size`` slots that also hands out *virtual*
    rows (ids ``> size``, unique, never allocated) for padding tokens.

    ``free`` drops the virtual rows it is given (counting them) and frees the real ones
    (same validation as the base class: bad real ids raise and nothing changes);
    ``is_free`` reports virtual rows as in use. ``pad_rows_live`` counts the virtual rows
    handed out and not freed yet. O(k) per call on top of the base class.
    """

    def __init__(self, size: int, device: torch.device | str = "cpu", checks: bool = True):
        super().__init__(size, device=device, checks=checks)
        self._next_pad = self.size + 1
        self.pad_rows_live = 0

    def pad_rows(self, n: int) -> np.ndarray:
        """``n`` fresh virtual rows (int64 numpy). O(n).

        Raises:
            CapacityError: the virtual ids would pass ``2**31`` (the tree's row limit).
        """
        n = int(n)
        if self._next_pad + n > _ROW_LIMIT:
            raise CapacityError(f"virtual padding rows exhausted (next id {self._next_pad})",
                                requested=n, available=_ROW_LIMIT - self._next_pad)
        rows = np.arange(self._next_pad, self._next_pad + n, dtype=np.int64)
        self._next_pad += n
        self.pad_rows_live += n
        return rows

    def free(self, free_index: IndexLike) -> None:
        if isinstance(free_index, torch.Tensor) and free_index.numel() and int(free_index.max()) > self.size:
            virtual = free_index > self.size
            k = int(virtual.sum())
            super().free(free_index[~virtual])
            self.pad_rows_live -= k
            return
        super().free(free_index)

    def is_free(self, indices: IndexLike) -> torch.Tensor:
        ids = torch.as_tensor(indices).to(self.device).reshape(-1)
        virtual = ids > self.size
        if not bool(virtual.any()):
            return super().is_free(ids)
        out = torch.zeros(ids.shape, dtype=torch.bool, device=self.device)
        out[~virtual] = super().is_free(ids[~virtual])
        return out


class PendingMatch(NamedTuple):
    """State between :meth:`RadixReplayEngine.match_prefix` and ``insert``."""

    tokens: np.ndarray     # the prompt as given
    key: RadixKey          # the padded prompt
    indices: torch.Tensor  # the tree's rows of the matched prefix
    last_node: TreeNode    # the locked node
    prefix_len: int        # matched tokens of the padded prompt


class RadixReplayEngine:
    """:class:`~radixkv.bench.hitrate.ReplayCache` over a real RadixCache (module doc).

    Args: ``capacity_tokens`` (pool size in prompt tokens, >= 0); ``policy`` (a RadixCache
    policy name, ``default`` allowed, or instance); ``page_size`` (>= 1); ``device``;
    ``checks`` (the allocator validates every ``free``; default).

    Per request: O(matched nodes) dict probes and O(prompt) byte work in the tree, a constant
    number of numpy / torch calls here, O(evicted nodes x log L) to evict.

    Raises (constructor): InvalidArgumentError for a bad size, page size or policy.
    """

    def __init__(self, capacity_tokens: int, policy: str | EvictionPolicy = "default",
                 page_size: int = 16, device: torch.device | str = "cpu", checks: bool = True):
        if isinstance(capacity_tokens, bool) or int(capacity_tokens) < 0:
            raise InvalidArgumentError(f"capacity_tokens must be >= 0, got {capacity_tokens!r}")
        if isinstance(page_size, bool) or int(page_size) < 1:
            raise InvalidArgumentError(f"page_size must be >= 1, got {page_size!r}")
        self.page_size = int(page_size)
        pol = make_radix_policy(policy, int(capacity_tokens))
        self.alloc = PaddedPoolAllocator(int(capacity_tokens), device=device, checks=checks)
        self.capacity = self.alloc.size
        self.cache = RadixCache(None, self.alloc, page_size=self.page_size, eviction_policy=pol)
        self._pending: PendingMatch | None = None

    @property
    def policy(self) -> EvictionPolicy:
        return self.cache.policy

    @property
    def used_tokens(self) -> int:
        """Real prompt tokens held by the tree (= allocated pool slots). O(1)."""
        return self.capacity - self.alloc.available_size()

    def _padded(self, tokens: np.ndarray) -> np.ndarray:
        if not isinstance(tokens, np.ndarray) or tokens.dtype != np.int32 or tokens.ndim != 1:
            raise InvalidArgumentError("tokens must be a 1-D int32 numpy array")
        pad = -len(tokens) % self.page_size
        if pad == 0:
            return tokens
        return np.concatenate([tokens, np.full(pad, PAD_TOKEN, dtype=np.int32)])

    def match_prefix(self, tokens: np.ndarray) -> int:
        """Match ``tokens`` and lock the matched path; returns the hit in prompt tokens.

        Raises (nothing changes): InvalidArgumentError for non-int32 / non-1-D tokens or a
        match still pending (no ``insert`` since the last match).
        """
        if self._pending is not None:
            raise InvalidArgumentError("match_prefix called twice without insert")
        key = RadixKey(self._padded(tokens))
        m = self.cache.match_prefix(key)
        self.cache.inc_lock_ref(m.last_node)
        self._pending = PendingMatch(tokens, key, m.device_indices, m.last_node, m.prefix_len)
        return min(m.prefix_len, len(tokens))

    def evict(self, n_tokens: int) -> int:
        """Evict leaves (the policy's order) until ``n_tokens`` pool slots are freed or
        nothing is evictable; returns the slots freed (whole nodes: possibly more)."""
        n = int(n_tokens)
        start = self.alloc.available_size()
        freed = 0
        while freed < n and self.cache.evictable_size() > 0:
            self.cache.evict(n - freed)      # counts padding too: loop until real slots
            freed = self.alloc.available_size() - start
        return freed

    def insert(self, tokens: np.ndarray) -> int:
        """Insert the pages of ``tokens`` after the matched prefix that fit the free slots,
        free duplicate rows, unlock. Returns the prompt tokens inserted.

        Raises (nothing changes): InvalidArgumentError unless it follows ``match_prefix``
        of the same array.
        """
        pend = self._pending
        if pend is None or pend.tokens is not tokens:
            raise InvalidArgumentError("insert must follow match_prefix of the same tokens")
        p, n_real, n_key = self.page_size, len(tokens), len(pend.key)
        k = pend.prefix_len
        first = k // p                                   # first page to insert
        real_per_page = np.minimum(p, n_real - p * np.arange(first, n_key // p, dtype=np.int64))
        fit = int(np.searchsorted(np.cumsum(real_per_page), self.alloc.available_size(), side="right"))
        inserted = int(real_per_page[:fit].sum())
        self._pending = None
        try:
            if fit:
                end = (first + fit) * p
                rows = self.alloc.alloc(inserted)
                if rows is None:
                    raise InvariantError(f"pool shows {self.alloc.available_size()} free slots "
                                         f"but cannot hand out {inserted}")
                parts = [pend.indices.cpu().numpy(), rows.cpu().numpy()]
                if end > n_real:
                    parts.append(self.alloc.pad_rows(end - n_real))
                value = np.concatenate(parts)
                done = self.cache.insert(pend.key[:end], value)
                if done > k:   # cached meanwhile by someone else: our rows there are duplicates
                    self.alloc.free(torch.from_numpy(value[k:done]).to(self.alloc.device))
        finally:
            self.cache.dec_lock_ref(pend.last_node)
        return inserted

    def check_invariants(self) -> None:
        """The tree's and the pool's audits, and conservation: every allocated slot is a
        row of the tree and every virtual row the tree holds is counted live. O(tree)."""
        if self._pending is not None:
            raise InvariantError("a match is pending (locked path): audit between requests")
        self.cache.check_invariants()
        self.alloc.check_invariants()
        rows = np.frombuffer(b"".join(n.vbuf for n in self.cache.iter_nodes()), dtype=np.int32)
        virtual = int((rows > self.capacity).sum())
        real = len(rows) - virtual
        if real != self.used_tokens:
            raise InvariantError(f"radix engine: the tree holds {real} pool rows, the pool lends "
                                 f"{self.used_tokens} (leaked or double-freed slots)")
        if virtual != self.alloc.pad_rows_live:
            raise InvariantError(f"radix engine: the tree holds {virtual} padding rows, "
                                 f"{self.alloc.pad_rows_live} are counted live")
