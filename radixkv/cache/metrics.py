"""Counters of a RadixCache: queries, hit tokens, inserted and evicted tokens, hit rates.

The hit rate is token-weighted: ``hit_tokens / queried_tokens`` over every query, and over
a rolling window of the last ``window`` queries (one ``match_prefix`` call each). Recording
a query is one list append (amortized O(1)); reading the counters is O(window).
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

    Queries are logged as ``(queried, hit)`` pairs: recording one is a list append (O(1),
    the match hot path); once the log holds ``2 * window`` pairs, all but the last
    ``window`` are folded into running totals (amortized O(1) per query). Reading the
    query counters or a snapshot sums the log: O(window).

    Args:
        window: number of most recent queries the rolling hit rate covers (>= 1).
    """

    __slots__ = ("window", "inserts", "inserted_tokens", "evictions", "evicted_tokens",
                 "_log", "_fold_at", "_folded")

    def __init__(self, window: int = 1000):
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise InvalidArgumentError(f"metrics window must be an int >= 1, got {window!r}")
        self.window = window
        self._fold_at = 2 * window
        self.reset()

    def reset(self) -> None:
        """Zero every counter and empty the window."""
        self.inserts = 0
        self.inserted_tokens = 0
        self.evictions = 0
        self.evicted_tokens = 0
        self._log: list = []
        self._folded = (0, 0, 0)  # queries, queried tokens, hit tokens folded out of the log

    def record_query(self, queried: int, hit: int) -> None:
        """One ``match_prefix`` of ``queried`` tokens that matched ``hit`` of them."""
        log = self._log
        log.append((queried, hit))
        if len(log) >= self._fold_at:
            self._fold()

    def _fold(self) -> None:
        log = self._log
        cut = len(log) - self.window
        if cut <= 0:
            return
        n, q, h = self._folded
        old_q, old_h = zip(*log[:cut])
        self._folded = (n + cut, q + sum(old_q), h + sum(old_h))
        del log[:cut]

    def _totals(self):
        n, q, h = self._folded
        log = self._log
        if log:
            qs, hs = zip(*log)
            return n + len(log), q + sum(qs), h + sum(hs)
        return n, q, h

    @property
    def queries(self) -> int:
        """``match_prefix`` calls recorded. O(window)."""
        return self._folded[0] + len(self._log)

    @property
    def queried_tokens(self) -> int:
        """Tokens queried in all. O(window)."""
        return self._totals()[1]

    @property
    def hit_tokens(self) -> int:
        """Tokens matched in all. O(window)."""
        return self._totals()[2]

    def record_insert(self, new_tokens: int) -> None:
        """One ``insert`` that stored ``new_tokens`` tokens not cached before."""
        self.inserts += 1
        self.inserted_tokens += new_tokens

    def record_evict(self, tokens: int) -> None:
        """One ``evict`` call that freed ``tokens`` tokens."""
        self.evictions += 1
        self.evicted_tokens += tokens

    def snapshot(self) -> MetricsSnapshot:
        """The counters and both hit rates (0.0 when nothing was queried). O(window)."""
        queries, queried, hit = self._totals()
        win = self._log[-self.window:]
        win_q = win_h = 0
        if win:
            qs, hs = zip(*win)
            win_q, win_h = sum(qs), sum(hs)
        return MetricsSnapshot(
            queries=queries,
            queried_tokens=queried,
            hit_tokens=hit,
            inserts=self.inserts,
            inserted_tokens=self.inserted_tokens,
            evictions=self.evictions,
            evicted_tokens=self.evicted_tokens,
            hit_rate=hit / queried if queried else 0.0,
            window_queries=len(win),
            window_hit_rate=win_h / win_q if win_q else 0.0,
        )
