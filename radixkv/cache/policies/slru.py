"""``SLRUPolicy``: segmented LRU with a ghost history, a scan-resistant eviction policy.

New nodes start in *probation*; a match moves a node to *protected*, capped at
``protected_fraction`` of the cached tokens (past it, its LRU nodes are demoted through
``rekey``). Every probation leaf is evicted before any protected one, LRU within a segment.
An evicted node's signature (namespace + first ``max(page_size, 16)`` tokens, hashed) enters
a FIFO ghost of ``ghost_capacity``; a node re-inserted while in it is admitted as protected
(a hash collision only admits one node as protected). Cost: O(1) per hook, plus O(depth) on
insert/evict to find the namespace. Memory: one entry per protected node and per ghost entry.
Details: ``docs/internals.md``, "Segmented LRU".
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import Any

from radixkv.cache.policies.base import EvictionPolicy, PolicyNode
from radixkv.errors import InvalidArgumentError, InvariantError, describe_ids

__all__ = ["SLRUPolicy"]

_PROTECTED_BIT = 1 << 62  # segment weight in the sort key: above any clock tick


class SLRUPolicy(EvictionPolicy):
    """Segmented LRU (probation / protected) with a ghost history of evicted nodes.

    Args:
        protected_fraction: cap of the protected segment, as a fraction of cached tokens
            (0 < f <= 1).
        ghost_capacity: signatures of evicted nodes remembered (FIFO), >= 0.
        signature_tokens: tokens of a node's head hashed into its signature (at least the
            page size is used).
    """

    name = "slru"

    def __init__(self, protected_fraction: float = 0.8, ghost_capacity: int = 4096,
                 signature_tokens: int = 16):
        super().__init__()
        if not 0.0 < float(protected_fraction) <= 1.0:
            raise InvalidArgumentError(f"protected_fraction must lie in (0, 1], got {protected_fraction}")
        if int(ghost_capacity) < 0 or int(signature_tokens) < 1:
            raise InvalidArgumentError("ghost_capacity must be >= 0 and signature_tokens >= 1")
        self.protected_fraction = float(protected_fraction)
        self.ghost_capacity = int(ghost_capacity)
        self.signature_tokens = int(signature_tokens)
        self._sig_bytes = 4 * self.signature_tokens
        self.reset()

    def bind(self, rekey: Callable[[PolicyNode], None], page_size: int = 1) -> None:
        super().bind(rekey, page_size)
        self._sig_bytes = 4 * max(int(page_size), self.signature_tokens)

    def reset(self) -> None:
        self._protected: OrderedDict[PolicyNode, None] = OrderedDict()  # LRU first
        self._protected_tokens = 0
        self._tokens = 0
        self._ghost: OrderedDict[int, None] = OrderedDict()  # oldest first
        self.ghost_admissions = 0

    # -- ordering ---------------------------------------------------------------------------
    def sort_key(self, node: PolicyNode) -> Any:
        return node.last_access + (_PROTECTED_BIT if node.pstate == 1 else 0)

    # -- hooks ------------------------------------------------------------------------------
    def on_insert(self, node: PolicyNode) -> None:
        self._tokens += len(node.kbuf) >> 2
        node.pstate = 0
        sig = self._signature(node)
        if sig in self._ghost:
            del self._ghost[sig]
            self.ghost_admissions += 1
            self._promote(node)

    def on_hit(self, node: PolicyNode) -> None:
        if node.pstate == 1:
            self._protected.move_to_end(node)
        else:
            self._promote(node)

    def on_split(self, parent: PolicyNode, child: PolicyNode) -> None:
        parent.pstate = child.pstate
        if child.pstate == 1:  # tokens are shared between the two; the total is unchanged
            self._protected[parent] = None
            self._protected.move_to_end(child)

    def on_evict(self, node: PolicyNode) -> None:
        n = len(node.kbuf) >> 2
        self._tokens -= n
        if node.pstate == 1:
            del self._protected[node]
            self._protected_tokens -= n
        node.pstate = None
        if self.ghost_capacity:
            sig = self._signature(node)
            self._ghost[sig] = None
            self._ghost.move_to_end(sig)
            while len(self._ghost) > self.ghost_capacity:
                self._ghost.popitem(last=False)

    # -- internals --------------------------------------------------------------------------
    def _signature(self, node: PolicyNode) -> int:
        head = node
        while head.parent is not None:
            head = head.parent
        return hash((getattr(head, "extra_key", None), node.kbuf[:self._sig_bytes]))

    def _promote(self, node: PolicyNode) -> None:
        node.pstate = 1
        self._protected[node] = None
        self._protected_tokens += len(node.kbuf) >> 2
        cap = self.protected_fraction * self._tokens
        protected = self._protected
        while self._protected_tokens > cap and len(protected) > 1:
            old, _ = protected.popitem(last=False)  # never `node`: it is last, len > 1
            old.pstate = 0
            self._protected_tokens -= len(old.kbuf) >> 2
            self.rekey(old)  # its key dropped: the cache re-files it if it is filed

    def in_ghost(self, node: PolicyNode) -> bool:
        """Whether ``node``'s signature is in the ghost history (for tests and tools)."""
        return self._signature(node) in self._ghost

    def check_invariants(self, nodes: Iterable[PolicyNode]) -> None:
        nodes = list(nodes)
        protected = {id(n) for n in nodes if n.pstate == 1}
        listed = {id(n) for n in self._protected}
        if protected != listed:
            bad = [n.id for n in nodes if (id(n) in protected) != (id(n) in listed)]
            stale = [n.id for n in self._protected if id(n) not in protected]
            raise InvariantError(f"slru: protected segment list disagrees with node states: "
                                 f"nodes {describe_ids(bad + stale)}")
        tokens = sum(len(n.kbuf) >> 2 for n in nodes)
        ptokens = sum(len(n.kbuf) >> 2 for n in nodes if n.pstate == 1)
        if tokens != self._tokens or ptokens != self._protected_tokens:
            raise InvariantError(f"slru: token counts {self._tokens}/{self._protected_tokens} "
                                 f"!= tree {tokens}/{ptokens}")
        bad = [n.id for n in nodes if n.pstate not in (0, 1)]
        if bad:
            raise InvariantError(f"slru: nodes without a segment: {describe_ids(bad)}")
        if len(self._ghost) > self.ghost_capacity:
            raise InvariantError(f"slru: ghost holds {len(self._ghost)} > {self.ghost_capacity}")
