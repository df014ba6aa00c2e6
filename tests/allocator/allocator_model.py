"""The one reference model of SGLang's free-list allocators, shared by the state machines
of ``TokenToKVPoolAllocator`` (ids are token slots) and ``PagedTokenToKVPoolAllocator``
(ids are page numbers), plus the free-group / backup / restore rules both machines run.

``FreeListModel`` keeps SGLang's semantics on plain lists: ``free_pages`` hands out ids in
order; with ``need_sort`` freed ids wait in ``release`` and are merged and sorted into
``free_pages`` whenever an allocation finds ``free_pages`` short (before the size check, as
the seed: a failed allocation still merges). It also tracks the
documented lifetime of a backup: the ``free_pages`` ring holds ``2 * size`` entries and the
``release_pages`` ring ``size``, written at ever-growing absolute positions (a restore moves
the write position back); a backup survives while nothing was written a whole ring length
past its first entry.
"""
import pytest
import torch
from hypothesis import event
from hypothesis import strategies as st
from hypothesis.stateful import precondition, rule

from radixkv.allocator import StaleBackupError


def state_of(a):
    """Everything an allocator call that raises must leave unchanged."""
    return a.stats(), a.free_pages.tolist(), a.release_pages.tolist(), a._fl._not_in_use.clone()


def assert_unchanged(a, before):
    after = state_of(a)
    assert after[:3] == before[:3]
    assert torch.equal(after[3], before[3])


class FreeListModel:
    def __init__(self, size, need_sort):
        self.size, self.need_sort = size, need_sort
        self.free_pages = list(range(1, size + 1))
        self.release = []
        self.group = None
        self.ring_head, self.ring_hw = 0, size  # tail == ring_head + len(free_pages)
        self.rel_head, self.rel_hw = 0, 0

    def available(self):
        return len(self.free_pages) + len(self.release)

    def _ring_write(self, n):
        self.ring_hw = max(self.ring_hw, self.ring_head + len(self.free_pages) + n)

    def alloc(self, n):
        """``n`` ids in hand-out order, or None when fewer are available. As the seed: with
        need_sort the release list is merged first whenever free_pages falls short, so a
        call that returns None may still have merged."""
        if self.need_sort and n > len(self.free_pages):
            self.merge()
        if n > len(self.free_pages):
            return None
        out, self.free_pages = self.free_pages[:n], self.free_pages[n:]
        self.ring_head += n
        return out

    def merge(self):
        if self.release:
            merged = sorted(self.free_pages + self.release)
            self._ring_write(len(merged))
            self.ring_head += len(self.free_pages)  # the merged list starts at the old tail
            self.free_pages = merged
            self.rel_head += len(self.release)
            self.release = []

    def free(self, ids):
        if self.group is not None:
            self.group += ids
        elif self.need_sort:
            self.rel_hw = max(self.rel_hw, self.rel_head + len(self.release) + len(ids))
            self.release += ids
        else:
            self._ring_write(len(ids))
            self.free_pages += ids

    def backup(self):
        return (list(self.free_pages), list(self.release), self.ring_head, self.rel_head)

    def restorable(self, b):
        return self.ring_hw - b[2] <= 2 * self.size and self.rel_hw - b[3] <= self.size

    def restore(self, b):
        self.free_pages, self.release = list(b[0]), list(b[1])
        self.ring_head, self.rel_head = b[2], b[3]

    def in_use(self):
        pending = set(self.group or [])
        return set(range(1, self.size + 1)) - set(self.free_pages) - set(self.release) - pending


class FreeListRules:
    """Rules shared by the allocator state machines (mix into a ``RuleBasedStateMachine``
    that sets ``self.a`` (allocator), ``self.m`` (FreeListModel), ``self.backups`` and
    ``self.stale``). ``_snapshot_extra`` / ``_restore_extra`` carry machine-specific state
    (for example the requests' slots) across a backup and its restore."""

    def _snapshot_extra(self):
        return None

    def _restore_extra(self, extra):
        pass

    @precondition(lambda self: self.m.group is None)
    @rule()
    def group_begin(self):
        self.a.free_group_begin()
        self.m.group = []

    @precondition(lambda self: self.m.group is not None)
    @rule()
    def group_end(self):
        self.a.free_group_end()
        ids, self.m.group = self.m.group, None
        if ids:
            self.m.free(ids)

    @precondition(lambda self: self.m.group is None)
    @rule()
    def backup(self):
        snap = (self.a.backup_state(), self.m.backup(), self._snapshot_extra())
        self.backups = (self.backups + [snap])[-3:]

    @precondition(lambda self: self.m.group is None and self.backups)
    @rule(data=st.data())
    def restore(self, data):
        i = data.draw(st.integers(0, len(self.backups) - 1))
        s, b, extra = self.backups[i]
        if not self.m.restorable(b):
            event("restore: overwritten backup rejected")
            before = state_of(self.a)
            with pytest.raises(StaleBackupError):
                self.a.restore_state(s)
            assert_unchanged(self.a, before)
            return
        self.a.restore_state(s)
        event("restore: ok")
        self.m.restore(b)
        self._restore_extra(extra)
        self.stale += [x[0] for x in self.backups[i + 1 :]]  # a discarded future
        self.backups = self.backups[: i + 1]

    @precondition(lambda self: self.m.group is None and self.stale)
    @rule(i=st.integers(0, 3))
    def restore_stale(self, i):
        """A backup that predates clear() or a restore of an older one is rejected."""
        before = state_of(self.a)
        with pytest.raises(StaleBackupError):
            self.a.restore_state(self.stale[i % len(self.stale)])
        assert_unchanged(self.a, before)

    def _cleared(self, model):
        """After ``self.a.clear()``: a fresh model; every backup taken so far is stale."""
        self.m = model
        self.stale += [x[0] for x in self.backups]
        self.backups = []
