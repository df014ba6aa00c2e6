"""``PageFreeList``: the free-list core shared by the KV slot allocators.

Bookkeeping of the ids ``1..num_ids`` (KV slots, or pages when ``page_size > 1``; id 0 is
reserved) with SGLang's semantics: a FIFO ring ``free_pages``, deferred ``release_pages``
merged and sorted only when an allocation would fall short (``need_sort``), free groups, and
``backup()``/``restore()``. A bool mask ``not_in_use[id]`` makes the double-free check O(k).

Cost (k ids, F free): ``alloc`` O(k) (+ O(F log F) for a merge), ``free`` O(k log k) checked,
``backup`` O(1), ``restore`` O(ids changed since the backup). Memory: 9 bytes per id (13 with
``need_sort``). A backup whose ring entries were overwritten, taken before ``clear()``, or on
a discarded future raises ``StaleBackupError``; the speculative pattern (backup, allocate,
maybe free, restore) always qualifies. The full rule: ``docs/internals.md``, "The free-list
core".
"""
from __future__ import annotations

import bisect
import itertools
from typing import NamedTuple, cast

import numpy as np
import torch

from radixkv.allocator import native
from radixkv.allocator.host_view import HostViews, set_mask
from radixkv.allocator.id_ring import IdRing
from radixkv.allocator.invariants import check_free_lists
from radixkv.errors import (
    InvalidArgumentError,
    InvariantError,
    StaleSessionError,
)
from radixkv.validation import check_count, check_ids_to_free, sort_ids

_OWNER_IDS = itertools.count(1)
_MAX_LIVE_BACKUPS = 1024
# A free goes through ``free_runs`` when its ids form at most this many runs of consecutive
# ids (an evicted leaf's rows are one or a few runs): the run checks loop over runs in Python.
MAX_RUNS = 16


def id_runs(a: np.ndarray, max_runs: int = MAX_RUNS) -> tuple[np.ndarray, np.ndarray] | None:
    """``(starts, ends)`` of the maximal runs of consecutive ascending ids in the 1-D int64
    array ``a`` (``a[i + 1] == a[i] + 1`` inside a run; ``ends`` exclusive), in ``a``'s
    order, or None when ``a`` is empty or has more than ``max_runs`` runs. O(len(a))."""
    if a.size == 0:
        return None
    breaks = np.flatnonzero(a[1:] - a[:-1] != 1)
    if breaks.size >= max_runs:
        return None
    if breaks.size == 0:
        return a[:1], a[-1:] + 1
    return a[np.concatenate(([0], breaks + 1))], a[np.append(breaks, a.size - 1)] + 1


class StaleBackupError(StaleSessionError):
    """A backup that can no longer be restored (taken before ``clear()``, in a discarded
    future, or overwritten in the rings)."""


class FreeGroupError(InvalidArgumentError):
    """Free-group misuse: nested ``free_group_begin``, ``free_group_end`` without a begin,
    or a backup/restore while a group is open."""


class FreeListState(NamedTuple):
    """An opaque O(1) snapshot returned by ``backup()`` (absolute ring positions)."""

    owner: int
    stamp: int
    head: int
    tail: int
    release_head: int
    release_tail: int
    merges: int


class FreeListCounts(NamedTuple):
    """Counts of ids, each in one place: ``free + release + group + in_use == num_ids``."""

    num_ids: int
    free: int
    release: int
    group: int
    in_use: int


class PageFreeList(HostViews):
    """Free list of ids ``1..num_ids`` on ``device`` (see the module docstring).

    Args:
        num_ids: usable ids (``1..num_ids``).
        device: where ids live.
        need_sort: keep freed ids in ``release_pages`` until a merge (SGLang's need_sort).
        checks: validate frees (range, double free, duplicates). Off only for benchmarks.
        kind: the word used for ids in error messages ("slot" or "page").
    """

    def __init__(self, num_ids: int, device: torch.device | str, *, need_sort: bool, checks: bool, kind: str):
        self.num_ids = check_count(num_ids, "num_ids")
        self.device = torch.device(device)
        self.need_sort = bool(need_sort)
        self.checks = bool(checks)
        self.kind = kind
        self._ring = IdRing(2 * self.num_ids, self.device)
        self._rel = IdRing(self.num_ids if self.need_sort else 0, self.device)
        self._not_in_use = torch.zeros(self.num_ids + 1, dtype=torch.bool, device=self.device)
        self._owner = next(_OWNER_IDS)
        self._group: list[torch.Tensor] | None = None
        self._merges = 0
        self._stamps = 0
        self.clear()

    # ------------------------------------------------------------------ counts
    def available(self) -> int:
        """Ids in ``free_pages`` plus ``release_pages`` (not an open group). O(1)."""
        return len(self._ring) + len(self._rel)

    def counts(self) -> FreeListCounts:
        """Counts by place. O(1)."""
        free, rel, grp = len(self._ring), len(self._rel), self._group_count
        return FreeListCounts(self.num_ids, free, rel, grp, self.num_ids - free - rel - grp)

    def free_ids(self) -> torch.Tensor:
        """A copy of ``free_pages`` in hand-out order. O(F)."""
        return self._ring.live().to(torch.int64)

    def release_ids(self) -> torch.Tensor:
        """A copy of ``release_pages``. O(pending)."""
        return self._rel.live().to(torch.int64)

    def is_free(self, ids: torch.Tensor) -> torch.Tensor:
        """``not_in_use`` for in-range int64 ids (free, pending release or in a group)."""
        return self._not_in_use[ids]

    # ------------------------------------------------------------------ alloc
    def ensure(self, n: int) -> bool:
        """Make the first ``n`` ids of ``free_pages`` ready to take, or return False (no id
        handed out) when fewer than ``n`` are available. As SGLang's ``alloc``: under
        need_sort, ``release_pages`` is merged into ``free_pages`` (sorted) whenever
        ``free_pages`` alone falls short, *before* the size check, so a failed call still
        leaves the merged order for the next one. O(1), or O(F log F) for a merge."""
        if self.need_sort and n > len(self._ring):
            self.merge_and_sort()
        return n <= len(self._ring)

    def peek(self, n: int) -> torch.Tensor:
        """The first ``n`` ids of ``free_pages`` (int32; a view valid until the next
        mutation). Call ``ensure(n)`` first. O(1) or O(n) when the ring wraps."""
        return self._ring.peek(n)

    def commit(self, n: int) -> torch.Tensor:
        """Take the first ``n`` ids of ``free_pages`` (after ``ensure(n)``): int64. O(n)."""
        ids = self._ring.pop(n)
        if n:
            self._mark(ids, False)
        return ids

    def host_mask(self) -> np.ndarray | None:
        """The numpy view of ``not_in_use`` on CPU (cached, see :mod:`.host_view`), else
        ``None``."""
        return self.host_view("_not_in_use")

    def _mark(self, ids: torch.Tensor, value: bool) -> None:
        """``not_in_use[ids] = value``; on CPU through a numpy view (no torch dispatch)."""
        set_mask(self._not_in_use, self.host_mask(), ids, value)

    def alloc(self, n: int) -> torch.Tensor | None:
        """``n`` ids (int64, on device) or None when fewer are available (none handed out;
        under need_sort ``release_pages`` was merged, see ``ensure``)."""
        if not self.ensure(n):
            return None
        return self.commit(n)

    def merge_and_sort(self) -> None:
        """Move ``release_pages`` into ``free_pages`` and sort it ascending. O(F log F).

        The merged list is written after the ring's tail (not over the old entries), so a
        backup taken before the merge stays restorable."""
        if len(self._rel) == 0:
            return
        merged = sort_ids(torch.cat((self._ring.live(), self._rel.live())))
        new_head = self._ring.tail
        self._ring.push(merged)
        self._ring.head = new_head
        self._rel.head = self._rel.tail
        self._merges += 1

    # ------------------------------------------------------------------ free
    def free(self, ids: torch.Tensor, *, known_unique: bool = False,
             validated: bool = False) -> None:
        """Return ``ids`` (flat int64 on device). With checks: InvalidIndexError for ids
        outside ``1..num_ids``, DoubleFreeError for ids not in use (free, pending release
        or in the open group) or repeated; state unchanged. O(k log k), O(k) when the
        caller vouches for ``known_unique`` ids or already ``validated`` them."""
        if ids.numel() == 0:
            return
        if self.checks and not validated:
            check_ids_to_free(
                ids, self._not_in_use, 1, self.num_ids,
                kind=self.kind, check_duplicates=not known_unique,
            )
        self._push(ids)
        self._mark(ids, True)

    def _push(self, ids: torch.Tensor) -> None:
        """Put validated ids on the open group, ``release_pages`` or ``free_pages``."""
        if self._group is not None:
            self._group.append(ids)
            self._group_count += int(ids.numel())
        elif self.need_sort:
            self._rel.push(ids)
        else:
            self._ring.push(ids)

    def free_host(self, ids: np.ndarray, shift: int = 0, ascending: bool = False) -> bool:
        """The checked free of the slot ids ``ids`` (a 1-D int64 numpy array; pages are
        ``ids >> shift``) in one compiled pass (:mod:`radixkv.allocator.native`): the checks
        of ``free`` (range, not in use, no repeat) and the push, pages in ``ids``' order, or
        ascending when ``ascending`` (as the paged allocator's numpy path pushes them). It takes
        a free only when it is valid with each page's slots one ascending run (an evicted
        leaf's rows, a request's); otherwise, when not built, off CPU or with a group open,
        it returns False with nothing changed and the caller's path frees or names the bad
        ids. O(k), plus O(p log p) to sort p unsorted pages."""
        mark = native.mark_free
        host = self.host_mask()
        if mark is None or host is None or self._group is not None:
            return False
        num_ids = self.num_ids
        return (self._rel if self.need_sort else self._ring).push_with(
            lambda ring, pos: cast(int, mark(ids, host, ring, pos, shift, num_ids, ascending)), ids.size)

    def free_runs(self, starts: np.ndarray, ends: np.ndarray, ids: np.ndarray | None = None) -> bool:
        """Return the ids of the runs ``[starts[j], ends[j])`` (int64 numpy arrays of r runs)
        with the checks of ``free``, vectorised over runs instead of ids: a range check, an
        overlap check of the runs sorted by start (an id in two runs, or twice in one, is a
        repeat) and a not-in-use check of each run's slice of the mask. ``ids``: the same
        ids in the caller's order (what goes on the free list); default ascending. CPU only.

        Returns False, changing nothing, when a check fails or there is no host mask: the
        caller's exact path then finds and names the bad ids. O(k + r log r); the caller
        keeps r small (a Python loop over runs checks the mask slices)."""
        host = self.host_mask()
        if host is None:
            return False
        if starts.size > 1:
            order = np.argsort(starts, kind="stable")
            starts, ends = starts[order], ends[order]
            if np.count_nonzero(starts[1:] < ends[:-1]):
                return False
        lo, hi = starts.tolist(), ends.tolist()
        if lo[0] < 1 or max(hi) > self.num_ids + 1:
            return False
        for s, e in zip(lo, hi):
            if s >= e or np.count_nonzero(host[s:e]):
                return False
        if ids is None:
            ids = (np.arange(lo[0], hi[0], dtype=np.int64) if len(lo) == 1 else
                   np.concatenate([np.arange(s, e, dtype=np.int64) for s, e in zip(lo, hi)]))
        self._push(torch.from_numpy(ids))
        for s, e in zip(lo, hi):  # mark per run: slices, no scatter
            host[s:e] = True
        return True

    def free_one(self, i: int) -> None:
        """Return the one id ``i`` (an int the caller validated: in range and in use): the
        one-id case of ``free(..., validated=True)``, on CPU without torch dispatch. O(1)."""
        if self._group is not None or self.device.type != "cpu":
            self.free(torch.tensor([i], dtype=torch.int64, device=self.device), known_unique=True,
                      validated=True)
            return
        (self._rel if self.need_sort else self._ring).push_one(i)
        cast(np.ndarray, self.host_mask())[i] = True  # CPU: the view exists

    def group_begin(self) -> None:
        """Open a free group: frees until ``group_end`` are released together."""
        if self._group is not None:
            raise FreeGroupError("free_group_begin: a free group is already open")
        self._group = []
        self._group_count = 0

    def group_end(self) -> None:
        """Close the group and release its ids in one batch. O(k)."""
        if self._group is None:
            raise FreeGroupError("free_group_end without free_group_begin")
        group, self._group, self._group_count = self._group, None, 0
        if group:
            ids = torch.cat(group)
            (self._rel if self.need_sort else self._ring).push(ids)

    @property
    def in_group(self) -> bool:
        return self._group is not None

    def group_ids(self) -> list[torch.Tensor]:
        """The id tensors freed into the open group (a new list; empty when none)."""
        return list(self._group or ())

    # ------------------------------------------------------------------ backup
    def backup(self) -> FreeListState:
        """O(1) snapshot of the free list (see the module docstring for its lifetime)."""
        if self._group is not None:
            raise FreeGroupError("backup_state while a free group is open")
        # Drop the oldest live backups once overwritten (their heads only grow along
        # the lineage) or beyond the cap, so the lineage list stays short.
        live = self._lineage
        drop = 0
        while drop < len(live) and (
            len(live) - drop >= _MAX_LIVE_BACKUPS
            or not (self._ring.intact(live[drop][1]) and self._rel.intact(live[drop][2]))
        ):
            drop += 1
        if drop:
            del live[:drop]
        self._stamps += 1
        live.append((self._stamps, self._ring.head, self._rel.head))
        return FreeListState(
            self._owner, self._stamps, self._ring.head, self._ring.tail,
            self._rel.head, self._rel.tail, self._merges,
        )

    def _check_restorable(self, s: object) -> None:
        if not isinstance(s, FreeListState) or s.owner != self._owner:
            raise InvalidArgumentError(
                f"restore_state takes a state from this allocator's backup_state, "
                f"got {type(s).__name__}"
            )
        if self._group is not None:
            raise FreeGroupError("restore_state while a free group is open")
        i = bisect.bisect_left(self._lineage, (s.stamp,))
        if i == len(self._lineage) or self._lineage[i][0] != s.stamp:
            raise StaleBackupError(
                f"backup #{s.stamp} predates clear(), belongs to a rolled-back future, or "
                f"is older than the last {_MAX_LIVE_BACKUPS} backups"
            )
        if not (self._ring.intact(s.head) and self._rel.intact(s.release_head)):
            raise StaleBackupError(
                f"backup #{s.stamp} was overwritten: too many {self.kind}s freed since"
            )

    def restore(self, s: FreeListState) -> None:
        """Roll the free list back to ``s`` exactly. O(ids allocated/freed since ``s``);
        O(F) when a merge ran since. Raises StaleBackupError / FreeGroupError /
        InvalidArgumentError (unchanged) when ``s`` cannot be restored."""
        self._check_restorable(s)
        ring, rel, mask = self._ring, self._rel, self._not_in_use
        if self._merges == s.merges:
            # Only allocations (ring head) and frees (ring / release tails) since s.
            mask[ring.read(s.tail, ring.tail).long()] = False
            mask[rel.read(s.release_tail, rel.tail).long()] = False
            mask[ring.read(s.head, min(ring.head, s.tail)).long()] = True
        else:
            # No group is open, so the mask is exactly the two rings: rebuild it from
            # the backup's entries (a memset plus one scatter of its free ids).
            mask.fill_(False)
            mask[ring.read(s.head, s.tail).long()] = True
            mask[rel.read(s.release_head, s.release_tail).long()] = True
        ring.head, ring.tail = s.head, s.tail
        rel.head, rel.tail = s.release_head, s.release_tail
        self._merges = s.merges
        del self._lineage[bisect.bisect_right(self._lineage, (s.stamp, float("inf"))):]

    # ------------------------------------------------------------------ reset / checks
    def clear(self) -> None:
        """Everything free again, ascending; closes a group, invalidates backups. O(n)."""
        self._ring.reset(torch.arange(1, self.num_ids + 1, dtype=torch.int32, device=self.device))
        self._rel.reset(self._rel.buf[:0])
        self._not_in_use.fill_(True)
        self._not_in_use[0] = False
        self._group = None
        self._group_count = 0
        self._merges = 0
        # (stamp, ring head, release head) of the backups that are ancestors of the
        # current state, oldest first: the only ones restore() accepts.
        self._lineage: list[tuple[int, int, int]] = []

    def check_invariants(self, owner: str) -> None:
        """InvariantError naming the ids unless free_pages, release_pages and the open
        group hold exactly the ids marked not in use, each once, and counts conserve.
        O(num_ids)."""
        if not self.need_sort and len(self._rel):
            raise InvariantError(f"{owner}: release_pages used without need_sort")
        lists = {"free_pages": self._ring.live(), "release_pages": self._rel.live()}
        if self._group:
            lists["free_group"] = torch.cat(self._group)
        check_free_lists(owner, self._not_in_use, lists, kind=self.kind)
        c = self.counts()
        marked = int(self._not_in_use.sum())
        if c.in_use < 0 or marked != c.free + c.release + c.group:
            raise InvariantError(
                f"{owner}: counts do not conserve: {c}, {marked} {self.kind}s marked not in use"
            )
        grp = sum(int(t.numel()) for t in self._group) if self._group else 0
        if grp != c.group:
            raise InvariantError(f"{owner}: free group holds {grp} ids, counted {c.group}")


__all__ = [
    "MAX_RUNS",
    "id_runs",
    "FreeGroupError",
    "FreeListCounts",
    "FreeListState",
    "PageFreeList",
    "StaleBackupError",
]
