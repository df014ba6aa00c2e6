"""The file tier's compiled page reads (``radixkv.storage.native.read_pages``) against the
Python reference (``FileStorage._read_one``) on the same files, whole and damaged every way:
the same verdict per page, the same bytes on a hit; and ``batch_get`` with and without it: the
same flags, zeroed buffers, counters and deleted files."""
import os

import pytest
import torch
from storage_util import pages_of

import radixkv.storage.file as file_mod
from radixkv.storage import native
from radixkv.storage.file import FILE_FORMAT_VERSION, FileStorage

pytestmark = pytest.mark.skipif(native.read_pages is None, reason=f"not built: {native.unavailable_reason}")

PB = 4096 + 24
CODES = ("hit", "absent", "corrupt", "error")


def _damaged(root, delete_corrupt=False):
    """A store whose pages k0..k10 are whole, absent or damaged in each way a file can be."""
    s = FileStorage(root, page_bytes=PB, threads=1, delete_corrupt=delete_corrupt)
    keys = [f"k{i}" for i in range(11)]
    assert all(s.batch_set(keys, pages_of(keys, PB)))
    p = {k: s.path_of(k) for k in keys}

    def edit(k, fn):
        b = bytearray(p[k].read_bytes())
        p[k].write_bytes(bytes(fn(b)))

    edit("k1", lambda b: b.__setitem__(100, b[100] ^ 1) or b)  # payload bit
    edit("k2", lambda b: b.__setitem__(len(b) - 40, 0) or b)  # trailer magic
    edit("k3", lambda b: b[:-1])  # truncated
    edit("k4", lambda b: b + b"x")  # longer
    p["k5"].write_bytes(p["k0"].read_bytes())  # another key's page
    p["k6"].unlink()  # absent
    edit("k7", lambda b: b.__setitem__(len(b) - 24, 9) or b)  # version
    edit("k8", lambda b: b.__setitem__(len(b) - 1, 1) or b)  # padding byte: summed, so the checksum fails
    p["k9"].unlink()
    p["k9"].mkdir()  # a directory where the file was: a read error
    return s, keys


def _parts(n, cuts=(0, 1000, 3000, PB)):
    rows = torch.full((n, PB), 7, dtype=torch.uint8)
    return rows, [[memoryview(r.numpy())[a:b] for a, b in zip(cuts, cuts[1:])] for r in rows]


def test_compiled_and_python_reads_agree_on_every_kind_of_file(tmp_path):
    s, keys = _damaged(tmp_path)
    names = [k.encode() for k in keys]
    paths = [str(s.path_of(k)) for k in keys]
    rows_c, parts_c = _parts(len(keys))
    rows_p, parts_p = _parts(len(keys))
    got = [CODES[c] for c in native.read_pages(paths, names, parts_c, FILE_FORMAT_VERSION)]
    want = [s._read_one(p, k, v) for p, k, v in zip(paths, names, parts_p)]
    assert got == want
    assert want == ["hit", "corrupt", "corrupt", "corrupt", "corrupt", "corrupt", "absent", "corrupt",
                    "corrupt", "error", "hit"]
    hits = [i for i, v in enumerate(want) if v == "hit"]
    assert torch.equal(rows_c[hits], rows_p[hits]) and torch.equal(rows_c[hits], pages_of([keys[i] for i in hits], PB))


def test_batch_get_with_and_without_the_compiled_read_is_the_same(tmp_path, monkeypatch):
    results = []
    for compiled in (True, False):
        if not compiled:
            monkeypatch.setattr(file_mod, "read_pages", None)
        s, keys = _damaged(tmp_path / str(compiled), delete_corrupt=True)
        rows, parts = _parts(len(keys))
        flags = s.batch_get(keys, parts)
        st = s.stats()
        left = sorted(k for k in keys if os.path.isfile(s.path_of(k)))
        results.append((flags, rows.clone(), (st.hits, st.misses, st.corrupt, st.read_errors), left))
        s.check_invariants()
    assert results[0][0] == results[1][0] and torch.equal(results[0][1], results[1][1])
    assert results[0][2:] == results[1][2:] == ((2, 9, 7, 1), ["k0", "k10"])
    bad = [i for i, f in enumerate(results[0][0]) if not f]
    assert not results[0][1][[i for i in bad if i not in (6,)]].any()  # failed pages zeroed (absent untouched)


def test_bad_arguments_are_refused_before_any_file_is_read(tmp_path):
    s, keys = _damaged(tmp_path)
    paths, names = [str(s.path_of("k0"))], [b"k0"]
    _, parts = _parts(1)
    with pytest.raises(ValueError):
        native.read_pages(paths, names + names, parts, FILE_FORMAT_VERSION)
    with pytest.raises(ValueError):
        native.read_pages(paths, [b"k" * 1025], parts, FILE_FORMAT_VERSION)
    with pytest.raises((TypeError, BufferError)):
        native.read_pages(paths, names, [[memoryview(bytes(PB))]], FILE_FORMAT_VERSION)  # read-only
    with pytest.raises(ValueError):
        native.read_pages(paths, names, [[memoryview(bytearray(1))] * 17], FILE_FORMAT_VERSION)
    assert native.read_pages(paths, names, parts, FILE_FORMAT_VERSION) == b"\x00"
    assert native.read_pages([], [], [], FILE_FORMAT_VERSION) == b""
