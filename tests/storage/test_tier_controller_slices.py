"""A large storage read split into contiguous slices read at once (``read_threads``): the
pages are the leading ones that passed across slices in key order, a late slice keeps the read
late, a slice whose backend call raises is a miss counted once. Gates and barriers, not the
clock, decide each step."""
import contextlib
import threading

import pytest
import torch
from storage_double import ScatterDictStorage, stored

from radixkv.errors import InvalidArgumentError
from radixkv.storage.file import FileStorage
from radixkv.storage.tier_controller import MIN_SLICE_PAGES, StorageController

PB = 32
N = 4 * MIN_SLICE_PAGES  # four slices of MIN_SLICE_PAGES with four threads


class SliceStorage(ScatterDictStorage):
    """Records each ``batch_get`` (thread, keys); a key in ``raise_on`` makes its call raise,
    one in ``hold`` makes its call wait for ``release``; ``barrier`` (when set) is met by
    every call before it reads (proof that the slices run at once)."""

    concurrent_calls = True

    def __init__(self) -> None:
        super().__init__()
        self.got: list[tuple[str, list[str]]] = []
        self.set_calls: list[list[str]] = []
        self.raise_on: set[str] = set()
        self.hold: set[str] = set()
        self.release = threading.Event()
        self.barrier: threading.Barrier | None = None
        self._mu = threading.Lock()

    def batch_get(self, keys, dst):
        with self._mu:
            self.got.append((threading.current_thread().name, list(keys)))
        if self.barrier is not None:
            self.barrier.wait(30)
        if self.hold & set(keys):
            self.release.wait(30)
        if self.raise_on & set(keys):
            raise OSError("the backend failed this slice")
        return super().batch_get(keys, dst)

    def batch_set(self, keys, src):
        with self._mu:
            self.set_calls.append(list(keys))
        if self.raise_on & set(keys):
            raise OSError("the backend failed this slice")
        return super().batch_set(keys, src)


def _stored(n=N):
    return stored(SliceStorage(), n, PB)


@contextlib.contextmanager
def _controller(store, timeout_s=30.0, **kw):
    ctl = StorageController(store, PB, timeout_s=timeout_s, **kw)
    try:
        yield ctl
        ctl.check_invariants()
    finally:
        store.release.set()
        ctl.close(1.0)


def _host(n=N):
    host = torch.zeros(n, PB, dtype=torch.uint8)
    return host, [[host[i][:PB // 2], host[i][PB // 2:]] for i in range(n)]


def _slices(store):
    return sorted(keys for _, keys in store.got)


def test_a_batch_is_read_as_contiguous_slices_at_once_on_as_many_threads():
    store, keys, rows = _stored()
    store.barrier = threading.Barrier(4)  # every slice must be in flight before any reads
    with _controller(store, read_threads=4) as ctl:
        host, bufs = _host()
        assert ctl.fetch_into(keys, bufs) == (N, None)
        assert torch.equal(host, rows)
        s = MIN_SLICE_PAGES
        assert _slices(store) == sorted(keys[i:i + s] for i in range(0, N, s))
        assert len({name for name, _ in store.got}) == 4
        store.barrier, store.got = threading.Barrier(4), []
        got = ctl.fetch(keys)  # the rows path splits the same way
        assert torch.equal(got, rows) and len(store.got) == 4


@pytest.mark.parametrize("miss", [MIN_SLICE_PAGES - 1, MIN_SLICE_PAGES, 2 * MIN_SLICE_PAGES + 3])
@pytest.mark.parametrize("path", ["up front", "counted", "rows"])
def test_a_miss_ends_the_lead_across_slices_whatever_later_slices_hold(miss, path):
    store, keys, rows = _stored()
    del store.pages[keys[miss]]
    with _controller(store, read_threads=4) as ctl:
        host, bufs = _host()
        if path == "rows":
            got = ctl.fetch(keys)
            assert torch.equal(got, rows[:miss])
        else:
            given = bufs if path == "up front" else (lambda n: bufs[:n])
            assert ctl.fetch_into(keys, given) == (miss, None)
            assert torch.equal(host[:miss], rows[:miss])
        asked = [k for _, ks in store.got for k in ks]
        lead_and_miss = keys[:miss + 1] if path == "up front" else keys[:miss]  # (the others count first)
        assert set(lead_and_miss) <= set(asked) and len(asked) == len(set(asked))  # each page asked once
        assert ctl.stats.fetched == miss


def test_one_thread_reads_slices_in_order_and_stops_at_the_first_with_a_miss():
    store, keys, rows = _stored()
    del store.pages[keys[3]]
    with _controller(store, read_threads=1, batch_pages=MIN_SLICE_PAGES) as ctl:
        host, bufs = _host()
        assert ctl.fetch_into(keys, bufs) == (3, None)
        assert store.got == [("radixkv-storage-memory", keys[:MIN_SLICE_PAGES])]
        assert torch.equal(host[:3], rows[:3])


@pytest.mark.parametrize("bad_slice", [0, 2])
def test_a_slice_whose_backend_call_raises_is_a_counted_miss_and_the_caller_gets_the_lead(bad_slice):
    store, keys, rows = _stored()
    store.raise_on = {keys[bad_slice * MIN_SLICE_PAGES + 1]}
    with _controller(store, read_threads=4) as ctl:
        host, bufs = _host()
        lead = bad_slice * MIN_SLICE_PAGES
        assert ctl.fetch_into(keys, bufs) == (lead, None)
        assert torch.equal(host[:lead], rows[:lead]) and ctl.stats.errors == 1
        store.raise_on = set()
        assert ctl.fetch_into(keys, bufs) == (N, None) and torch.equal(host, rows)


def test_a_late_slice_keeps_the_read_late_its_buffers_pending_then_its_pages_prefetched():
    store, keys, rows = _stored()
    store.hold = {keys[-1]}  # the last slice waits; the others finish
    with _controller(store, timeout_s=0.05, read_threads=4) as ctl:
        host, bufs = _host()
        k, pending = ctl.fetch_into(keys, bufs)
        assert k == 0 and pending is not None and not pending.is_set()  # held: the read is the slice's
        assert ctl.stats.fetch_timeouts == 1
        store.release.set()
        assert ctl.wait_reads(30) and pending.is_set() and ctl.stats.prefetched == N
        ctl.timeout_s = 30.0
        host2, bufs2 = _host()
        assert ctl.fetch_into(keys, bufs2) == (N, None)
        assert torch.equal(host2, rows) and ctl.stats.prefetch_used == N


def test_a_late_slice_of_a_rows_read_leaves_the_caller_the_faster_tiers():
    store, keys, rows = _stored()
    store.hold = {keys[MIN_SLICE_PAGES]}
    with _controller(store, timeout_s=0.05, read_threads=4) as ctl:
        assert ctl.fetch(keys).shape[0] == 0 and ctl.stats.fetch_timeouts == 1
        store.release.set()
        assert ctl.wait_reads(30)
        ctl.timeout_s = 30.0
        assert torch.equal(ctl.fetch(keys), rows)


def test_file_storage_split_read_a_corrupt_page_at_a_slice_start_ends_the_lead(tmp_path):
    store, keys, rows = stored(FileStorage(tmp_path, page_bytes=PB, threads=1), N, PB)
    bad = store.path_of(keys[MIN_SLICE_PAGES])
    b = bytearray(bad.read_bytes())
    b[5] ^= 1
    bad.write_bytes(bytes(b))
    ctl = StorageController(store, PB, timeout_s=30.0, read_threads=4)
    try:
        host, bufs = _host()
        assert ctl.fetch_into(keys, bufs) == (MIN_SLICE_PAGES, None)
        assert torch.equal(host[:MIN_SLICE_PAGES], rows[:MIN_SLICE_PAGES])
        assert not host[MIN_SLICE_PAGES].any()  # the bad page's buffers hold no page
        assert torch.equal(host[MIN_SLICE_PAGES + 1:], rows[MIN_SLICE_PAGES + 1:])  # read, not handed out
        assert store.stats().corrupt == 1
        ctl.check_invariants()
    finally:
        ctl.close(1.0)


def test_small_reads_are_not_split_and_close_ends_the_readers():
    store, keys, rows = _stored()
    with _controller(store, read_threads=4) as ctl:
        readers = list(ctl._readers)
        assert len(readers) == 3
        host, bufs = _host()
        m = 2 * MIN_SLICE_PAGES - 1
        assert ctl.fetch_into(keys[:m], bufs[:m]) == (m, None)
        assert len(store.got) == 1  # fewer than two slices' worth: one call
    for t in readers:
        t.join(30)
        assert not t.is_alive()


def test_a_backend_without_concurrent_calls_gets_one_call_per_batch():
    store, keys, rows = stored(ScatterDictStorage(), N, PB)
    calls = []
    get = store.batch_get
    store.batch_get = lambda k, d: calls.append(list(k)) or get(k, d)
    ctl = StorageController(store, PB, timeout_s=30.0, read_threads=4)
    try:
        host, bufs = _host()
        assert ctl.fetch_into(keys, bufs) == (N, None) and torch.equal(host, rows)
        assert calls == [keys] and not ctl._readers
    finally:
        ctl.close(1.0)


def test_a_backup_is_written_in_slices_and_a_raising_slice_fails_only_its_pages():
    store = SliceStorage()
    keys = [f"w{i}" for i in range(N)]
    rows = torch.randint(0, 256, (N, PB), dtype=torch.uint8, generator=torch.Generator().manual_seed(3))
    store.raise_on = {keys[MIN_SLICE_PAGES + 2]}
    with _controller(store, read_threads=4) as ctl:
        assert ctl.backup(keys, rows) and ctl.drain(30)
        s = MIN_SLICE_PAGES
        assert sorted(store.set_calls) == sorted(keys[i:i + s] for i in range(0, N, s))
        assert (ctl.stats.written, ctl.stats.write_failed, ctl.stats.errors) == (N - s, s, 1)
        failed = set(keys[s:2 * s])
        assert all((k in store.pages) != (k in failed) for k in keys)
        assert all(store.pages[k] == rows[i].numpy().tobytes() for i, k in enumerate(keys) if k not in failed)


@pytest.mark.parametrize("bad", [0, -1, True, 2.0, "2"])
def test_bad_read_threads_are_refused(bad):
    with pytest.raises(InvalidArgumentError):
        StorageController(ScatterDictStorage(), PB, read_threads=bad)

