"""``AdaptiveProbationLRUPolicy`` ("aplru"): LRU in virtual time with an adaptive bonus for
nodes that were reused, ported from the block simulator's research policy
(``AdaptiveProbationLRU`` in ``benchmarks/policy_research``; see ``docs/hitrate.md``).

Per node (``node.pstate = [key, f, start, ns]``): ``f`` counts the requests through it
(class 1 iff ``f >= 2``); ``key = vclock at the last touch + B * class`` (smallest evicted
first; ``B = 0`` is LRU). A ghost of evicted signatures (namespace, offset, first page)
expires after ``window x capacity`` inserted tokens; a node re-inserted while in it gets its
``f`` back and moves ``B`` toward the class that lost it (ARC's rule on rates), within
``[0, b_max x capacity]``. ``monotonic = False``. Cost: O(1) per hook; memory: a 4-item list
per node plus the ghost. The rules in full: ``docs/internals.md``, "Adaptive-probation LRU
as implemented".
"""
from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

from radixkv.cache.policies.base import EvictionPolicy, PolicyNode
from radixkv.errors import InvalidArgumentError, InvariantError, describe_ids

__all__ = ["AdaptiveProbationLRUPolicy", "GhostEntry"]

_KEY, _F, _START, _NS = 0, 1, 2, 3


class GhostEntry(NamedTuple):
    """What the ghost remembers of an evicted node."""

    evicted_at: int   # vclock at the eviction
    cls: int          # 1 iff the node had been reused (f >= 2)
    f: int            # requests through the node
    tokens: int       # the node's length


class AdaptiveProbationLRUPolicy(EvictionPolicy):
    """Adaptive-probation LRU for the RadixCache (see the module docstring).

    Args:
        capacity_tokens: pool size in tokens (> 0), or ``None`` for the high-water mark.
        window: ghost lifetime, in multiples of the capacity of inserted tokens (> 0).
        gain: step of the ``B`` update (>= 0; 0 freezes ``B``).
        b0, b_max: initial ``B`` as a fraction of the capacity (>= 0), and its bound (>= b0).
        max_ghost_entries: hard bound on the ghost's entries (>= 0).

    Raises:
        InvalidArgumentError: a parameter out of range.
    """

    name = "aplru"
    monotonic = False

    def __init__(self, capacity_tokens: int | None = None, window: float = 4.0, gain: float = 1.0,
                 b0: float = 0.25, b_max: float = 64.0, max_ghost_entries: int = 1 << 20):
        super().__init__()
        if capacity_tokens is not None and (isinstance(capacity_tokens, bool) or int(capacity_tokens) < 1):
            raise InvalidArgumentError(f"capacity_tokens must be None or >= 1, got {capacity_tokens!r}")
        if not float(window) > 0 or not float(gain) >= 0 or not float(b0) >= 0 or not float(b_max) >= float(b0):
            raise InvalidArgumentError(
                f"need window > 0, gain >= 0, 0 <= b0 <= b_max; got window={window}, gain={gain}, "
                f"b0={b0}, b_max={b_max}")
        if int(max_ghost_entries) < 0:
            raise InvalidArgumentError(f"max_ghost_entries must be >= 0, got {max_ghost_entries}")
        self.capacity_tokens = None if capacity_tokens is None else int(capacity_tokens)
        self.window, self.gain, self.b0, self.b_max = float(window), float(gain), float(b0), float(b_max)
        self.max_ghost_entries = int(max_ghost_entries)
        self._sig_bytes = 4
        self.reset()

    def bind(self, rekey: Callable[[PolicyNode], None], page_size: int = 1) -> None:
        super().bind(rekey, page_size)
        self._sig_bytes = 4 * int(page_size)

    def reset(self) -> None:
        """Forget everything (the cache was reset): clock, bonus, ghost, counters."""
        self.vclock = 0
        self._tokens = 0
        self._high = 0
        self.B: float | None = None if self.capacity_tokens is None else self.b0 * self.capacity_tokens
        self._ghost: OrderedDict[int, GhostEntry] = OrderedDict()  # oldest eviction first
        self._expiry: deque[tuple[int, int, int]] = deque()  # (evicted_at, cls, tokens), for the class token counters
        self.ghost_tokens = [0, 0]
        self.ghost_hits = 0

    # -- derived ----------------------------------------------------------------------------
    @property
    def capacity(self) -> int:
        """The capacity the window and ``B`` are relative to (tokens, >= 1)."""
        return self.capacity_tokens if self.capacity_tokens is not None else max(self._high, 1)

    @property
    def bonus(self) -> float:
        """The current ``B`` (tokens of virtual time a reused node gains)."""
        return self.B if self.B is not None else self.b0 * self.capacity

    def signature(self, node: PolicyNode) -> int:
        """The ghost key of a live node: hash of (namespace, token offset, first page)."""
        ps = node.pstate
        return hash((ps[_NS], ps[_START], node.kbuf[:self._sig_bytes]))

    def in_ghost(self, node: PolicyNode) -> bool:
        """Whether ``node``'s signature is in the ghost (for tests and tools). O(1)."""
        return self.signature(node) in self._ghost

    def ghost_size(self) -> int:
        return len(self._ghost)

    # -- ordering ---------------------------------------------------------------------------
    def sort_key(self, node: PolicyNode) -> Any:
        return (node.pstate[_KEY], node.last_access)

    # -- hooks ------------------------------------------------------------------------------
    def on_insert(self, node: PolicyNode) -> None:
        n = len(node.kbuf) >> 2
        self._tokens += n
        if self._tokens > self._high:
            self._high = self._tokens
        self.vclock += n
        parent: Any = node.parent  # a PolicyNode, or the NamespaceHead (never None: node is no head)
        pps = parent.pstate
        if parent.parent is None:            # a namespace head
            start, ns = 0, parent.extra_key
        else:
            start, ns = pps[_START] + (len(parent.kbuf) >> 2), pps[_NS]
        self._expire()
        f = 1
        if self._ghost:
            entry = self._ghost.pop(hash((ns, start, node.kbuf[:self._sig_bytes])), None)
            if entry is not None:
                f = entry.f + 1
                self.ghost_hits += 1
                self._adapt(entry.cls, min(entry.tokens, n))
        node.pstate = [self.vclock + (self.bonus if f >= 2 else 0.0), f, start, ns]

    def on_hit(self, node: PolicyNode) -> None:
        ps = node.pstate
        ps[_F] += 1
        ps[_KEY] = self.vclock + self.bonus        # f >= 2 now

    def on_split(self, parent: PolicyNode, child: PolicyNode) -> None:
        cs = child.pstate
        parent.pstate = [cs[_KEY], cs[_F], cs[_START], cs[_NS]]
        cs[_START] += len(parent.kbuf) >> 2

    def on_evict(self, node: PolicyNode) -> None:
        n = len(node.kbuf) >> 2
        self._tokens -= n
        if self.B is None:
            self.B = self.b0 * self.capacity
        ps = node.pstate
        cls = 1 if ps[_F] >= 2 else 0
        if self.max_ghost_entries:
            sig = hash((ps[_NS], ps[_START], node.kbuf[:self._sig_bytes]))
            ghost = self._ghost
            ghost[sig] = GhostEntry(self.vclock, cls, ps[_F], n)
            ghost.move_to_end(sig)
            while len(ghost) > self.max_ghost_entries:
                ghost.popitem(last=False)
        self._expiry.append((self.vclock, cls, n))
        self.ghost_tokens[cls] += n
        node.pstate = None

    # -- internals --------------------------------------------------------------------------
    def _expire(self) -> None:
        """Drop ghost entries (and class-counter contributions) older than the window."""
        horizon = self.vclock - self.window * self.capacity
        exp = self._expiry
        while exp and exp[0][0] < horizon:
            _, c, ln = exp.popleft()
            self.ghost_tokens[c] -= ln
        ghost = self._ghost
        while ghost:
            sig, entry = next(iter(ghost.items()))
            if entry.evicted_at >= horizon:
                break
            del ghost[sig]

    def _adapt(self, cls: int, lost: int) -> None:
        """A class-``cls`` node came back ``lost`` tokens too late: move ``B`` toward it."""
        if self.B is None:
            self.B = self.b0 * self.capacity
        g0, g1 = max(self.ghost_tokens[0], 1), max(self.ghost_tokens[1], 1)
        if cls:
            self.B += self.gain * lost * max(1.0, g0 / g1)
        else:
            self.B -= self.gain * lost * max(1.0, g1 / g0)
        self.B = min(self.b_max * self.capacity, max(0.0, self.B))

    # -- audit ------------------------------------------------------------------------------
    def check_invariants(self, nodes: Iterable[PolicyNode]) -> None:
        """Per node: a state ``[key, f >= 1, start, ns]`` whose offset and namespace follow
        from its parent, and a key not above ``vclock + b_max x capacity``; the token count
        equals the tree's; the ghost is within its bound and the class counters equal the
        unexpired evictions. O(nodes + ghost)."""
        nodes = list(nodes)
        cap = self.capacity
        top = self.vclock + self.b_max * cap
        bad_state, bad_pos, bad_key = [], [], []
        tokens = 0
        for node in nodes:
            tokens += len(node.kbuf) >> 2
            ps = node.pstate
            if not isinstance(ps, list) or len(ps) != 4 or not isinstance(ps[_F], int) or ps[_F] < 1:
                bad_state.append(node.id)
                continue
            parent: Any = node.parent  # a PolicyNode, or the NamespaceHead
            if parent.parent is None:
                want = (0, parent.extra_key)
            elif isinstance(parent.pstate, list) and len(parent.pstate) == 4:
                want = (parent.pstate[_START] + (len(parent.kbuf) >> 2), parent.pstate[_NS])
            else:
                want = None
            if want is None or (ps[_START], ps[_NS]) != want:
                bad_pos.append(node.id)
            if not 0 <= ps[_KEY] <= top:
                bad_key.append(node.id)
        if bad_state:
            raise InvariantError(f"aplru: nodes without a valid state [key, f>=1, start, ns]: "
                                 f"{describe_ids(bad_state)}")
        if bad_pos:
            raise InvariantError(f"aplru: nodes whose offset/namespace disagree with their parent: "
                                 f"{describe_ids(bad_pos)}")
        if bad_key:
            raise InvariantError(f"aplru: nodes keyed outside [0, vclock + b_max x capacity]: "
                                 f"{describe_ids(bad_key)}")
        if tokens != self._tokens:
            raise InvariantError(f"aplru: counts {self._tokens} cached tokens, the tree holds {tokens}")
        if len(self._ghost) > self.max_ghost_entries:
            raise InvariantError(f"aplru: ghost holds {len(self._ghost)} > {self.max_ghost_entries} entries")
        per_class = [0, 0]
        for _, c, ln in self._expiry:
            per_class[c] += ln
        if per_class != self.ghost_tokens:
            raise InvariantError(f"aplru: ghost class counters {self.ghost_tokens} != unexpired "
                                 f"evictions {per_class}")
        if self.B is not None and not 0.0 <= self.B <= self.b_max * cap:
            raise InvariantError(f"aplru: bonus B={self.B} outside [0, {self.b_max} x {cap}]")
