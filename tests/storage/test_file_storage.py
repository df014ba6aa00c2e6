"""FileStorage: round trips, every unusable file a counted miss, write faults counted and
logged once, the directory deleted mid-run, warm restart."""
import errno
import logging
import os
import shutil

import numpy as np
import pytest
import torch
from storage_util import pages_of, remount_read_only, tmpfs

from radixkv.contracts import ScatterStorageBackend, StorageBackend
from radixkv.errors import InvalidArgumentError, InvariantError, LengthMismatchError
from radixkv.storage.file import FileStorage
from radixkv.storage.keys import layout_fingerprint, page_keys, storage_seed
from radixkv.storage.stats import StatsRecorder, StorageStats

PB = 4096


def _keys(n, start=0):
    seed = storage_seed(b"", layout_fingerprint(kind="test", page_bytes=PB))
    toks = np.arange(start * 4, (start + n) * 4, dtype=np.int32)
    return page_keys(toks, 4, seed)


@pytest.fixture
def store(tmp_path):
    return FileStorage(tmp_path / "pages", page_bytes=PB)


def _files(root):
    return sorted(p for p in root.rglob("*") if p.is_file())


def test_is_a_storage_backend(store):
    assert isinstance(store, StorageBackend) and store.name == "file"


@pytest.mark.parametrize("n", [0, 1, 7, 64])
def test_round_trip_bit_equal(store, n):
    keys = _keys(n)
    src = pages_of(keys, PB)
    assert store.batch_set(keys, src) == [True] * n
    assert store.batch_exists(keys) == n
    dst = torch.zeros(n, PB, dtype=torch.uint8)
    assert store.batch_get(keys, dst) == [True] * n
    assert torch.equal(dst, src)
    st = store.stats()
    assert (st.hits, st.misses, st.writes, st.write_errors) == (n, 0, n, 0)
    assert st.bytes_read == st.bytes_written == n * PB


def test_rows_of_a_registered_buffer(store):
    """dst / src as strided row views of one host buffer (the tier's page-first layout)."""
    buf = torch.zeros(10, PB, dtype=torch.uint8)
    store.register_buffer(buf)
    keys = _keys(3)
    buf[[1, 3, 5]] = pages_of(keys, PB)
    assert store.batch_set(keys, buf[1:6:2]) == [True] * 3
    assert store.batch_get(keys, buf[4:10:2]) == [True] * 3
    assert torch.equal(buf[4:10:2], buf[1:6:2])


def test_exists_counts_leading_pages(store):
    keys = _keys(6)
    store.batch_set(keys[:2] + keys[3:], pages_of(keys[:2] + keys[3:], PB))
    assert store.batch_exists(keys) == 2
    assert store.batch_exists(keys[3:]) == 3
    assert store.batch_exists([]) == 0


def test_a_missing_page_is_a_miss(store):
    keys = _keys(3)
    store.batch_set(keys[:1], pages_of(keys[:1], PB))
    dst = torch.zeros(3, PB, dtype=torch.uint8)
    assert store.batch_get(keys, dst) == [True, False, False]
    st = store.stats()
    assert (st.hits, st.misses, st.corrupt, st.read_errors) == (1, 2, 0, 0)


def _flip_payload(p, _):
    b = bytearray(p.read_bytes())
    b[100] ^= 0x10
    p.write_bytes(bytes(b))


def _flip_header(p, _):
    b = bytearray(p.read_bytes())
    b[-16] ^= 0x01  # the trailer's payload length field
    p.write_bytes(bytes(b))


def _flip_key(p, _):
    b = bytearray(p.read_bytes())
    b[-41] ^= 0x01  # the key's last byte, just before the trailer
    p.write_bytes(bytes(b))


def _truncate(p, _):
    p.write_bytes(p.read_bytes()[:-1])


def _truncate_header(p, _):
    p.write_bytes(p.read_bytes()[:20])


def _empty(p, _):
    p.write_bytes(b"")


def _append(p, _):
    p.write_bytes(p.read_bytes() + b"\0")


def _foreign(p, other):
    """Another key's whole, valid file under this key's name."""
    shutil.copyfile(other, p)


def _other_version(p, _):
    b = bytearray(p.read_bytes())
    b[-24] += 1  # the format version (checksummed: fix the checksum so only the version is wrong)
    import xxhash
    b[-32:-24] = xxhash.xxh3_64(bytes(b[:-40] + b[-24:])).intdigest().to_bytes(8, "little")
    p.write_bytes(bytes(b))


CORRUPTIONS = [_flip_payload, _flip_header, _flip_key, _truncate, _truncate_header, _empty, _append,
               _foreign, _other_version]


@pytest.mark.parametrize("corrupt", CORRUPTIONS, ids=lambda f: f.__name__.strip("_"))
@pytest.mark.parametrize("delete", [True, False])
def test_an_unusable_file_is_a_counted_miss(tmp_path, corrupt, delete):
    store = FileStorage(tmp_path, page_bytes=PB, delete_corrupt=delete)
    keys = _keys(3)
    src = pages_of(keys, PB)
    store.batch_set(keys, src)
    victim = store.path_of(keys[1])
    corrupt(victim, store.path_of(keys[2]))
    dst = torch.full((3, PB), 7, dtype=torch.uint8)
    assert store.batch_get(keys, dst) == [True, False, True]
    assert torch.equal(dst[0], src[0]) and torch.equal(dst[2], src[2])
    assert not torch.equal(dst[1], src[1]) and int(dst[1].max()) in (0, 7)  # never the wrong page's bytes
    st = store.stats()
    assert (st.hits, st.misses, st.corrupt, st.read_errors) == (2, 1, 1, 0)
    assert victim.exists() is not delete
    # a rewrite repairs it
    assert store.batch_set(keys[1:2], src[1:2]) == [True]
    assert store.batch_get(keys[1:2], dst[1:2]) == [True] and torch.equal(dst[1], src[1])


def _scattered(pool, pages, cuts):
    """Per page, its row of ``pool`` cut at ``cuts`` (the page's host-pool destinations)."""
    return [[pool[p][a:b] for a, b in zip([0, *cuts], [*cuts, PB])] for p in pages]


@pytest.mark.parametrize("views", [False, True])
@pytest.mark.parametrize("cuts", [[], [PB // 2], [1, 100, PB // 4, PB - 3]])
def test_a_page_scattered_into_buffers_is_bit_equal(store, cuts, views):
    """One preadv per page into a list of buffers: the same bytes as into a row, the same
    on-disk format (the streaming checksum equals the one-shot one)."""
    assert isinstance(store, ScatterStorageBackend) and store.scatter_reads
    keys = _keys(9)
    src = pages_of(keys, PB)
    store.batch_set(keys, src)
    pool = torch.zeros(20, PB, dtype=torch.uint8)
    pages = [17, 2, 5, 11, 3, 19, 1, 8, 13]  # out of order, not adjacent: a host pool's pages
    dst = _scattered(pool, pages, cuts)
    if views:  # byte memoryviews, as HostKVPool.page_buffers gives
        dst = [[b.numpy().data.cast("B") for b in bufs] for bufs in dst]
    assert store.batch_get(keys, dst) == [True] * 9
    assert torch.equal(pool[pages], src)
    rest = sorted(set(range(20)) - set(pages))
    assert int(pool[rest].abs().sum()) == 0  # nothing written outside the destinations


@pytest.mark.parametrize("corrupt", CORRUPTIONS, ids=lambda f: f.__name__.strip("_"))
def test_an_unusable_file_scattered_is_a_miss_with_zeroed_buffers(tmp_path, corrupt):
    store = FileStorage(tmp_path, page_bytes=PB)
    keys = _keys(3)
    src = pages_of(keys, PB)
    store.batch_set(keys, src)
    corrupt(store.path_of(keys[1]), store.path_of(keys[2]))
    pool = torch.full((4, PB), 7, dtype=torch.uint8)
    assert store.batch_get(keys, _scattered(pool, [3, 1, 2], [PB // 3])) == [True, False, True]
    assert torch.equal(pool[3], src[0]) and torch.equal(pool[2], src[2])
    assert int(pool[1].max()) in (0, 7) and torch.equal(pool[0], torch.full((PB,), 7, dtype=torch.uint8))
    assert store.stats().corrupt == 1


def test_bad_page_buffers_raise_and_read_nothing(store):
    keys = _keys(2)
    store.batch_set(keys, pages_of(keys, PB))
    pool = torch.zeros(3, PB, dtype=torch.uint8)
    bad = [
        [[pool[0]]],  # one page for two keys
        [[pool[0]], [pool[1][:PB - 1]]],  # short
        [[pool[0]], [pool[1], pool[2][:1]]],  # long
        [[pool[0]], [pool[1:3].t()[0]]],  # not contiguous
        [[pool[0]], [pool[1].view(torch.int32)]],  # not uint8
        [[pool[0]], [memoryview(bytes(PB))]],  # read-only
        [[pool[0]], [pool[1].numpy().data.cast("B")[:PB - 1]]],  # short memoryview
        [[pool[0]], [pool[1:3].numpy().data.cast("B")[::2]]],  # strided memoryview
    ]
    for dst in bad:
        with pytest.raises((InvalidArgumentError, LengthMismatchError)):
            store.batch_get(keys, dst)
    assert int(pool.abs().sum()) == 0 and store.stats().hits == 0


def test_a_page_of_another_size_is_a_miss(tmp_path):
    keys = _keys(1)
    small = FileStorage(tmp_path, page_bytes=PB // 2)
    small.batch_set(keys, torch.ones(1, PB // 2, dtype=torch.uint8))
    store = FileStorage(tmp_path, page_bytes=PB)
    assert store.batch_exists(keys) == 0
    assert store.batch_get(keys, torch.zeros(1, PB, dtype=torch.uint8)) == [False]
    assert store.stats().corrupt == 1


def test_an_unreadable_page_is_a_counted_read_error(store):
    keys = _keys(2)
    store.batch_set(keys, pages_of(keys, PB))
    p = store.path_of(keys[0])
    p.unlink()
    p.mkdir()  # a directory where the file was: open works, the read fails (EISDIR)
    assert store.batch_get(keys, torch.zeros(2, PB, dtype=torch.uint8)) == [False, True]
    st = store.stats()
    assert (st.misses, st.read_errors, st.corrupt) == (1, 1, 0)


def test_pages_fan_out_and_leave_no_temp_files(store):
    keys = _keys(300)
    store.batch_set(keys, pages_of(keys, PB))
    files = _files(store.root)
    assert len(files) == 300 and all(f.suffix == ".page" for f in files)
    assert max(len(list(d.iterdir())) for d in {f.parent for f in files}) < 300
    assert all(f.stat().st_size == store.file_bytes(keys[0]) for f in files)


def test_warm_restart_finds_the_pages(tmp_path):
    keys = _keys(5)
    src = pages_of(keys, PB)
    first = FileStorage(tmp_path, page_bytes=PB)
    first.batch_set(keys, src)
    first.close()
    second = FileStorage(tmp_path, page_bytes=PB)
    dst = torch.zeros(5, PB, dtype=torch.uint8)
    assert second.batch_exists(keys) == 5 and second.batch_get(keys, dst) == [True] * 5
    assert torch.equal(dst, src)


def test_closed_store_misses(store):
    keys = _keys(2)
    store.batch_set(keys, pages_of(keys, PB))
    store.close()
    assert store.batch_exists(keys) == 0
    assert store.batch_get(keys, torch.zeros(2, PB, dtype=torch.uint8)) == [False, False]
    assert store.batch_set(keys, pages_of(keys, PB)) == [False, False]


def test_directory_deleted_mid_run(store):
    keys = _keys(4)
    src = pages_of(keys, PB)
    store.batch_set(keys, src)
    shutil.rmtree(store.root)
    dst = torch.zeros(4, PB, dtype=torch.uint8)
    assert store.batch_exists(keys) == 0
    assert store.batch_get(keys, dst) == [False] * 4
    st = store.stats()
    assert (st.misses, st.corrupt, st.read_errors) == (4, 0, 0)
    assert store.batch_set(keys, src) == [True] * 4  # the directories are made again
    assert store.batch_get(keys, dst) == [True] * 4 and torch.equal(dst, src)


def _warnings(caplog):
    return [r for r in caplog.records if r.name == "radixkv.storage.file" and r.levelno == logging.WARNING]


def test_disk_full_skips_and_counts_and_logs_once(store, monkeypatch, caplog):
    keys = _keys(6)
    src = pages_of(keys, PB)

    def full(fd, bufs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "writev", full)
    with caplog.at_level(logging.WARNING):
        assert store.batch_set(keys[:3], src[:3]) == [False] * 3
        assert store.batch_set(keys[3:], src[3:]) == [False] * 3
    monkeypatch.undo()
    st = store.stats()
    assert (st.writes, st.write_errors, st.bytes_written) == (0, 6, 0)
    assert len(_warnings(caplog)) == 1 and "disk full" in _warnings(caplog)[0].getMessage()
    assert _files(store.root) == []  # temp files removed
    assert store.batch_exists(keys) == 0


def test_short_write_is_disk_full(store, monkeypatch):
    real = os.writev
    monkeypatch.setattr(os, "writev", lambda fd, bufs: real(fd, bufs[:2]))  # the trailer never lands
    keys = _keys(1)
    assert store.batch_set(keys, pages_of(keys, PB)) == [False]
    assert store.stats().write_errors == 1 and _files(store.root) == []


def test_real_full_disk():
    with tmpfs("64k") as d:
        if d is None:
            pytest.skip("mounting a tmpfs is not allowed here (the monkeypatched test covers ENOSPC)")
        store = FileStorage(d, page_bytes=16 << 10)
        keys = _keys(8)
        src = pages_of(keys, 16 << 10)
        ok = store.batch_set(keys, src)
        assert 0 < sum(ok) < 8
        st = store.stats()
        assert st.write_errors == 8 - sum(ok)
        dst = torch.zeros(8, 16 << 10, dtype=torch.uint8)
        got = store.batch_get(keys, dst)
        assert got == ok and all(torch.equal(dst[i], src[i]) for i in range(8) if ok[i])
        assert not [p for p in _files(store.root) if p.suffix != ".page"]  # no temp file left


def test_read_only_directory_counts_and_still_reads(store, monkeypatch, caplog):
    keys = _keys(4)
    src = pages_of(keys, PB)
    store.batch_set(keys[:2], src[:2])
    real_open = os.open

    def ro_open(path, flags, *a, **kw):
        if flags & os.O_CREAT:
            raise OSError(errno.EROFS, "Read-only file system")
        return real_open(path, flags, *a, **kw)

    monkeypatch.setattr(os, "open", ro_open)
    with caplog.at_level(logging.WARNING):
        assert store.batch_set(keys[2:], src[2:]) == [False, False]
        assert store.batch_set(keys[2:], src[2:]) == [False, False]
        dst = torch.zeros(4, PB, dtype=torch.uint8)
        assert store.batch_get(keys, dst) == [True, True, False, False]
    assert torch.equal(dst[:2], src[:2])
    assert store.stats().write_errors == 4
    assert len(_warnings(caplog)) == 1 and "read-only" in _warnings(caplog)[0].getMessage()


def test_real_read_only_mount():
    with tmpfs("1m") as d:
        if d is None:
            pytest.skip("mounting a tmpfs is not allowed here (the monkeypatched test covers EROFS)")
        keys = _keys(4)
        src = pages_of(keys, PB)
        store = FileStorage(d, page_bytes=PB)
        assert store.batch_set(keys[:2], src[:2]) == [True, True]
        if not remount_read_only(d):
            pytest.skip("remounting read-only is not allowed here")
        assert store.batch_set(keys[2:], src[2:]) == [False, False]
        dst = torch.zeros(4, PB, dtype=torch.uint8)
        assert store.batch_get(keys, dst) == [True, True, False, False] and torch.equal(dst[:2], src[:2])
        assert store.stats().write_errors == 2
        # a new store on a read-only directory opens, reads, and counts its writes
        again = FileStorage(d, page_bytes=PB)
        assert again.batch_exists(keys) == 2 and again.batch_set(keys[2:], src[2:]) == [False, False]


def test_bad_arguments_raise_and_change_nothing(store, tmp_path):
    keys = _keys(2)
    src = pages_of(keys, PB)
    with pytest.raises(LengthMismatchError):
        store.batch_set(keys, src[:1])
    with pytest.raises(InvalidArgumentError):
        store.batch_set(keys, src.to(torch.int16))
    with pytest.raises(InvalidArgumentError):
        store.batch_get(keys, torch.zeros(2, PB + 1, dtype=torch.uint8))
    with pytest.raises(InvalidArgumentError):
        store.batch_get(keys, torch.zeros(PB, 2, dtype=torch.uint8).t())  # rows not contiguous
    with pytest.raises(InvalidArgumentError):
        store.batch_set(["", keys[0]], src)
    with pytest.raises(InvalidArgumentError):
        store.batch_exists([keys[0], 3])
    with pytest.raises(InvalidArgumentError):
        store.batch_set(["x" * 2000, keys[0]], src)
    with pytest.raises(InvalidArgumentError):
        store.register_buffer(torch.zeros(4, dtype=torch.float32))
    for bad in (0, -1, True, 1.5):
        with pytest.raises(InvalidArgumentError):
            FileStorage(tmp_path, page_bytes=bad)
    (tmp_path / "f").write_bytes(b"")
    with pytest.raises(InvalidArgumentError):
        FileStorage(tmp_path / "f", page_bytes=PB)
    assert _files(store.root) == [] and store.stats() == StorageStats()


def test_check_invariants_names_the_counters():
    rec = StatsRecorder()
    rec.add(hits=2, misses=1, corrupt=1, bytes_read=2 * PB)
    rec.check_invariants(PB)
    rec.add(read_errors=1)
    with pytest.raises(InvariantError, match="corrupt \\+ read_errors = 2 > misses = 1"):
        rec.check_invariants()
    rec2 = StatsRecorder()
    rec2.add(writes=1, bytes_written=PB - 1)
    with pytest.raises(InvariantError, match="bytes_written"):
        rec2.check_invariants(PB)


def test_stats_add_up():
    a = StorageStats(hits=1, misses=2, bytes_read=3, read_seconds=0.5)
    assert a.plus(a) == StorageStats(hits=2, misses=4, bytes_read=6, read_seconds=1.0)


BIG = 3 * (256 << 10) + 100  # a large page, damaged far from its trailer


@pytest.mark.parametrize("damage", ["flip_last", "flip_second_piece", "truncate_1", "truncate_mid", "append_1"])
def test_large_pages(tmp_path, damage):
    store = FileStorage(tmp_path, page_bytes=BIG, threads=1)
    keys = _keys(2)
    src = pages_of(keys, BIG)
    store.batch_set(keys, src)
    dst = torch.zeros(2, BIG, dtype=torch.uint8)
    assert store.batch_get(keys, dst) == [True, True] and torch.equal(dst, src)
    p = store.path_of(keys[0])
    b = bytearray(p.read_bytes())
    if damage == "flip_last":
        b[-1] ^= 0x80
    elif damage == "flip_second_piece":
        b[-BIG + (256 << 10) + 5] ^= 0x01
    elif damage == "truncate_1":
        b = b[:-1]
    elif damage == "truncate_mid":
        b = b[: len(b) - BIG + (300 << 10)]
    else:
        b += b"\0"
    p.write_bytes(bytes(b))
    dst.fill_(9)
    assert store.batch_get(keys, dst) == [False, True]
    assert torch.equal(dst[1], src[1]) and int(dst[0].max()) == 0
    assert store.stats().corrupt == 1


@pytest.mark.parametrize("threads", [1, 2, 3, 8])
def test_threads_split_a_batch_in_order(tmp_path, threads):
    store = FileStorage(tmp_path, page_bytes=PB, threads=threads)
    keys = _keys(37)
    src = pages_of(keys, PB)
    present = [i % 5 != 3 for i in range(37)]
    want_keys = [k for k, p in zip(keys, present) if p]
    assert store.batch_set(want_keys, src[torch.tensor(present)]) == [True] * len(want_keys)
    dst = torch.zeros(37, PB, dtype=torch.uint8)
    assert store.batch_get(keys, dst) == present
    assert all(torch.equal(dst[i], src[i]) for i in range(37) if present[i])
    assert store.stats().hits == sum(present) and store.stats().misses == 37 - sum(present)
    store.close()
    assert store.batch_get(keys, dst) == [False] * 37


def test_sweep_removes_only_old_temp_files(store):
    keys = _keys(2)
    store.batch_set(keys, pages_of(keys, PB))
    d = store.path_of(keys[0]).parent
    old, fresh = d / ".tmp-x.page.1.2.3", d / ".tmp-y.page.1.2.4"
    old.write_bytes(b"partial")
    fresh.write_bytes(b"partial")
    os.utime(old, (1, 1))
    assert store.sweep_temp_files(older_than_s=600) == 1
    assert not old.exists() and fresh.exists()
    assert store.batch_exists(keys) == 2
    assert store.sweep_temp_files(older_than_s=-1) == 1 and not fresh.exists()
