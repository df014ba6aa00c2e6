"""Policies of the :class:`~radixkv.cache.hybrid.mamba_radix_cache.MambaRadixCache` for its Mamba
states: which states the tree *admits*, and in which order it *evicts* them.

Admission: ``every`` (SGLang's: every chunk end and request end) or ``branch`` (Marconi:
request ends and branch-off points only). Eviction order over unpinned states: ``lru``
(lowest ``last_access`` first, ties in attach order) or ``flop`` (Marconi's FLOP-aware
utility per state byte plus recency, both normalised; lowest ``recency + alpha * utility``
first).

Costs for S states: ``lru`` pops victims off the incremental heap of
:mod:`radixkv.cache.hybrid.state_order`, O(log S) amortized each, nothing on the match path;
``flop`` ranks all candidates at each eviction, O(S log S) vectorized, with the nearest
state ancestors kept incrementally. Details: ``docs/internals.md``, "State admission and
eviction orders".
"""
from __future__ import annotations

import math
from collections.abc import Callable
from operator import attrgetter
from typing import TYPE_CHECKING, NamedTuple, TypeVar

import numpy as np

from radixkv.contracts import StatePool
from radixkv.errors import InvalidArgumentError

if TYPE_CHECKING:
    from radixkv.cache.hybrid.mamba_radix_cache import MambaRadixCache
    from radixkv.cache.tree_node import TreeNode

__all__ = [
    "FlopModel",
    "StateAdmission",
    "EveryAdmission",
    "BranchAdmission",
    "StateEvictionOrder",
    "LRUStateOrder",
    "FlopStateOrder",
    "make_admission",
    "make_state_order",
    "ADMISSION_POLICIES",
    "STATE_EVICTION_POLICIES",
]


class FlopModel(NamedTuple):
    """Prefill cost of a prefix: ``F(n) = per_token * n + per_pair * n * (n + 1) / 2`` FLOPs
    (position-independent work per token, plus full attention over every (query, key) pair),
    and ``state_bytes``, the bytes of one Mamba slot over all layers.

    Only ratios matter to the eviction order, so the estimate counts the dominant matmuls:
    per KDA layer ``2*d*(5P + H) + 2*P*d`` for its projections, ``6*P*K`` for the conv and
    ``8*H*D*D`` for the delta rule; per full layer ``8*d*P``; per layer ``6*d*m*d`` for a SwiGLU
    MLP of width ``m*d``; ``4*P`` per attention pair per full layer (P = H*D, d = hidden).
    """

    per_token: float
    per_pair: float
    state_bytes: int

    @classmethod
    def hybrid(cls, num_kda_layers: int, num_full_layers: int, num_heads: int, head_dim: int,
               conv_kernel: int = 4, hidden: int | None = None, mlp_mult: int = 2,
               state_bytes: int = 1) -> FlopModel:
        """The estimate above for a hybrid model of the given shape (``hidden`` defaults to
        ``num_heads * head_dim``)."""
        for name, v in (("num_kda_layers", num_kda_layers), ("num_full_layers", num_full_layers),
                        ("mlp_mult", mlp_mult)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise InvalidArgumentError(f"{name} must be an int >= 0, got {v!r}")
        for name, v in (("num_heads", num_heads), ("head_dim", head_dim), ("conv_kernel", conv_kernel),
                        ("state_bytes", state_bytes)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise InvalidArgumentError(f"{name} must be an int >= 1, got {v!r}")
        p = num_heads * head_dim
        d = p if hidden is None else int(hidden)
        kda = 2 * d * (5 * p + num_heads) + 2 * p * d + 6 * p * conv_kernel + 8 * num_heads * head_dim ** 2
        full = 8 * d * p
        mlp = 6 * d * mlp_mult * d
        layers = num_kda_layers + num_full_layers
        return cls(float(num_kda_layers * kda + num_full_layers * full + layers * mlp),
                   float(4 * p * num_full_layers), int(state_bytes))

    @classmethod
    def from_pool(cls, mamba_pool: StatePool, num_full_layers: int | None = None) -> FlopModel:
        """The estimate for a Kimi-Linear-like model whose KDA states ``mamba_pool`` holds:
        heads and head dim from its temporal state ``(H, D, D)``, the conv kernel from its
        conv state ``(K - 1, C)``, ``num_full_layers`` defaulting to one per three KDA layers
        (Kimi Linear's 3:1 ratio)."""
        t_shape, c_shape = mamba_pool.temporal_state_shape, mamba_pool.conv_state_shape
        heads, head_dim = int(t_shape[0]), int(t_shape[-1])
        kda = int(mamba_pool.num_layers)
        full = max(1, kda // 3) if num_full_layers is None else num_full_layers
        conv_b, temp_b = mamba_pool.slot_bytes
        return cls.hybrid(kda, full, heads, head_dim, conv_kernel=int(c_shape[0]) + 1,
                          state_bytes=int((conv_b + temp_b) * kda))

    def prefix_flops(self, n: np.ndarray) -> np.ndarray:
        """``F(n)`` for an array of prefix lengths (float64, vectorized)."""
        n = np.asarray(n, dtype=np.float64)
        return self.per_token * n + self.per_pair * n * (n + 1.0) * 0.5


# ----------------------------------------------------------------------------- admission
class StateAdmission:
    """Decides whether the tree keeps a request's state at the node an insert ends at.

    ``admit(cache, node, finished)`` is asked only when a state is available at exactly the
    node's end and the node holds none yet; ``finished`` tells a request end from a chunk end.
    """

    name = "base"

    def admit(self, cache: MambaRadixCache, node: TreeNode, finished: bool) -> bool:  # pragma: no cover
        raise NotImplementedError


class EveryAdmission(StateAdmission):
    """Every insert keeps its state (SGLang's MambaRadixCache)."""

    name = "every"

    def admit(self, cache: MambaRadixCache, node: TreeNode, finished: bool) -> bool:
        return True


class BranchAdmission(StateAdmission):
    """Request ends, and chunk ends at branch-off points (nodes with children) only."""

    name = "branch"

    def admit(self, cache: MambaRadixCache, node: TreeNode, finished: bool) -> bool:
        return finished or bool(node.children)


ADMISSION_POLICIES: dict[str, Callable[[], StateAdmission]] = {
    "every": EveryAdmission,
    "branch": BranchAdmission,
}


_P = TypeVar("_P")


def _from_registry(policy: object, base: type[_P], registry: dict[str, Callable[[], _P]], what: str,
                   also: str = "") -> _P:
    """``policy`` itself when it is a ``base`` instance, else a new instance of the entry of
    ``registry`` it names (case and surrounding blanks ignored). Raises InvalidArgumentError
    for an unknown name."""
    if isinstance(policy, base):
        return policy
    factory = registry.get(policy.strip().lower()) if isinstance(policy, str) else None
    if factory is None:
        raise InvalidArgumentError(f"unknown {what} {policy!r}; known: {', '.join(sorted(registry))}{also}")
    made: _P = factory()
    return made


def make_admission(policy: str | StateAdmission) -> StateAdmission:
    """An admission policy by name (``every``, ``branch``) or the instance itself.
    Raises InvalidArgumentError for an unknown name."""
    return _from_registry(policy, StateAdmission, ADMISSION_POLICIES, "state admission policy",
                          " (and 'none': cache disabled)")


# ----------------------------------------------------------------------------- eviction order
class StateEvictionOrder:
    """Orders candidate state nodes for eviction: ``order(cache, nodes)`` returns the
    positions of ``nodes`` (a list of unpinned nodes holding a state), first to evict first;
    ``victims(cache, k)`` the first ``k`` of the tree's unpinned states in that order."""

    name = "base"

    def order(self, cache: MambaRadixCache, nodes: list[TreeNode]) -> np.ndarray:  # pragma: no cover
        raise NotImplementedError

    def victims(self, cache: MambaRadixCache, k: int) -> list[TreeNode]:
        """The first ``k`` unpinned states of the order (all of them when fewer): ranks the
        unpinned states (``StateTable.unpinned``, attach order) with :meth:`order`.
        O(S log S)."""
        nodes = cache.state_table.unpinned()
        return [nodes[int(i)] for i in self.order(cache, nodes)[:k]]


def _last_access(nodes: list[TreeNode]) -> np.ndarray:
    return np.fromiter(map(_get_last_access, nodes), dtype=np.float64, count=len(nodes))


_get_last_access = attrgetter("last_access")


class LRUStateOrder(StateEvictionOrder):
    """Least recently used state first (ties: the state attached first goes first)."""

    name = "lru"

    def order(self, cache: MambaRadixCache, nodes: list[TreeNode]) -> np.ndarray:
        """A stable sort by ``last_access``. O(S log S): the reference of :meth:`victims`."""
        return np.argsort(_last_access(nodes), kind="stable")

    def victims(self, cache: MambaRadixCache, k: int) -> list[TreeNode]:
        """Off the tree's LRU heap (``StateTable.lru``): what ranking all unpinned states
        with :meth:`order` gives, in O((k + stale entries) x log S) amortized. A subclass that
        overrides :meth:`order` gets the full ranking instead."""
        if type(self).order is not LRUStateOrder.order:
            return StateEvictionOrder.victims(self, cache, k)
        states = cache.state_table
        return states.lru.pop_victims(k, states.pins)


class FlopStateOrder(StateEvictionOrder):
    """FLOP-aware order (see the module docstring): lowest ``recency + alpha * utility``
    first. ``flop_model`` defaults to the cache's (``cache.flop_model``)."""

    name = "flop"
    needs_ancestors = True  # the tree keeps each state's nearest state ancestor (StateAncestors)

    def __init__(self, alpha: float = 1.0, flop_model: FlopModel | None = None):
        if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha) or alpha < 0:
            raise InvalidArgumentError(f"alpha must be a finite number >= 0, got {alpha!r}")
        self.alpha = float(alpha)
        self.flop_model = flop_model

    def utilities(self, cache: MambaRadixCache, nodes: list[TreeNode]) -> np.ndarray:
        """Prefill FLOPs each state saves over its nearest state ancestor, per state byte.
        O(len) when the tree keeps the ancestors (built with this order), else
        O(len x tombstones crossed)."""
        states = cache.state_table
        if states.anc is not None:  # kept up to date by the tree: two gathers
            slot_of = states.slot_of
            slots = np.fromiter(map(slot_of.__getitem__, nodes), dtype=np.intp, count=len(nodes))
            return self._utilities(cache, states.end[slots], states.anc.above[slots])
        near = cache.nearest_state_ancestor_end  # a tree built for another order: walk up
        above = np.fromiter(map(near, nodes), dtype=np.int64, count=len(nodes))
        return self._utilities(cache, cache.state_positions(nodes), above)

    def _utilities(self, cache: MambaRadixCache, ends: np.ndarray, above: np.ndarray) -> np.ndarray:
        model = self.flop_model or cache.flop_model
        saved: np.ndarray = (model.prefix_flops(ends) - model.prefix_flops(above)) / float(model.state_bytes)
        return saved

    def _rank(self, last_access: np.ndarray, util: np.ndarray) -> np.ndarray:
        """Positions, first to evict first, of candidates with these ``last_access`` and
        utilities (n >= 2). O(n log n), vectorized."""
        n = len(last_access)
        rank = np.empty(n, dtype=np.float64)
        rank[np.argsort(last_access, kind="stable")] = np.arange(n, dtype=np.float64)
        recency = rank / (n - 1)
        top = float(util.max())
        score = recency + (self.alpha * util / top if top > 0 else 0.0)
        return np.argsort(score, kind="stable")

    def order(self, cache: MambaRadixCache, nodes: list[TreeNode]) -> np.ndarray:
        n = len(nodes)
        if n <= 1:
            return np.arange(n)
        return self._rank(_last_access(nodes), self.utilities(cache, nodes))

    def victims(self, cache: MambaRadixCache, k: int) -> list[TreeNode]:
        """:meth:`order` over the tree's unpinned states (attach order), its first ``k``;
        with the tree's ancestors (``StateTable.anc``), straight from the state table's
        arrays: one pass over the states for ``last_access``, the rest vectorized. O(S log S)."""
        states = cache.state_table
        if states.anc is None or type(self).order is not FlopStateOrder.order:
            return StateEvictionOrder.victims(self, cache, k)
        slot_of, pins = states.slot_of, states.pins
        nodes = list(slot_of)
        slots = np.fromiter(slot_of.values(), dtype=np.intp, count=len(nodes))
        la = _last_access(nodes)
        pinned = [slot_of[p] for p in pins if p in slot_of] if pins else None
        if pinned:  # candidates: the unpinned states, in attach order
            free = np.ones(len(states.node_of), dtype=bool)
            free[pinned] = False
            keep = np.flatnonzero(free[slots])
            slots, la = slots[keep], la[keep]
        else:
            keep = None
        if len(slots) <= 1:
            first = np.arange(len(slots))
        else:
            first = self._rank(la, self._utilities(cache, states.end[slots], states.anc.above[slots]))
        first = first[:k] if keep is None else keep[first[:k]]
        return [nodes[i] for i in first.tolist()]


STATE_EVICTION_POLICIES: dict[str, Callable[[], StateEvictionOrder]] = {
    "lru": LRUStateOrder,
    "flop": FlopStateOrder,
}


def make_state_order(policy: str | StateEvictionOrder) -> StateEvictionOrder:
    """A state eviction order by name (``lru``, ``flop``) or the instance itself.
    Raises InvalidArgumentError for an unknown name."""
    return _from_registry(policy, StateEvictionOrder, STATE_EVICTION_POLICIES, "state eviction policy")
