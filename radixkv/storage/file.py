"""``file:///DIR``: the storage tier as one checksummed file per page (docs/tiers.md).

A page lives at ``DIR/v2/ab/cd/<h>.page`` (``v2``: the format version; ``h = sha256(key)`` in hex,
``ab``/``cd`` its first digits: 65,536 leaf directories, ~15 pages each at a million). A file is
the payload at offset 0 (so the kernel copies it into a host row as fast as a plain read), the
key's UTF-8 bytes, then a 40-byte trailer (:data:`_TRAILER`: magic, xxh3-64 of every other byte
in file order, version, key length, payload length). It is written to a unique temp name and
renamed over the final name, so a reader sees a whole file or none. fsync is off by default: a
killed process leaves no visible partial page either way, and after a power loss a torn page
fails its checksum and is a miss; ``fsync=True`` syncs the file before the rename and the
directory after. Any unusable file is a counted miss, never an error nor wrong bytes; write
failures are counted and logged once per kind. Pages are never evicted here (capacity is the
disk's); :meth:`FileStorage.sweep_temp_files` removes a killed writer's temp files.
"""
from __future__ import annotations

import errno
import hashlib
import logging
import os
import struct
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar

import numpy as np
import torch
import xxhash

from radixkv.contracts import PageBuffers
from radixkv.errors import InvalidArgumentError, LengthMismatchError
from radixkv.storage.native import MAX_PARTS, read_pages
from radixkv.storage.stats import StatsRecorder, StorageStats

__all__ = ["FileStorage", "FILE_FORMAT_VERSION", "MAX_KEY_BYTES"]

log = logging.getLogger(__name__)

#: Bumped when the on-disk layout changes: files of another version are misses (v1: the header
#: before the payload, whose 104-byte offset slowed the kernel's copy; docs/tiers.md).
FILE_FORMAT_VERSION = 2
#: Longest key accepted (UTF-8 bytes); the chained SHA-256 keys are 64.
MAX_KEY_BYTES = 1024
_MAGIC = b"RKVPAGE\x00"
# magic, checksum (xxh3-64 of payload, key, then this trailer from its version on), version,
# flags, key length, payload length
_TRAILER = struct.Struct("<8sQHHIQ8x")
_SUMMED = 16  # the trailer's bytes before this offset (magic, checksum) are not summed
_T = TypeVar("_T")
_SUFFIX = ".page"
# A batch is split over the threads only when each gets at least this many pages.
_MIN_PAGES_PER_THREAD = 4
_TMP_MARK = ".tmp-"
_VERDICTS = ("hit", "absent", "corrupt", "error")  # the compiled read's codes

_DISK_FULL = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}
_READ_ONLY = {errno.EROFS, errno.EACCES, errno.EPERM}


def _write_failure_kind(err: OSError) -> str:
    if err.errno in _DISK_FULL:
        return "disk full"
    if err.errno in _READ_ONLY:
        return "read-only or not permitted"
    return f"I/O error ({errno.errorcode.get(err.errno or 0, err.errno)})"


def _as_parts(dst: PageBuffers, n: int, page_bytes: int) -> list[list[memoryview]]:
    """``dst`` checked as ``n`` lists of contiguous uint8 CPU tensors or writable byte
    memoryviews, ``page_bytes`` in all per page, as byte views. ~0.3 us a memoryview, ~3 a tensor."""
    if len(dst) != n:
        raise LengthMismatchError(f"dst has {len(dst)} pages for {n} keys")
    out = []
    for bufs in dst:
        views = [b if isinstance(b, memoryview) else _tensor_view(b) for b in bufs]
        for v in views:
            if v.readonly or v.format != "B" or not v.c_contiguous:
                raise InvalidArgumentError("a page's memoryviews must be writable, contiguous, of bytes")
        if sum(map(len, views)) != page_bytes:
            raise InvalidArgumentError(f"a page's buffers must hold {page_bytes} bytes in all, got "
                                       f"{sum(map(len, views))}")
        out.append(views)
    return out


def _tensor_view(b: object) -> memoryview:
    if (not isinstance(b, torch.Tensor) or b.dtype != torch.uint8 or b.device.type != "cpu"
            or not b.is_contiguous()):
        raise InvalidArgumentError("a page's buffers must be contiguous uint8 CPU tensors or memoryviews")
    return b.numpy().data.cast("B")


def _as_rows(t: torch.Tensor, n: int, page_bytes: int, what: str) -> torch.Tensor:
    """``t`` checked as ``[n, page_bytes]`` uint8 CPU with contiguous rows."""
    if not isinstance(t, torch.Tensor) or t.dtype != torch.uint8 or t.device.type != "cpu" or t.dim() != 2:
        raise InvalidArgumentError(f"{what} must be a 2-D uint8 CPU tensor")
    if t.shape[0] != n:
        raise LengthMismatchError(f"{what} has {t.shape[0]} rows for {n} keys")
    if t.shape[1] != page_bytes or (n and t.stride(1) != 1):
        raise InvalidArgumentError(f"{what} rows must be {page_bytes} contiguous bytes, got shape "
                                   f"{tuple(t.shape)} strides {t.stride()}")
    return t


class FileStorage:
    """Pages of ``page_bytes`` bytes as files under ``root`` (a :class:`~radixkv.contracts.
    ScatterStorageBackend`). Thread-safe: calls share nothing but the counters; a batch is split over
    ``threads`` worker threads. Cost per page: one open, one vectored read or write, xxh3
    over the page; ``batch_exists`` one ``stat``. Several processes may share a directory
    (warm restart, several managers)."""

    name = "file"

    def __init__(self, root: str | os.PathLike[str], *, page_bytes: int, fsync: bool = False,
                 delete_corrupt: bool = True, threads: int = 4) -> None:
        for what, v in (("page_bytes", page_bytes), ("threads", threads)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise InvalidArgumentError(f"{what} must be an int >= 1, got {v!r}")
        self.root = Path(root)
        if self.root.exists() and not self.root.is_dir():
            raise InvalidArgumentError(f"storage path {str(self.root)!r} exists and is not a directory")
        self.page_bytes = page_bytes
        self._pages = self.root / f"v{FILE_FORMAT_VERSION}"
        self._pages_str = str(self._pages)
        self.fsync = bool(fsync)
        self.delete_corrupt = bool(delete_corrupt)
        self._stats = StatsRecorder()
        self._logged: set[str] = set()
        self._lock = threading.Lock()
        self._tmp_seq = 0
        self._closed = False
        self._pool = ThreadPoolExecutor(threads, "radixkv-file-storage") if threads > 1 else None
        self.threads = threads
        try:
            self._pages.mkdir(parents=True, exist_ok=True)
        except OSError as e:  # a read-only parent: reads may still hit, writes count errors
            self._log_once(_write_failure_kind(e), e)

    # ------------------------------------------------------------------ naming and format

    def path_of(self, key: str) -> Path:
        """Where ``key``'s page lives (whether or not it exists)."""
        return Path(self._path(self._key_bytes(key)))

    def _path(self, key: bytes) -> str:  # str, not Path: pathlib costs ~20 us a page
        h = hashlib.sha256(key).hexdigest()
        return f"{self._pages_str}/{h[:2]}/{h[2:4]}/{h}{_SUFFIX}"

    def file_bytes(self, key: str) -> int:
        """The size of ``key``'s page file: payload, key and trailer."""
        return _TRAILER.size + len(self._key_bytes(key)) + self.page_bytes

    @staticmethod
    def _key_bytes(key: str) -> bytes:
        if not isinstance(key, str) or not key:
            raise InvalidArgumentError(f"a storage key must be a non-empty str, got {key!r}")
        b = key.encode("utf-8")
        if len(b) > MAX_KEY_BYTES:
            raise InvalidArgumentError(f"a storage key must be <= {MAX_KEY_BYTES} bytes, got {len(b)}")
        return b

    @staticmethod
    def _trailer(key: bytes, payload: memoryview) -> bytes:
        rest = _TRAILER.pack(_MAGIC, 0, FILE_FORMAT_VERSION, 0, len(key), len(payload))[_SUMMED:]
        h = xxhash.xxh3_64(payload)
        h.update(key)
        h.update(rest)
        return _MAGIC + struct.pack("<Q", h.intdigest()) + rest

    # ------------------------------------------------------------------ the contract

    def register_buffer(self, buffer: torch.Tensor) -> None:
        """Checks the buffer; files need no registration (reads land in ``dst`` rows directly)."""
        if not isinstance(buffer, torch.Tensor) or buffer.dtype != torch.uint8 or buffer.device.type != "cpu":
            raise InvalidArgumentError("the storage buffer must be a uint8 CPU tensor")

    def batch_exists(self, keys: Sequence[str]) -> int:
        """Leading ``keys`` whose file is present with the right size (content is checked on read)."""
        names = [self._key_bytes(k) for k in keys]
        paths = [(self._path(kb), _TRAILER.size + len(kb) + self.page_bytes) for kb in names]
        if self._closed:
            return 0
        n = 0
        for path, size in paths:
            try:
                if os.stat(path).st_size != size:
                    break
            except OSError:
                break
            n += 1
        return n

    #: ``batch_get`` scatters a page into a list of buffers (:data:`PageBuffers`) in one read.
    scatter_reads = True
    #: Calls share nothing but the counters: a controller may split a batch over threads.
    concurrent_calls = True

    def batch_get(self, keys: Sequence[str], dst: torch.Tensor | PageBuffers) -> list[bool]:
        """Read each page into its row of ``dst`` (or its list of buffers, one ``preadv``).
        A ``False`` page's buffers hold no page (zeroed if the read had touched them)."""
        if isinstance(dst, torch.Tensor):
            names, view = self._batch(keys, dst, "dst")
            parts = [[memoryview(row)] for row in view]
        else:
            names = [self._key_bytes(k) for k in keys]
            parts = _as_parts(dst, len(names), self.page_bytes)
        if self._closed:
            return [False] * len(names)
        t0 = time.perf_counter()
        verdicts = self._map_runs(lambda a, b: self._read_run(names[a:b], parts[a:b]), len(names))
        out = [v == "hit" for v in verdicts]
        hits = sum(out)
        corrupt, read_errors = verdicts.count("corrupt"), verdicts.count("error")
        self._stats.add(hits=hits, misses=len(out) - hits, corrupt=corrupt, read_errors=read_errors,
                        bytes_read=hits * self.page_bytes, read_seconds=time.perf_counter() - t0)
        return out

    def batch_set(self, keys: Sequence[str], src: torch.Tensor) -> list[bool]:
        """Write each row of ``src`` under its key (replacing a page already there: the last
        writer of a key wins, whole; callers skip present pages with :meth:`batch_exists`)."""
        names, view = self._batch(keys, src, "src")
        if self._closed:
            return [False] * len(names)
        t0 = time.perf_counter()
        out = self._map(lambda i: self._write_one(self._path(names[i]), names[i], memoryview(view[i])), len(names))
        stored = sum(out)
        self._stats.add(writes=stored, write_errors=len(out) - stored,
                        bytes_written=stored * self.page_bytes, write_seconds=time.perf_counter() - t0)
        return out

    def close(self) -> None:
        """Later calls miss (files are complete after every call: nothing to flush)."""
        self._closed = True
        if self._pool is not None:
            self._pool.shutdown(wait=True)

    def stats(self) -> StorageStats:
        """The counters since this object was opened."""
        return self._stats.snapshot()

    def sweep_temp_files(self, older_than_s: float = 600.0) -> int:
        """Delete temp files (a killed writer's) last modified over ``older_than_s`` ago, so
        none a live writer still fills; returns how many. O(files under the root)."""
        cutoff = time.time() - older_than_s
        removed = 0
        for d, _dirs, files in os.walk(self._pages_str):
            for f in files:
                if not f.startswith(_TMP_MARK):
                    continue
                try:
                    if os.stat(f"{d}/{f}").st_mtime < cutoff:
                        os.unlink(f"{d}/{f}")
                        removed += 1
                except OSError:
                    continue
        return removed

    def check_invariants(self) -> None:
        """The counters agree with each other (every byte counted belongs to a counted page)."""
        self._stats.check_invariants(self.page_bytes)

    # ------------------------------------------------------------------ one page

    def _map(self, fn: Callable[[int], _T], n: int) -> list[_T]:
        """``[fn(0), ..., fn(n - 1)]`` by :meth:`_map_runs`."""
        return self._map_runs(lambda a, b: [fn(i) for i in range(a, b)], n)

    def _map_runs(self, fn: Callable[[int, int], list[_T]], n: int) -> list[_T]:
        """``fn(0, n)``, or ``fn`` over up to :attr:`threads` runs ``[a, b)`` of pages done in
        parallel (reads, writes and xxh3 release the GIL), concatenated."""
        runs = min(self.threads, n // _MIN_PAGES_PER_THREAD)
        if self._pool is None or runs < 2:
            return fn(0, n)
        bounds = [n * r // runs for r in range(runs + 1)]
        try:
            parts = list(self._pool.map(lambda r: fn(bounds[r], bounds[r + 1]), range(runs)))
        except RuntimeError:  # closed meanwhile: finish here
            return fn(0, n)
        return [x for part in parts for x in part]

    def _read_run(self, names: list[bytes], parts: list[list[memoryview]]) -> list[str]:
        """Each page's verdict (:meth:`_read_one`'s), compiled where built (one call, GIL
        released for the run: ``radixkv.storage.native``); a page that failed is zeroed."""
        paths = [self._path(k) for k in names]
        if read_pages is not None and all(len(p) <= MAX_PARTS for p in parts):
            verdicts = [_VERDICTS[c] for c in read_pages(paths, names, parts, FILE_FORMAT_VERSION)]
            for path, v in zip(paths, verdicts):
                if v == "corrupt":  # (the compiled read leaves the file: deleted here, as _read_one does)
                    self._corrupt(path)
        else:
            verdicts = [self._read_one(path, k, p) for path, k, p in zip(paths, names, parts)]
        for p, v in zip(parts, verdicts):
            if v in ("corrupt", "error"):
                for view in p:
                    view[:] = bytes(len(view))
        return verdicts

    def _batch(self, keys: Sequence[str], t: torch.Tensor, what: str) -> tuple[list[bytes], np.ndarray]:
        """The keys' bytes and ``t`` as a numpy view of its rows, both checked."""
        names = [self._key_bytes(k) for k in keys]
        return names, _as_rows(t, len(names), self.page_bytes, what).numpy()

    def _read_one(self, path: str, key: bytes, parts: list[memoryview]) -> str:
        """``hit``, ``absent``, ``corrupt`` or ``error``; on a hit ``parts`` hold the payload.
        One vectored read: the payload scattered straight into ``parts``, then key, trailer
        and one byte more; the payload is summed first (streaming xxh3: the digest of the
        whole), while the read left it in cache."""
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            return "absent"
        except OSError:
            return "error"
        tail = bytearray(len(key) + _TRAILER.size + 1)  # the extra byte catches a longer file
        try:
            got = os.preadv(fd, [*parts, tail], 0)
        except OSError:
            return "error"
        finally:
            os.close(fd)
        size = sum(len(v) for v in parts)
        if got != size + len(tail) - 1:
            return self._corrupt(path)
        magic, checksum, version, _flags, klen, plen = _TRAILER.unpack_from(tail, len(key))
        if (magic != _MAGIC or version != FILE_FORMAT_VERSION or klen != len(key) or plen != size
                or tail[:len(key)] != key):
            return self._corrupt(path)
        h = xxhash.xxh3_64(parts[0])
        for v in parts[1:]:
            h.update(v)
        h.update(memoryview(tail)[:len(key)])
        h.update(memoryview(tail)[len(key) + _SUMMED:-1])
        if h.intdigest() != checksum:
            return self._corrupt(path)
        return "hit"

    def _corrupt(self, path: str) -> str:
        if self.delete_corrupt:
            try:
                os.unlink(path)
            except OSError:
                pass
        return "corrupt"

    def _write_one(self, path: str, key: bytes, payload: memoryview) -> bool:
        with self._lock:
            self._tmp_seq += 1
            seq = self._tmp_seq
        parent, _, name = path.rpartition("/")
        tmp = f"{parent}/{_TMP_MARK}{name}.{os.getpid()}.{threading.get_ident()}.{seq}"
        fd = self._open_tmp(tmp)
        if fd is None:
            return False
        trailer = self._trailer(key, payload)
        try:
            try:
                total = len(payload) + len(key) + len(trailer)
                if os.writev(fd, [payload, key, trailer]) != total:  # short write: the disk filled
                    raise OSError(errno.ENOSPC, "short write")
                if self.fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, path)
        except OSError as e:
            self._log_once(_write_failure_kind(e), e)
            try:
                os.unlink(tmp)
            except OSError:
                pass
            return False
        if self.fsync:
            self._fsync_dir(parent)
        return True

    def _open_tmp(self, tmp: str) -> int | None:
        """A new temp file's descriptor, creating its directory (new or deleted) once."""
        for attempt in (0, 1):
            try:
                return os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileNotFoundError as e:
                if attempt:
                    self._log_once("directory vanished", e)
                    return None
                try:
                    os.makedirs(tmp.rpartition("/")[0], exist_ok=True)
                except OSError as e2:
                    self._log_once(_write_failure_kind(e2), e2)
                    return None
            except OSError as e:
                self._log_once(_write_failure_kind(e), e)
                return None
        return None

    def _fsync_dir(self, d: str) -> None:
        try:
            fd = os.open(d, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        except OSError as e:
            self._log_once(_write_failure_kind(e), e)

    def _log_once(self, kind: str, err: OSError) -> None:
        with self._lock:
            if kind in self._logged:
                return
            self._logged.add(kind)
        log.warning("file storage %s: %s (%s); such writes are skipped and counted", self.root, kind, err)
