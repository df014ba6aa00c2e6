"""A fast block-level prefix-cache simulator with pluggable eviction policies.

Semantics of the Mooncake README's simulator and of a radix tree: a request (a chain of
blocks) hits its longest run of leading cached blocks; the matched path is protected while
space is made, then the remaining blocks are inserted as far as they fit; capacity counts
tokens; only leaves are evicted, so the cache holds prefix-closed chains. Policies choose
victims among evictable leaves through vectorized callbacks (:class:`KeyPolicy`: any
per-block sort key). Per request: O(1) numpy calls plus O(log n) per eviction and leaf
change. Policy names are the RadixCache's: :class:`TreePolicy` runs the tree's own pure
sort-key policies; any :class:`BlockPolicy` runs too. The interface lives in
:mod:`radixkv.bench.block_policy`. Details: ``docs/hitrate.md``, "The
block simulator".
"""
from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import numpy.typing as npt

from radixkv.bench.block_policy import BlockPolicy, TreePolicy, runs_on_blocks
from radixkv.cache import eviction
from radixkv.errors import (
    InvalidArgumentError,
    InvalidIndexError,
    InvariantError,
    LengthMismatchError,
    describe_ids,
)

if TYPE_CHECKING:  # pragma: no cover
    from radixkv.bench.progress import ProgressBar
    from radixkv.bench.traces import BlockTrace

__all__ = [
    "AccessResult", "SimResult", "BlockSim", "simulate", "make_policy", "available_policies",
]


class AccessResult(NamedTuple):
    """Outcome of one request: matched blocks/tokens, tokens inserted and evicted for it."""

    hit_blocks: int
    hit_tokens: int
    inserted_tokens: int
    evicted_tokens: int


class SimResult(NamedTuple):
    """Totals of a replay: hit tokens over prompt tokens, tokens evicted."""

    policy: str
    capacity_tokens: int
    requests: int
    prompt_tokens: int
    hit_tokens: int
    evicted_tokens: int

    @property
    def token_hit_rate(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


class BlockSim:
    """The simulated cache: which blocks are cached, their child counts, the protected path.

    Args:
        block_len: tokens per block (int array, ``(n_blocks,)``).
        parent: parent block per block (``-1`` for chain roots).
        capacity_tokens: cache size in tokens (>= 0).
        policy: a :class:`BlockPolicy` (attached here; one policy instance per simulator).

    ``now`` is the index of the current request (the logical clock policies read);
    ``inserted_total`` counts every token ever inserted (a virtual clock in tokens).
    """

    def __init__(self, block_len: npt.ArrayLike, parent: npt.ArrayLike, capacity_tokens: int, policy: BlockPolicy):
        block_len = np.asarray(block_len, dtype=np.int64)
        parent = np.asarray(parent, dtype=np.int32)
        if block_len.shape != parent.shape or block_len.ndim != 1:
            raise LengthMismatchError(f"block_len {block_len.shape} and parent {parent.shape} differ")
        if int(capacity_tokens) < 0:
            raise InvalidArgumentError(f"capacity_tokens must be >= 0, got {capacity_tokens}")
        self.block_len = block_len
        self.parent = parent
        self.capacity = int(capacity_tokens)
        n = len(block_len)
        self.cached = np.zeros(n, dtype=bool)
        self.n_children = np.zeros(n, dtype=np.int32)
        self.used = 0
        self.now = 0
        self.inserted_total = 0
        self.evicted_total = 0
        self.protected = -1
        self._open = False
        self.n_valid = n
        self.policy = policy
        policy.attach(self)

    @property
    def n_blocks(self) -> int:
        """Allocated block slots (per-block arrays of policies are this long)."""
        return len(self.block_len)

    def add_blocks(self, block_len: npt.ArrayLike, parent: npt.ArrayLike) -> int:
        """Register new blocks (ids ``n_valid ..``), growing every per-block array by
        doubling (amortized O(1) per block). Returns the first new id.

        Raises:
            LengthMismatchError: ``block_len`` and ``parent`` differ in length.
            InvalidIndexError: a parent that is not a known block (or -1).
        """
        block_len = np.asarray(block_len, dtype=np.int64)
        parent = np.asarray(parent, dtype=np.int32)
        if block_len.shape != parent.shape or block_len.ndim != 1:
            raise LengthMismatchError("block_len and parent differ in length")
        first, k = self.n_valid, len(block_len)
        ok = (parent >= -1) & (parent < first + np.arange(k))
        if not ok.all():
            raise InvalidIndexError(f"unknown parent blocks {describe_ids(parent[~ok])}")
        if first + k > self.n_blocks:
            new = max(2 * self.n_blocks, first + k, 64)
            extra = new - self.n_blocks
            self.block_len = np.concatenate([self.block_len, np.zeros(extra, np.int64)])
            self.parent = np.concatenate([self.parent, np.full(extra, -1, np.int32)])
            self.cached = np.concatenate([self.cached, np.zeros(extra, bool)])
            self.n_children = np.concatenate([self.n_children, np.zeros(extra, np.int32)])
            self.policy.grow(new)
        self.block_len[first:first + k] = block_len
        self.parent[first:first + k] = parent
        self.n_valid = first + k
        return first

    # ------------------------------------------------------------------ one request
    def _validate(self, ids: object) -> np.ndarray:
        if not isinstance(ids, np.ndarray) or ids.ndim != 1 or ids.dtype.kind not in "iu":
            raise InvalidArgumentError("block ids must be a 1-D integer numpy array")
        if len(ids) == 0:
            return ids
        if ids.min() < 0 or ids.max() >= self.n_valid:
            bad = ids[(ids < 0) | (ids >= self.n_valid)]
            raise InvalidIndexError(f"block ids out of range [0, {self.n_valid}): {describe_ids(bad)}")
        if self.parent[ids[0]] != -1 or (self.parent[ids[1:]] != ids[:-1]).any():
            raise InvalidArgumentError("block ids are not a chain from the root")
        return ids

    def lookup(self, ids: np.ndarray) -> int:
        """Number of leading cached blocks of ``ids`` (pure)."""
        miss = np.flatnonzero(~self.cached[ids])
        return int(miss[0]) if len(miss) else len(ids)

    def begin(self, ids: np.ndarray) -> int:
        """Match ``ids``: protect the matched path and tell the policy. Returns hit blocks.
        Must be followed by :meth:`finish` (with :meth:`evict` in between)."""
        if self._open:
            raise InvalidArgumentError("begin() called twice without finish()")
        ids = self._validate(ids)
        k = self.lookup(ids)
        self._open = True
        if k:
            tail = int(ids[k - 1])
            if self.n_children[tail] == 0:
                self.policy.leaf_removed(tail)
            self.protected = tail
            self.policy.on_hit(ids[:k])
        return k

    def evict(self, n_tokens: int) -> int:
        """Evict leaves until ``n_tokens`` are freed or nothing is evictable; returns freed."""
        freed = 0
        pol, bl, par, nch = self.policy, self.block_len, self.parent, self.n_children
        while freed < n_tokens:
            b = pol.victim()
            if b < 0:
                break
            if not self.cached[b] or nch[b] or b == self.protected:
                raise InvariantError(f"policy {pol.name} chose block {b}, which is not an evictable leaf")
            self.cached[b] = False
            ln = int(bl[b])
            self.used -= ln
            freed += ln
            pol.on_evict(b)
            p = int(par[b])
            if p >= 0:
                nch[p] -= 1
                if nch[p] == 0 and p != self.protected:
                    pol.leaf_added(p)
        self.evicted_total += freed
        return freed

    def finish(self, ids: np.ndarray, k: int) -> int:
        """Insert ``ids[k:]`` (as many as fit the free space) and unprotect the path.
        Returns inserted tokens.

        Raises:
            InvalidArgumentError: no open :meth:`begin`, or ``k`` is not its hit count.
        """
        if not self._open or not 0 <= k <= len(ids) or self.lookup(ids[:k]) != k:
            raise InvalidArgumentError("finish() must follow begin() with its hit count")
        self._open = False
        new = ids[k:]
        inserted = 0
        if len(new):
            lens = self.block_len[new]
            cum = np.cumsum(lens)
            m = int(np.searchsorted(cum, self.capacity - self.used, side="right"))
            new = new[:m]
            if m:
                inserted = int(cum[m - 1])
                self.cached[new] = True
                self.used += inserted
                self.inserted_total += inserted
                p = int(self.parent[new[0]])
                if p >= 0:
                    self.n_children[p] += 1          # p is the protected tail: not filed
                self.n_children[new[:-1]] = 1
                self.policy.on_insert(new)
                self.policy.leaf_added(int(new[-1]))
        tail = self.protected
        self.protected = -1
        if tail >= 0 and self.n_children[tail] == 0:
            self.policy.leaf_added(tail)
        self.now += 1
        return inserted

    def access(self, ids: np.ndarray) -> AccessResult:
        """One request: match, evict what the insertion needs, insert, unprotect."""
        k = self.begin(ids)
        hit_tokens = int(self.block_len[ids[:k]].sum())
        need = int(self.block_len[ids[k:]].sum())
        short = need - (self.capacity - self.used)
        freed = self.evict(short) if short > 0 else 0
        inserted = self.finish(ids, k)
        return AccessResult(k, hit_tokens, inserted, freed)

    # ------------------------------------------------------------------ checks
    def check_invariants(self) -> None:
        """Prefix closure, child counts, used tokens, capacity, and that the policy's
        evictable set is exactly the unprotected cached leaves. O(n_blocks)."""
        cached = np.flatnonzero(self.cached)
        par = self.parent[cached]
        orphans = cached[(par >= 0) & ~self.cached[np.maximum(par, 0)]]
        if len(orphans):
            raise InvariantError(f"cached blocks whose parent is not cached: {describe_ids(orphans)}")
        counts = np.bincount(par[par >= 0], minlength=self.n_blocks).astype(np.int32)
        bad = np.flatnonzero(counts != self.n_children)
        if len(bad):
            raise InvariantError(f"child counts wrong for blocks {describe_ids(bad)}")
        used = int(self.block_len[cached].sum())
        if used != self.used:
            raise InvariantError(f"used tokens {self.used} != sum of cached block lengths {used}")
        if self.used > self.capacity:
            raise InvariantError(f"used tokens {self.used} exceed capacity {self.capacity}")
        leaves = cached[self.n_children[cached] == 0]
        if self.protected >= 0:
            leaves = leaves[leaves != self.protected]
        filed = self.policy.evictable()
        extra = np.setdiff1d(filed, leaves)
        missing = np.setdiff1d(leaves, filed)
        if len(extra):
            raise InvariantError(f"policy {self.policy.name} files non-evictable blocks {describe_ids(extra)}")
        if len(missing):
            raise InvariantError(f"evictable leaves missing from policy {self.policy.name}: {describe_ids(missing)}")
        self.policy.check_invariants()


def available_policies() -> list[str]:
    """The registered RadixCache policies the simulator runs (pure sort keys), sorted."""
    return [n for n in eviction.available_policies() if runs_on_blocks(eviction.make_policy(n))]


def make_policy(policy: str | BlockPolicy) -> BlockPolicy:
    """A fresh simulator policy for a RadixCache policy name (:class:`TreePolicy` over the
    tree's own policy object), or ``policy`` itself if it is a :class:`BlockPolicy`.

    Raises:
        InvalidArgumentError: an unknown name (the message lists the known ones), or a
            policy that needs the tree (it keeps per-node state in hooks).
    """
    if isinstance(policy, BlockPolicy):
        return policy
    return TreePolicy(eviction.make_policy(policy))


def simulate(trace: BlockTrace, capacity_tokens: int, policy: str | BlockPolicy, progress: ProgressBar | None = None,
             check_every: int = 0) -> SimResult:
    """Replay a :class:`~radixkv.bench.traces.BlockTrace` through a fresh :class:`BlockSim`.

    ``policy``: a name or a fresh :class:`BlockPolicy`. ``progress``: optional object with
    ``update(n)``. ``check_every > 0`` runs :meth:`BlockSim.check_invariants` that often.
    """
    pol = make_policy(policy) if isinstance(policy, str) else policy
    sim = BlockSim(trace.block_len, trace.parent, capacity_tokens, pol)
    hit = 0
    off, blk = trace.offsets, trace.blocks
    for i in range(trace.n_requests):
        r = sim.access(blk[off[i]:off[i + 1]])
        hit += r.hit_tokens
        if progress is not None and (i & 255) == 255:
            progress.update(256)
        if check_every and i % check_every == 0:
            sim.check_invariants()
    return SimResult(pol.name, sim.capacity, trace.n_requests, trace.prompt_tokens, hit, sim.evicted_total)
