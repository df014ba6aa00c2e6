"""``mooncake://`` storage backend: whole pages in a Mooncake Store shared by every manager.

``mooncake://HOST:PORT?metadata=URL&segment_bytes=N&buffer_bytes=N&protocol=tcp&local_host=H``
(HOST:PORT: the master's RPC address). Also ``rdma_devices``, ``replicas``, ``soft_pin_ttl_ms``,
``verify`` (``length`` | ``checksum``), ``prefix``, ``connect_timeout_ms``, ``retry_max_ms``;
sizes take ``KiB``/``MiB``/``GiB``. docs/cluster.md has the story.

Pages move zero-copy between the registered host buffer and the store. ``verify=length``: the
object is the page, read with ``batch_get_into`` only when its size is exactly the page's.
``verify=checksum``: a 64-byte header (magic, length, xxh3-64, SHA-256 of the key) goes before
the page (``batch_*_multi_buffers``). Either way a read is bit-equal or a miss. A background
thread connects, with capped backoff; until then, and after an RPC failure until the master
answers again, calls miss at once (counted, logged once per outage).
"""
from __future__ import annotations

import hashlib
import logging
import os
import re
import socket
import struct
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any
from urllib.parse import parse_qsl, urlsplit

import numpy as np
import torch
import xxhash

from radixkv.errors import InvalidArgumentError, InvariantError, LengthMismatchError, MissingDependencyError
from radixkv.storage.stats import StatsRecorder, StorageStats

__all__ = ["HEADER_BYTES", "INSTALL_HINT", "MooncakeConfig", "MooncakeCounters", "MooncakeStorage"]

log = logging.getLogger(__name__)

#: Bytes of the header stored before each page.
HEADER_BYTES = 64
_MAGIC = b"RKVMOON1"
#: Mooncake's error codes this backend tells apart (mooncake-store's ``ErrorCode``).
_OBJECT_NOT_FOUND = -704
_RPC_FAIL = -900
#: What a ``mooncake://`` backend needs installed.
INSTALL_HINT = ("pip install 'radixkv[mooncake]' (mooncake-transfer-engine-non-cuda==0.3.13.post1) and, "
                "as root, apt-get install -y libibverbs1")
_MIN_SEGMENT = 16 << 20
_LOOPBACK = ("127.0.0.1", "localhost", "::1")
_SIZE_RE = re.compile(r"^(\d+)\s*(|B|KiB|MiB|GiB)$")
_UNITS = {"": 1, "B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}


def _size(name: str, text: str) -> int:
    m = _SIZE_RE.match(text.strip())
    if m is None:
        raise InvalidArgumentError(f"mooncake URL: {name}={text!r} is not a byte size (e.g. 268435456 or 256MiB)")
    return int(m.group(1)) * _UNITS[m.group(2)]


@dataclass(frozen=True)
class MooncakeConfig:
    """The client's settings: the master, the metadata server and the URL's other parameters."""

    master: str
    metadata: str
    segment_bytes: int = 256 << 20
    buffer_bytes: int = 64 << 20
    protocol: str = "tcp"
    local_host: str = "127.0.0.1"
    rdma_devices: str = ""
    replicas: int = 1
    soft_pin_ttl_ms: int = 0
    verify: str = "length"
    prefix: str = "radixkv/"
    connect_timeout_ms: int = 1000
    retry_max_ms: int = 5000

    @classmethod
    def from_url(cls, url: str) -> MooncakeConfig:
        """Parse ``mooncake://HOST:PORT?...`` (``metadata`` defaults to the master host's
        ``http://HOST:8080/metadata``); raises ``InvalidArgumentError`` naming what is bad."""
        parts = urlsplit(url)
        if parts.scheme != "mooncake" or not parts.hostname or parts.port is None:
            raise InvalidArgumentError(f"not a mooncake://HOST:PORT URL: {url!r}")
        params = dict(parse_qsl(parts.query, keep_blank_values=True))
        metadata = params.pop("metadata", f"http://{parts.hostname}:8080/metadata")
        return cls.from_options(f"{parts.hostname}:{parts.port}", metadata, params)

    @classmethod
    def from_options(cls, master: str, metadata: str, options: Mapping[str, str]) -> MooncakeConfig:
        """The settings from the URL's parameters as strings; raises ``InvalidArgumentError``
        naming a bad or unknown one."""
        known = {f.name for f in fields(cls)} - {"master", "metadata"}
        unknown = sorted(options.keys() - known)
        if unknown:
            raise InvalidArgumentError(f"mooncake URL: unknown parameter(s) {unknown}; known: {sorted(known)}")
        host = master.rpartition(":")[0].strip("[]")
        kw: dict[str, Any] = {"master": master, "metadata": metadata,
                              "local_host": "127.0.0.1" if host in _LOOPBACK else socket.gethostname()}
        for name, text in options.items():
            if name.endswith("_bytes"):
                kw[name] = _size(name, text)
            elif name in ("replicas", "soft_pin_ttl_ms", "connect_timeout_ms", "retry_max_ms"):
                if not text.isdigit():
                    raise InvalidArgumentError(f"mooncake URL: {name}={text!r} is not a whole number")
                kw[name] = int(text)
            else:
                kw[name] = text
        cfg = cls(**kw)
        if cfg.verify not in ("checksum", "length"):
            raise InvalidArgumentError(f"mooncake URL: verify must be 'checksum' or 'length', got {cfg.verify!r}")
        if 0 < cfg.segment_bytes < _MIN_SEGMENT:
            raise InvalidArgumentError(f"mooncake URL: segment_bytes must be 0 or >= 16MiB (Mooncake's minimum), "
                                       f"got {cfg.segment_bytes}")
        if cfg.replicas < 1 or cfg.connect_timeout_ms < 1 or cfg.retry_max_ms < 1:
            raise InvalidArgumentError("mooncake URL: replicas, connect_timeout_ms and retry_max_ms must be >= 1")
        return cfg


@dataclass
class MooncakeCounters:
    """The connection's counters (the pages' are :meth:`MooncakeStorage.stats`): pages that met
    no connection (also counted as misses or write errors), failed ``batch_exists`` answers,
    outages and (re)connections."""

    unavailable: int = 0
    exists_errors: int = 0
    disconnects: int = 0
    connects: int = 0

    def snapshot(self) -> dict[str, int]:
        return dict(self.__dict__)


def _first_positions(keys: Sequence[str]) -> dict[str, int]:
    """Each distinct key and the position of its first occurrence, in order."""
    first: dict[str, int] = {}
    for i, k in enumerate(keys):
        first.setdefault(k, i)
    return first


def _reachable(address: str, timeout_s: float) -> bool:
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s):
            return True
    except (OSError, ValueError):
        return False


def _http_address(url: str) -> str | None:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return None
    return f"{parts.hostname}:{parts.port or (443 if parts.scheme == 'https' else 80)}"


class MooncakeStorage:
    """A :class:`~radixkv.contracts.StorageBackend` over ``MooncakeDistributedStore``.

    ``page_bytes`` is every page's size; a stored object of another size or header is a miss.
    Calls are serialised; none raises for the store's faults, none waits for a connection:
    :attr:`connected` says whether calls reach the store now. ``close()`` is idempotent.
    Invariant (:meth:`check_invariants`): the page counters (:meth:`stats`) agree, and the
    registered buffers are those the store holds.
    """

    def __init__(self, master_address: str, metadata_url: str, page_bytes: int, **options: str) -> None:
        """As ``open_storage`` builds it: the URL's HOST:PORT, its ``metadata`` and the other
        parameters as strings (:meth:`from_url` takes the whole URL)."""
        if isinstance(page_bytes, bool) or not isinstance(page_bytes, int) or page_bytes < 1:
            raise InvalidArgumentError(f"page_bytes must be an int >= 1, got {page_bytes!r}")
        self.config = MooncakeConfig.from_options(master_address, metadata_url, options)
        try:
            from mooncake.store import MooncakeDistributedStore  # noqa: F401
        except ImportError as exc:
            raise MissingDependencyError(f"mooncake:// storage needs {INSTALL_HINT} ({exc})") from exc
        self.page_bytes = page_bytes
        self._checksum = self.config.verify == "checksum"
        # the object format is in the key: managers with another ``verify`` miss, never misread
        self._store_prefix = f"{self.config.prefix}{'h' if self._checksum else 'p'}/"
        self._replicas = self._replicate_config()
        self.counters = MooncakeCounters()
        self._stats = StatsRecorder()
        self._digest_cache: dict[str, bytes] = {}
        self._prefix = _MAGIC + struct.pack("<Q", page_bytes)
        self._call_lock = threading.Lock()
        self._store: Any = None
        self._registered: list[torch.Tensor] = []
        self._buffer: torch.Tensor | None = None
        self._headers = torch.zeros((0, HEADER_BYTES), dtype=torch.uint8)
        self._staging = torch.zeros((0, page_bytes), dtype=torch.uint8)
        self._connected = False
        self._closed = False
        self._outage_logged = False
        self._wake = threading.Event()
        self._thread = threading.Thread(target=self._connect_loop, name="mooncake-connect", daemon=True)
        self._thread.start()

    @classmethod
    def from_url(cls, url: str, page_bytes: int) -> MooncakeStorage:
        """The backend a ``mooncake://`` URL names (see the module docstring)."""
        cfg = MooncakeConfig.from_url(url)
        options = {f.name: str(getattr(cfg, f.name)) for f in fields(cfg) if f.name not in ("master", "metadata")}
        return cls(cfg.master, cfg.metadata, page_bytes, **options)

    @property
    def name(self) -> str:
        return "mooncake"

    @property
    def connected(self) -> bool:
        """Whether calls reach the store now (else they miss at once)."""
        return self._connected

    # ------------------------------------------------------------------ connection

    def _new_client(self) -> Any:
        from mooncake.store import MooncakeDistributedStore
        c = self.config
        store = MooncakeDistributedStore()
        rc = store.setup(c.local_host, c.metadata, c.segment_bytes, c.buffer_bytes, c.protocol,
                         c.rdma_devices, c.master)
        if rc != 0:
            if not self._outage_logged:
                log.warning("mooncake client setup against %s failed (rc %d): retrying with backoff", c.master, rc)
                self._outage_logged = True
            store.close()
            return None
        return store

    def _master_up(self) -> bool:
        timeout = self.config.connect_timeout_ms / 1000
        meta = _http_address(self.config.metadata)
        return _reachable(self.config.master, timeout) and (meta is None or _reachable(meta, timeout))

    def _store_answers(self, store: Any) -> bool:
        """The master answers and a put succeeds (after a master restart the client's segment
        is mounted again only a moment after the RPCs answer)."""
        if store.health_check() != 0:
            return False
        key = f"{self.config.prefix}probe/{self.config.local_host}/{os.getpid()}/{id(self)}"
        if store.put(key, b"radixkv probe") != 0:
            return False
        store.remove(key, True)
        return True

    def _connect_loop(self) -> None:
        """Background: connect; while connected, probe the master now and then; after an
        outage wait for the old client to answer again (Mooncake's client re-mounts its segment
        by itself); one silent for ``retry_max_ms`` while the master answers is replaced."""
        cap = self.config.retry_max_ms / 1000
        delay, up_since = 0.05, None
        while not self._closed:
            if self._connected:  # idle: a TCP probe every retry_max_ms finds a master gone between calls
                self._wake.wait(cap)
                self._wake.clear()
                delay, up_since = 0.05, None
                if self._connected and not self._closed and not self._master_up():
                    with self._call_lock:
                        self._lost("probe")
                continue
            if self._master_up():
                up_since = time.monotonic() if up_since is None else up_since
                with self._call_lock:
                    store = self._store
                    if store is not None and not self._closed and self._store_answers(store):
                        self._set_connected()
                if not self._connected and (store is None or time.monotonic() - up_since >= cap):
                    self._replace_client(store)
                    up_since = None
            else:
                up_since = None
                if not self._outage_logged:
                    log.warning("mooncake master %s or metadata server %s unreachable: storage calls miss "
                                "until both answer", self.config.master, self.config.metadata)
                    self._outage_logged = True
            if not self._connected:
                self._wake.wait(delay)
                self._wake.clear()
                delay = min(delay * 2, cap)

    def _replace_client(self, old: Any) -> None:
        fresh = self._new_client()
        if fresh is None:
            return
        with self._call_lock:
            if self._closed:
                fresh.close()
                return
            for buf in self._registered:
                if fresh.register_buffer(buf.data_ptr(), buf.numel() * buf.element_size()) != 0:
                    fresh.close()
                    return
            self._store = fresh
            self._set_connected()
        if old is not None:
            threading.Thread(target=old.close, name="mooncake-close-old", daemon=True).start()

    def _set_connected(self) -> None:
        self._connected = True
        self.counters.connects += 1
        if self._outage_logged:
            log.warning("mooncake master %s answers again: storage calls resume", self.config.master)
        self._outage_logged = False

    def _lost(self, what: str) -> None:
        """An RPC failed: calls miss until the connect thread finds the master again."""
        if self._connected:
            self._connected = False
            self.counters.disconnects += 1
            self._wake.set()
        if not self._outage_logged:
            log.warning("mooncake master %s unreachable (%s): storage calls miss until it is back",
                        self.config.master, what)
            self._outage_logged = True

    def _usable(self, n: int) -> Any:
        if self._closed or not self._connected:
            self.counters.unavailable += n
            return None
        return self._store

    def _errors(self, codes: Sequence[int], what: str) -> int:
        """How many ``codes`` are errors (not a plain absence); an RPC failure is an outage."""
        bad = [c for c in codes if c < 0 and c != _OBJECT_NOT_FOUND]
        if _RPC_FAIL in bad:
            self._lost(what)
        return len(bad)

    # ------------------------------------------------------------------ buffers

    def _register(self, tensor: torch.Tensor) -> None:
        """Register ``tensor`` with the store now (if connected) and on every reconnect."""
        self._registered.append(tensor)
        if self._store is not None and self._store.register_buffer(
                tensor.data_ptr(), tensor.numel() * tensor.element_size()) != 0:
            log.warning("mooncake: registering %d bytes failed; they are registered again on reconnect",
                        tensor.numel() * tensor.element_size())

    def _unregister(self, tensor: torch.Tensor) -> None:
        self._registered = [t for t in self._registered if t is not tensor]
        if self._store is not None and tensor.numel():
            self._store.unregister_buffer(tensor.data_ptr())

    def register_buffer(self, buffer: torch.Tensor) -> None:
        """Register the host buffer (uint8, CPU, contiguous) rows of which are read and written
        zero-copy; rows elsewhere go through a private staging buffer."""
        if buffer.dtype != torch.uint8 or buffer.device.type != "cpu" or not buffer.is_contiguous():
            raise InvalidArgumentError("register_buffer needs a contiguous uint8 CPU tensor")
        with self._call_lock:
            if self._buffer is not None:
                self._unregister(self._buffer)
            self._buffer = buffer
            self._register(buffer)

    def _scratch(self, name: str, rows: int, width: int) -> torch.Tensor:
        cur: torch.Tensor = getattr(self, name)
        if cur.shape[0] < rows:
            self._unregister(cur)
            cur = torch.zeros((max(rows, 2 * cur.shape[0]), width), dtype=torch.uint8)
            setattr(self, name, cur)
            self._register(cur)
        return cur

    def _row_ptrs(self, rows: torch.Tensor) -> list[int] | None:
        """Row addresses when every row lies in the registered buffer, else ``None``."""
        buf = self._buffer
        if buf is None or rows.shape[0] == 0 or rows.stride(1) != 1 or rows.stride(0) < self.page_bytes:
            return None
        first, step = rows.data_ptr(), rows.stride(0)
        end = first + (rows.shape[0] - 1) * step + self.page_bytes
        if first < buf.data_ptr() or end > buf.data_ptr() + buf.numel():
            return None
        return [first + i * step for i in range(rows.shape[0])]

    def _check_rows(self, keys: Sequence[str], rows: torch.Tensor, what: str) -> None:
        if rows.dtype != torch.uint8 or rows.device.type != "cpu" or rows.dim() != 2:
            raise InvalidArgumentError(f"{what} must be a 2-D uint8 CPU tensor")
        if rows.shape[1] != self.page_bytes:
            raise InvalidArgumentError(f"{what} rows are {rows.shape[1]} bytes, pages are {self.page_bytes}")
        if rows.shape[0] != len(keys):
            raise LengthMismatchError(f"{len(keys)} keys but {rows.shape[0]} rows in {what}")

    # ------------------------------------------------------------------ pages

    def _digests(self, mkeys: Sequence[str]) -> np.ndarray:
        cache = self._digest_cache
        if len(cache) > 65536:
            cache.clear()
        out = b"".join([cache.get(k) or cache.setdefault(k, hashlib.sha256(k.encode()).digest()) for k in mkeys])
        return np.frombuffer(out, dtype=np.uint8).reshape(len(mkeys), 32)

    def _replicate_config(self) -> Any:
        from mooncake.store import ReplicateConfig, SoftPinAction
        cfg = ReplicateConfig()
        cfg.replica_num = self.config.replicas
        if self.config.soft_pin_ttl_ms:
            cfg.soft_pin_action = SoftPinAction.ENABLE
            cfg.soft_pin_ttl_ms = self.config.soft_pin_ttl_ms
        return cfg

    def _plan(self, keys: Sequence[str], rows: torch.Tensor, write: bool
              ) -> tuple[list[str], torch.Tensor, list[int]]:
        """Store keys; the rows the store moves (``rows`` when they lie in the registered buffer,
        else staging rows, filled from ``rows`` for a ``write``); their addresses."""
        n = len(keys)
        ptrs = self._row_ptrs(rows)
        target = rows
        if ptrs is None:
            target = self._scratch("_staging", n, self.page_bytes)[:n]
            if write:
                target.copy_(rows)
            ptrs = [target.data_ptr() + i * self.page_bytes for i in range(n)]
        return [self.store_key(k) for k in keys], target, ptrs

    def store_key(self, key: str) -> str:
        """The name of ``key``'s object in the store (prefix, object format, key)."""
        return self._store_prefix + key

    def _with_headers(self, ptrs: list[int]) -> tuple[torch.Tensor, list[list[int]], list[list[int]]]:
        """Header rows for ``verify=checksum`` objects and each object's (header, page) parts."""
        n = len(ptrs)
        hdr = self._scratch("_headers", n, HEADER_BYTES)[:n]
        hptr, hb = hdr.data_ptr(), HEADER_BYTES
        return hdr, [[hptr + i * hb, p] for i, p in enumerate(ptrs)], [[hb, self.page_bytes]] * n

    def batch_exists(self, keys: Sequence[str]) -> int:
        """How many of ``keys``, from the first, the store holds. One RPC."""
        with self._call_lock:
            store = self._usable(0) if keys else None
            if store is None:
                return 0
            codes = [int(c) for c in store.batch_is_exist([self.store_key(k) for k in keys])]
            self.counters.exists_errors += self._errors(codes, "batch_is_exist")
            n = 0
            while n < len(codes) and codes[n] == 1:
                n += 1
            return n

    def batch_get(self, keys: Sequence[str], dst: torch.Tensor) -> list[bool]:
        """Read each page into its row of ``dst``; ``True`` only where the object has exactly the
        page's size and, with ``verify=checksum``, its header (key, xxh3) matches. A ``False``
        row holds garbage. A repeated key is read once and copied to its other rows (the store
        fills one buffer per key, yet reports every repeat as read)."""
        self._check_rows(keys, dst, "dst")
        n = len(keys)
        with self._call_lock:
            t0 = time.perf_counter()
            store = self._usable(n) if n else None
            first = _first_positions(keys)
            errors = corrupt = 0
            if store is None:
                ok = np.zeros(n, dtype=bool)
            elif len(first) == n:
                ok, errors, corrupt = self._get(store, keys, dst)
            else:
                once = dst[list(first.values())]
                ok_once, errors, corrupt = self._get(store, list(first), once)
                slot = {k: j for j, k in enumerate(first)}
                which = np.array([slot[k] for k in keys])
                ok = ok_once[which]
                hit = np.flatnonzero(ok)
                dst[torch.from_numpy(hit)] = once[torch.from_numpy(which[hit])]
            hits = int(ok.sum())
            self._stats.add(hits=hits, misses=n - hits, corrupt=corrupt, read_errors=errors,
                            bytes_read=hits * self.page_bytes, read_seconds=time.perf_counter() - t0)
            return [bool(x) for x in ok]

    def _get(self, store: Any, keys: Sequence[str], dst: torch.Tensor) -> tuple[np.ndarray, int, int]:
        """One read of distinct ``keys`` into ``dst``: which rows now hold their page, and how
        many reads failed and how many pages were corrupt."""
        n = len(keys)
        mkeys, target, ptrs = self._plan(keys, dst, write=False)
        if self._checksum:
            hdr, parts, sizes = self._with_headers(ptrs)
            codes = [int(c) for c in store.batch_get_into_multi_buffers(mkeys, parts, sizes)]
            ok, corrupt = self._verify(mkeys, hdr.numpy(), target.numpy(), codes)
        else:
            codes = [int(c) for c in store.batch_get_into(mkeys, ptrs, [self.page_bytes] * n)]
            ok, corrupt = np.asarray(codes, dtype=np.int64) == self.page_bytes, 0
        errors = self._errors(codes, "get")
        if target is not dst:
            idx = torch.from_numpy(np.flatnonzero(ok))
            dst[idx] = target[idx]
        return ok, errors, corrupt

    def _verify(self, mkeys: Sequence[str], hdr: np.ndarray, rows: np.ndarray, codes: Sequence[int]
                ) -> tuple[np.ndarray, int]:
        got = np.asarray(codes, dtype=np.int64) == HEADER_BYTES + self.page_bytes
        head = np.frombuffer(self._prefix, dtype=np.uint8)
        good: np.ndarray = got & (hdr[:, :16] == head).all(axis=1) & (hdr[:, 24:56] == self._digests(mkeys)).all(axis=1)
        sums = hdr[:, 16:24].copy().view("<u8")[:, 0]
        for i in np.flatnonzero(good):
            good[i] = xxhash.xxh3_64_intdigest(rows[i]) == int(sums[i])
        return good, int((got & ~good).sum())

    def batch_set(self, keys: Sequence[str], src: torch.Tensor) -> list[bool]:
        """Write each row of ``src`` under its key (with its header under ``verify=checksum``);
        ``True`` where stored (an object already there under that key counts as stored). A
        repeated key is written once, from its first row."""
        self._check_rows(keys, src, "src")
        n = len(keys)
        with self._call_lock:
            t0 = time.perf_counter()
            store = self._usable(n) if n else None
            first = _first_positions(keys)
            if store is None:
                ok = [False] * n
            elif len(first) == n:
                ok = self._set(store, keys, src)
            else:
                ok_once = self._set(store, list(first), src[list(first.values())])
                slot = {k: j for j, k in enumerate(first)}
                ok = [ok_once[slot[k]] for k in keys]
            stored = sum(ok)
            self._stats.add(writes=stored, write_errors=n - stored, bytes_written=stored * self.page_bytes,
                            write_seconds=time.perf_counter() - t0)
            return ok

    def _set(self, store: Any, keys: Sequence[str], src: torch.Tensor) -> list[bool]:
        """One write of distinct ``keys`` from ``src``: which are stored."""
        n = len(keys)
        mkeys, target, ptrs = self._plan(keys, src, write=True)
        if self._checksum:
            hdr, parts, sizes = self._with_headers(ptrs)
            rows = target.numpy()
            sums = np.array([xxhash.xxh3_64_intdigest(rows[i]) for i in range(n)], dtype="<u8")
            h = hdr.numpy()
            h[:, :16] = np.frombuffer(self._prefix, dtype=np.uint8)
            h[:, 16:24] = sums.view(np.uint8).reshape(n, 8)
            h[:, 24:56] = self._digests(mkeys)
            h[:, 56:] = 0
            codes = [int(c) for c in store.batch_put_from_multi_buffers(mkeys, parts, sizes, self._replicas)]
        else:
            codes = [int(c) for c in store.batch_put_from(mkeys, ptrs, [self.page_bytes] * n, self._replicas)]
        self._errors(codes, "put")
        return [x >= 0 for x in codes]

    # ------------------------------------------------------------------ lifecycle

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop reconnecting and close the client (waits at most ``timeout_s`` for Mooncake's
        own close, which retries a dead master); later calls miss."""
        with self._call_lock:
            if self._closed:
                return
            self._closed = True
            self._connected = False
            store, self._store = self._store, None
        self._wake.set()
        if store is not None:
            closer = threading.Thread(target=store.close, name="mooncake-close", daemon=True)
            closer.start()
            closer.join(timeout_s)
        self._thread.join(timeout_s)

    def wait_connected(self, timeout_s: float) -> bool:
        """Wait (polling) until :attr:`connected` or ``timeout_s`` passes; for tools and tests."""
        deadline = time.monotonic() + timeout_s
        while not self._connected and time.monotonic() < deadline and not self._closed:
            time.sleep(0.02)
        return self._connected

    def stats(self) -> StorageStats:
        """The pages' counters since this object was opened (the storage tier's shared type)."""
        return self._stats.snapshot()

    def check_invariants(self) -> None:
        """The counters agree (``StatsRecorder.check_invariants``) and the registered buffers
        are the buffer, headers and staging rows (while open)."""
        self._stats.check_invariants(self.page_bytes)
        want = [t for t in (self._buffer, self._headers, self._staging) if t is not None and t.numel()]
        if not self._closed and sorted(map(id, want)) != sorted(map(id, self._registered)):
            raise InvariantError("mooncake: registered buffers differ from the buffer, headers and staging")
