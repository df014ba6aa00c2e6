"""Background prefetch: a fetch that would wait on storage longer than its timeout returns
without it and leaves the read running; a later fetch of the same keys takes the prefetched
pages without asking the backend again. The double's gate, not the clock, decides each step."""
import torch
from storage_double import DictStorage, stored

from radixkv.storage.tier_controller import StorageController


def _stored(n=6, page_bytes=32):
    return stored(DictStorage(), n, page_bytes)


def test_a_stalled_fetch_returns_then_a_later_fetch_takes_what_the_prefetch_brought():
    store, keys, rows = _stored()
    ctl = StorageController(store, 32, timeout_s=0.01)
    try:
        store.gate.clear()  # the backend hangs: every call blocks until the gate opens
        got = ctl.fetch(keys)  # returned while the backend still blocks: it did not wait for it
        assert got.shape == (0, 32) and ctl.stats.fetch_timeouts == 1
        assert ctl.fetch(keys).shape == (0, 32)  # the same read is in flight: not asked again
        assert store.calls == 1 and ctl.stats.fetch_timeouts == 2
        store.gate.set()
        assert ctl.wait_reads(30)
        assert ctl.stats.prefetched == 6
        store.gate.clear()  # hung again: the next fetch must not need it
        calls = store.calls
        got = ctl.fetch(keys[:4])
        assert torch.equal(got, rows[:4]) and store.calls == calls
        assert ctl.stats.prefetch_used == 4
        assert torch.equal(ctl.fetch(keys[4:]), rows[4:]) and store.calls == calls
        assert ctl.stats.prefetch_used == 6 and not ctl._ready
        ctl.check_invariants()
    finally:
        store.gate.set()
        ctl.close(1.0)


def test_ready_pages_are_bounded_oldest_first_and_a_fetch_continues_after_them():
    store, keys, rows = _stored(n=8)
    ctl = StorageController(store, 32, timeout_s=0.01, max_ready_pages=3)
    try:
        store.gate.clear()
        assert ctl.fetch(keys[5:]).shape[0] == 0  # k5..k7 prefetched
        assert ctl.fetch(keys[2:4]).shape[0] == 0  # k2, k3 prefetched: k5 is dropped (bound 3)
        store.gate.set()
        assert ctl.wait_reads(30)
        assert ctl.stats.prefetched == 5 and len(ctl._ready) == 3
        ctl.timeout_s = 30.0  # from here on reads are waited for (the gate is open)
        got = ctl.fetch(keys[2:])  # k2, k3 from the ready pages, k4.. read now
        assert torch.equal(got, rows[2:])
        assert ctl.stats.prefetch_used == 2
    finally:
        store.gate.set()
        ctl.close(1.0)


def test_reads_past_the_bound_return_nothing_at_once():
    store, keys, _ = _stored()
    ctl = StorageController(store, 32, timeout_s=0.01, max_pending_reads=1)
    try:
        store.gate.clear()
        assert ctl.fetch(keys[:1]).shape[0] == 0
        assert ctl.fetch(keys[1:]).shape[0] == 0  # a second read would pass the bound: not queued
        assert len(ctl._reads) == 1
    finally:
        store.gate.set()
        ctl.close(1.0)


def test_fetched_rows_keep_their_bytes_across_later_reads_and_batches_keep_order():
    """A fetch returns a read's rows uncopied: they must be the read's own (not the staging
    rows the next read overwrites), in key order across several backend batches."""
    store, keys, rows = _stored(n=7)
    ctl = StorageController(store, 32, timeout_s=30.0, batch_pages=3)
    try:
        one = ctl.fetch(keys[:2])  # one backend batch
        three = ctl.fetch(keys)  # three backend batches (3 + 3 + 1)
        other = ctl.fetch(keys[4:6])  # a later read through the same staging rows
        assert torch.equal(one, rows[:2]) and torch.equal(three, rows) and torch.equal(other, rows[4:6])
        assert ctl.stats.fetched == 11 and ctl.stats.prefetched == 0
        ctl.check_invariants()
    finally:
        ctl.close(1.0)


def test_a_read_of_huge_page_rows_over_batches_returns_every_byte_in_order():
    """Rows of 2 MiB and more come from the huge-page advised buffer: the same bytes, in order."""
    n, page_bytes = 7, 512 << 10
    store = DictStorage()
    keys = [f"big{i}" for i in range(n)]
    rows = torch.randint(0, 256, (n, page_bytes), dtype=torch.uint8, generator=torch.Generator().manual_seed(3))
    store.batch_set(keys[:5], rows[:5])  # k5, k6 absent: the read stops after 5
    ctl = StorageController(store, page_bytes, timeout_s=30.0, batch_pages=2)
    try:
        got = ctl.fetch(keys)
        assert got.shape == (5, page_bytes) and torch.equal(got, rows[:5])
        again = ctl.fetch(keys[1:3])
        assert torch.equal(got, rows[:5]) and torch.equal(again, rows[1:3])
    finally:
        ctl.close(1.0)
