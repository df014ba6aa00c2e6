"""Counters of a RadixCache: queries, hit tokens, inserted and evicted tokens, hit rates.

The hit rate is token-weighted: ``hit_tokens / queried_tokens`` over every query, and over
a rolling window of the last ``window`` queries (one ``match_prefix`` call each). Recording
a query is one list append; reading the counters folds the new ones in (amortized O(1)).
"""
from __future__ import annotations

from typing import NamedTuple

from radixkv.errors import InvalidArgumentError

__all__ = ["CacheMetrics", "MetricsSnapshot"]


class MetricsSnapshot(NamedTuple):
    """A consistent copy of the counters at one moment."""

    queries: int
    queried_tokens: int
    hit_tokens: int
    inserts: int
    inserted_tokens: int
    evictions: int
    evicted_tokens: int
    hit_rate: float
    window_queries: int
    window_hit_rate: float


class CacheMetrics:
    """Counters updated by the cache; read them with :meth:`snapshot`.

    Queries are logged as ``(queried, hit)`` pairs: recording one is a list append (the
    match hot path). Reading a counter or a snapshot first adds the pairs logged since the
    last read to the totals and to the window's sums (each pair enters once and leaves the
    window once); the log keeps at most ``2 * window`` pairs. Amortized O(1) per query.

    Args:
        window: number of most recent queries the rolling hit rate covers (>= 1).
    """

    __slots__ = ("window", "inserts", "inserted_tokens", "evictions", "evicted_tokens",
                 "_log", "_seen", "_n", "_q", "_h", "_wq", "_wh")

    def __init__(self, window: int = 1000):
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise InvalidArgumentError(f"metrics window must be an int >= 1, got {window!r}")
        self.window = window
        self._log: list[tuple[int, int]] = []
        self.reset()

    def reset(self) -> None:
        """Zero every counter and empty the window."""
        self.inserts = 0
        self.inserted_tokens = 0
        self.evictions = 0
        self.evicted_tokens = 0
        self._log.clear()  # in place: ``query_log`` keeps its identity
        self._seen = 0  # pairs of the log already in the sums below
        self._n = self._q = self._h = 0  # totals: queries, queried tokens, hit tokens
        self._wq = self._wh = 0  # sums over the last ``window`` pairs of log[:_seen]

    def record_query(self, queried: int, hit: int) -> None:
        """One ``match_prefix`` of ``queried`` tokens that matched ``hit`` of them."""
        log = self._log
        log.append((queried, hit))
        if len(log) >= 2 * self.window:
            self.compact()

    @property
    def query_log(self) -> list[tuple[int, int]]:
        """The list :meth:`record_query` appends ``(queried, hit)`` pairs to; its identity
        never changes. A hot caller may append to it directly (no call frame), and must call
        :meth:`compact` once it holds ``2 * window`` pairs."""
        return self._log

    def compact(self) -> None:
        """Fold the logged pairs into the sums and keep only the last ``window``. O(log)."""
        log = self._log
        self._sync()
        cut = len(log) - self.window
        if cut > 0:
            del log[:cut]
            self._seen -= cut

    def _sync(self) -> None:
        """Add the pairs logged since the last read to the totals and the window sums."""
        log, seen, end, w = self._log, self._seen, len(self._log), self.window
        if seen == end:
            return
        qs, hs = zip(*log[seen:end])
        q, h = sum(qs), sum(hs)
        self._n += end - seen
        self._q += q
        self._h += h
        self._wq += q
        self._wh += h
        old_start, new_start = max(0, seen - w), max(0, end - w)
        if new_start > old_start:  # pairs that left the window
            oq, oh = zip(*log[old_start:new_start])
            self._wq -= sum(oq)
            self._wh -= sum(oh)
        self._seen = end

    @property
    def queries(self) -> int:
        """``match_prefix`` calls recorded."""
        self._sync()
        return self._n

    @property
    def queried_tokens(self) -> int:
        """Tokens queried in all."""
        self._sync()
        return self._q

    @property
    def hit_tokens(self) -> int:
        """Tokens matched in all."""
        self._sync()
        return self._h

    def record_insert(self, new_tokens: int) -> None:
        """One ``insert`` that stored ``new_tokens`` tokens not cached before."""
        self.inserts += 1
        self.inserted_tokens += new_tokens

    def record_evict(self, tokens: int) -> None:
        """One ``evict`` call that freed ``tokens`` tokens."""
        self.evictions += 1
        self.evicted_tokens += tokens

    def snapshot(self) -> MetricsSnapshot:
        """The counters and both hit rates (0.0 when nothing was queried)."""
        self._sync()
        queried, hit = self._q, self._h
        return MetricsSnapshot(
            queries=self._n,
            queried_tokens=queried,
            hit_tokens=hit,
            inserts=self.inserts,
            inserted_tokens=self.inserted_tokens,
            evictions=self.evictions,
            evicted_tokens=self.evicted_tokens,
            hit_rate=hit / queried if queried else 0.0,
            window_queries=min(self._n, self.window),
            window_hit_rate=self._wh / self._wq if self._wq else 0.0,
        )
