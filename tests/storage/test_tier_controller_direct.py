"""``fetch_into``: pages read straight into buffers the caller reserves once storage has
counted them; a late read keeps its buffers until done, then its pages wait as prefetched
ones. The double's gates, not the clock, decide each step."""
import contextlib
import threading

import pytest
import torch
from storage_double import DictStorage, ScatterDictStorage, stored

from radixkv.errors import InvalidArgumentError, LengthMismatchError
from radixkv.storage.file import FileStorage
from radixkv.storage.tier_controller import StorageController

PB = 32


def _stored(n=6):
    return stored(ScatterDictStorage(), n, PB)


@contextlib.contextmanager
def _controller(store, timeout_s):
    ctl = StorageController(store, PB, timeout_s=timeout_s)
    try:
        yield ctl
        ctl.check_invariants()
    finally:
        store.gate.set()
        if isinstance(store, ScatterDictStorage):
            store.get_gate.set()
        ctl.close(1.0)


class Pool:
    """A host pool stand-in: rows handed out in an odd order, each page cut in two buffers."""

    def __init__(self, limit=None):
        self.rows = torch.zeros(16, PB, dtype=torch.uint8)
        self.asked: list[int] = []
        self.pages: list[int] = []
        self.limit = limit

    def reserve(self, n):
        self.asked.append(n)
        self.pages = [15 - 2 * i for i in range(n if self.limit is None else min(n, self.limit))]
        return [[self.rows[p][:PB // 4], self.rows[p][PB // 4:]] for p in self.pages]


def test_pages_land_in_the_reserved_buffers_and_reserve_is_told_the_count():
    store, keys, rows = _stored(4)
    with _controller(store, 30.0) as ctl:
        assert ctl.scatters
        pool = Pool()
        k, pending = ctl.fetch_into(keys + ["absent", "k1"], pool.reserve)
        assert (k, pending, pool.asked) == (4, None, [4])
        assert torch.equal(pool.rows[pool.pages], rows)
        pool = Pool(limit=2)  # the host had room for two: two read, nothing else touched
        assert ctl.fetch_into(keys, pool.reserve) == (2, None)
        assert torch.equal(pool.rows[pool.pages], rows[:2]) and int(pool.rows.sum()) == int(rows[:2].sum())
        pool = Pool()
        assert ctl.fetch_into(["absent"] + keys, pool.reserve) == (0, None) and pool.asked == []
        assert ctl.stats.fetched == 6 and ctl.stats.fetch_timeouts == 0


def test_a_missing_page_after_the_count_is_a_short_read():
    store, keys, rows = _stored(4)
    with _controller(store, 30.0) as ctl:
        store.get_gate.clear()
        pool = Pool()
        out = []
        t = threading.Thread(target=lambda: out.append(ctl.fetch_into(keys, pool.reserve)))
        t.start()
        while not pool.asked:  # counted 4, buffers reserved; the read blocks: drop page 2 now
            t.join(0.01)
        del store.pages["k2"]
        store.get_gate.set()
        t.join(30)
        assert out == [(2, None)] and torch.equal(pool.rows[pool.pages[:2]], rows[:2])


def test_a_late_read_keeps_its_buffers_until_done_then_its_pages_are_prefetched():
    store, keys, rows = _stored(6)
    with _controller(store, 0.05) as ctl:
        store.get_gate.clear()  # counted, buffers given, then the read hangs
        pool = Pool()
        k, pending = ctl.fetch_into(keys, pool.reserve)
        if not pool.asked:  # a busy machine counted late: the read fell back to fresh rows
            assert (k, pending) == (0, None)
        else:
            assert k == 0 and pending is not None and not pending.is_set()
        assert ctl.stats.fetch_timeouts == 1
        store.get_gate.set()
        assert ctl.wait_reads(30) and (pending is None or pending.is_set())
        assert ctl.stats.prefetched == 6
        store.gate.clear()  # hung again: the prefetched pages serve the next fetch
        calls = store.calls
        pool2 = Pool()
        assert ctl.fetch_into(keys[:4], pool2.reserve) == (4, None) and store.calls == calls
        assert torch.equal(pool2.rows[pool2.pages], rows[:4]) and ctl.stats.prefetch_used == 4


def test_a_stalled_count_reserves_nothing():
    store, keys, _ = _stored(3)
    with _controller(store, 0.01) as ctl:
        store.gate.clear()
        pool = Pool()
        assert ctl.fetch_into(keys, pool.reserve) == (0, None) and pool.asked == []
        assert ctl.stats.fetch_timeouts == 1


def test_a_backend_that_cannot_scatter_refuses_fetch_into():
    with _controller(DictStorage(), 0.05) as ctl:
        assert not ctl.scatters
        with pytest.raises(InvalidArgumentError):
            ctl.fetch_into(["k"], Pool().reserve)


# ---------------------------------------------------------------------- buffers given up front
def test_buffers_given_up_front_are_read_in_one_pass_without_a_count():
    store, keys, rows = _stored(4)
    with _controller(store, 30.0) as ctl:
        pool = Pool()
        calls = store.calls  # batch_exists calls: the one-pass read makes none
        asked = keys + ["absent", "k1"]
        k, pending = ctl.fetch_into(asked, pool.reserve(len(asked)))
        assert (k, pending) == (4, None) and store.calls == calls
        assert torch.equal(pool.rows[pool.pages[:4]], rows)  # the lead; what follows the miss is the caller's
        assert ctl.fetch_into(["absent"] + keys, pool.reserve(5)) == (0, None)
        assert ctl.stats.fetched == 4 and ctl.stats.fetch_timeouts == 0


def test_a_corrupt_page_ends_the_lead_of_a_one_pass_read(tmp_path):
    store = FileStorage(tmp_path, page_bytes=PB, threads=1)
    keys = [f"k{i}" for i in range(4)]
    rows = torch.arange(4 * PB, dtype=torch.int64).remainder(251).to(torch.uint8).view(4, PB)
    assert all(store.batch_set(keys, rows))
    b = bytearray(store.path_of("k2").read_bytes())
    b[3] ^= 1
    store.path_of("k2").write_bytes(bytes(b))
    ctl = StorageController(store, PB, timeout_s=30.0)
    try:
        pool = Pool()
        assert ctl.fetch_into(keys, pool.reserve(4)) == (2, None)
        assert torch.equal(pool.rows[pool.pages[:2]], rows[:2])
        assert not pool.rows[pool.pages[2]].any()  # the bad page's buffers hold no page
        assert store.stats().corrupt == 1
        ctl.check_invariants()
    finally:
        ctl.close(1.0)


def test_prefetched_pages_fill_the_first_given_buffers_and_the_read_the_rest():
    store, keys, rows = _stored(6)
    with _controller(store, 0.05) as ctl:
        store.get_gate.clear()
        k, pending = ctl.fetch_into(keys[:2], Pool().reserve(2))  # times out: read goes on late
        assert k == 0 and pending is not None
        store.get_gate.set()
        assert ctl.wait_reads(30) and pending.is_set() and ctl.stats.prefetched == 2
        ctl.timeout_s = 30.0
        pool = Pool()
        assert ctl.fetch_into(keys, pool.reserve(6)) == (6, None)
        assert torch.equal(pool.rows[pool.pages], rows) and ctl.stats.prefetch_used == 2


def test_a_late_one_pass_read_keeps_its_buffers_until_done_then_its_pages_are_prefetched():
    store, keys, rows = _stored(6)
    with _controller(store, 0.05) as ctl:
        store.get_gate.clear()  # the read into the given buffers hangs
        pool = Pool()
        k, pending = ctl.fetch_into(keys, pool.reserve(6))
        assert k == 0 and pending is not None and not pending.is_set()
        assert ctl.stats.fetch_timeouts == 1
        store.get_gate.set()
        assert ctl.wait_reads(30) and pending.is_set() and ctl.stats.prefetched == 6
        assert torch.equal(pool.rows[pool.pages], rows)  # (written while they were the read's)
        store.gate.clear()  # hung again: the prefetched pages serve the next fetch
        calls = store.calls
        pool2 = Pool()
        assert ctl.fetch_into(keys[:4], pool2.reserve(4)) == (4, None) and store.calls == calls
        assert torch.equal(pool2.rows[pool2.pages], rows[:4])


def test_given_buffers_of_the_wrong_count_raise_and_change_nothing():
    store, keys, _ = _stored(3)
    with _controller(store, 30.0) as ctl:
        with pytest.raises(LengthMismatchError):
            ctl.fetch_into(keys, Pool().reserve(2))
        assert ctl.stats.fetched == 0 and ctl.wait_reads(0.0)


def test_last_present_finds_the_last_whole_group_and_never_waits_past_the_timeout():
    """``last_present``: the last group of keys storage holds whole (a group with a missing
    key is passed over); with the backend stalled it returns -1, counted as a timeout."""
    store, keys, _ = _stored(6)
    with _controller(store, 5.0) as ctl:
        assert ctl.last_present([["k0", "k1"], ["k2", "nope"], ["k3"], ["x"]]) == 2
        assert ctl.last_present([["x"], ["k5", "y"]]) == -1
        assert ctl.last_present([]) == -1
    with _controller(store, 0.01) as ctl:
        store.gate.clear()  # every backend call blocks until released
        assert ctl.last_present([["k0"]]) == -1 and ctl.stats.fetch_timeouts == 1
