"""The cluster replay's managers as real ``radixkv serve`` processes (``bench cluster
--managers-mode process``).

:class:`ManagerProcesses` starts N servers with ``subprocess`` (no fork), each on a Unix
socket in one fresh 0700 temp directory (token file 0600, shared-memory pool files, logs), KV
events on and the smallest KV buffers, and waits until each answers ``stats``.
:class:`RemoteManager` serves a request through the public protocol only: ``alloc_extend``
(its ``prefix_len`` is the hit), then ``cache_finished`` or ``release``; ``take_events``
feeds the router. ``close()`` (also on error) detaches, SIGTERMs (then SIGKILLs) every
server and removes the directory: nothing is left behind (``docs/cluster.md``, "Managers").
"""
from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from types import FrameType
from typing import IO, TYPE_CHECKING, Any, TypedDict
from urllib.parse import parse_qsl, quote, unquote, urlencode, urlsplit, urlunsplit

import numpy as np

from radixkv.engine.protocol import ExtendItem
from radixkv.errors import AlignmentError, InvalidArgumentError, RadixKVError

if TYPE_CHECKING:  # pragma: no cover
    from radixkv.service.client import RemoteCacheEngine

__all__ = ["RemoteManager", "ManagerProcesses", "ManagerStartError", "serve_argv", "sigterm_raises", "storage_for_run"]


class ManagerStartError(RadixKVError):
    """A manager process exited or did not answer in time; the message quotes its log."""


class ProcessOptions(TypedDict, total=False):
    """The keyword options of :class:`ManagerProcesses` (``replay_cluster(mode="process", ...)``)."""

    start_timeout_s: float
    stop_timeout_s: float
    extra_args: Sequence[str]


def serve_argv(address: str, token_file: str, capacity: int, page_size: int, shm_dir: str,
               extra_args: Sequence[str] = ()) -> list[str]:
    """The ``radixkv serve`` command line of one cluster manager."""
    return [sys.executable, "-m", "radixkv", "serve", "--address", address, "--token-file", token_file,
            "--device", "cpu", "--kv-tokens", str(capacity), "--page-size", str(page_size),
            "--max-context-len", str(capacity), "--request-rows", "1", "--layer-types", "F",
            "--head-num", "1", "--head-dim", "1", "--enable-kv-events", "--lease-ttl-s", "86400",
            "--max-sessions", "4", "--shm-dir", shm_dir, "--grace-s", "1", "--log-level", "WARNING",
            *extra_args]


def storage_for_run(url: str, tag: str) -> str:
    """``url`` (``file:///DIR`` or ``mooncake://...``) narrowed to an empty place of its own for
    one replay: ``DIR/TAG`` (created), or the Mooncake ``prefix`` extended with ``TAG/``.
    Raises InvalidArgumentError for another scheme or a ``tag`` that is not a plain name."""
    if not tag or not all(ch.isalnum() or ch in "-_." for ch in tag):
        raise InvalidArgumentError(f"storage run tag must be a plain name, got {tag!r}")
    parts = urlsplit(url)
    if parts.scheme == "file":
        path = os.path.join(unquote(parts.path), tag)
        os.makedirs(path, exist_ok=True)
        return urlunsplit(parts._replace(path=quote(path)))
    if parts.scheme == "mooncake":
        query = dict(parse_qsl(parts.query, keep_blank_values=True))
        query["prefix"] = f"{query.get('prefix', 'radixkv/')}{tag}/"
        return urlunsplit(parts._replace(query=urlencode(query, safe="/:")))
    raise InvalidArgumentError(f"bench cluster --storage takes file:///DIR or mooncake://..., got {url!r}")


class RemoteManager:
    """One manager process seen through its client and session (``mode = "process"``).

    Same interface as :class:`~radixkv.bench.cluster.InprocManager`. Calls are synchronous
    RPCs; O(tokens) on the wire per request."""

    mode = "process"

    def __init__(self, client: RemoteCacheEngine, name: str):
        self.client = client
        self.session = client.attach(name).session
        self._next = 0
        self.host_tokens = self.storage_tokens = 0

    def serve(self, toks: np.ndarray) -> int:
        """``alloc_extend`` then ``cache_finished`` of ``toks`` (int32); returns the hit.
        Raises what the manager raises; a request that fails after its allocation is
        released (nothing stays held)."""
        rid = f"q{self._next}"
        self._next += 1
        res = self.client.alloc_extend(self.session, [ExtendItem(rid, toks)])[0]
        try:
            self.client.cache_finished(self.session, [rid])
        except BaseException:
            try:
                self.client.release(self.session, [rid])
            except RadixKVError:
                pass  # the original error says more; release fails only if the request is gone
            raise
        self.host_tokens += int(res.host_len)
        self.storage_tokens += int(res.storage_len)
        return int(res.prefix_len)

    def take_events(self) -> list[dict[str, Any]]:
        return self.client.take_events(self.session)

    def cached_tokens(self) -> int:
        s = self.client.stats(self.session)
        return int(s.kv_evictable + s.kv_protected)

    def reset(self) -> None:
        """Empty the manager's tree (``flush``) and drop its pending events."""
        if not self.client.flush(self.session):
            raise InvalidArgumentError(f"manager {self.client.address!r} refused to flush: requests running")
        self.client.take_events(self.session)

    def close(self) -> None:
        try:
            self.client.detach(self.session)
        except RadixKVError:
            pass  # the manager is going away anyway
        self.client.close()


class ManagerProcesses:
    """``n`` ``radixkv serve`` processes and a :class:`RemoteManager` for each (module doc).

    Args: ``n`` (>= 1); ``capacity`` (KV tokens each, a multiple of ``page_size``);
    ``page_size``; ``start_timeout_s`` (for all to answer); ``stop_timeout_s`` (after SIGTERM,
    before SIGKILL); ``extra_args`` (more ``radixkv serve`` flags).

    Use as a context manager, or ``start()`` / ``close()`` (idempotent). ``managers``,
    ``pids``, ``directory`` are set by ``start()``. Raises ``InvalidArgumentError`` for bad
    sizes and :class:`ManagerStartError` when a server exits or stays silent; everything
    started is stopped before it raises.
    """

    def __init__(self, n: int, capacity: int, page_size: int, *, start_timeout_s: float = 120.0,
                 stop_timeout_s: float = 30.0, extra_args: Sequence[str] = ()):
        for name, v in (("n", n), ("capacity", capacity), ("page_size", page_size)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise InvalidArgumentError(f"{name} must be an int >= 1, got {v!r}")
        if capacity % page_size:
            raise AlignmentError(f"capacity {capacity} is not a multiple of page_size {page_size}")
        self.n, self.capacity, self.page_size = n, capacity, page_size
        self.start_timeout_s, self.stop_timeout_s = float(start_timeout_s), float(stop_timeout_s)
        self.extra_args = list(extra_args)
        self.directory: str | None = None
        self.managers: list[RemoteManager] = []
        self._procs: list[subprocess.Popen[bytes]] = []
        self._logs: list[IO[bytes]] = []

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs]

    @property
    def returncodes(self) -> list[int | None]:
        return [p.poll() for p in self._procs]

    def start(self) -> list[RemoteManager]:
        """Start every server, wait until each answers, attach one client each."""
        if self._procs:
            raise InvalidArgumentError("already started")
        try:
            self._start()
        except BaseException:
            self.close()
            raise
        return self.managers

    def _start(self) -> None:
        from radixkv.service.client import connect

        self.directory = d = tempfile.mkdtemp(prefix="radixkv-cluster-")  # 0700
        token = secrets.token_urlsafe(24)
        token_file = os.path.join(d, "token")
        fd = os.open(token_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as fh:
            fh.write(token)
        addrs = [f"unix://{d}/m{k}.sock" for k in range(self.n)]
        for k, addr in enumerate(addrs):
            log = open(os.path.join(d, f"m{k}.log"), "wb")
            self._logs.append(log)
            argv = serve_argv(addr, token_file, self.capacity, self.page_size, d, self.extra_args)
            self._procs.append(subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log,
                                                stderr=subprocess.STDOUT, close_fds=True))
        deadline = time.monotonic() + self.start_timeout_s
        for k, addr in enumerate(addrs):
            client = None
            while client is None:
                if self._procs[k].poll() is not None:
                    raise ManagerStartError(f"manager {k} exited with {self._procs[k].returncode}: {self._log(k)}")
                if time.monotonic() > deadline:
                    raise ManagerStartError(f"manager {k} did not answer within {self.start_timeout_s} s: "
                                            f"{self._log(k)}")
                if os.path.exists(addr[len("unix://"):]):
                    try:
                        client = connect(addr, token=token, wait_s=1.0)
                        client.stats()
                    except RadixKVError:
                        if client is not None:
                            client.close()
                        client = None
                if client is None:
                    time.sleep(0.1)
            try:
                self.managers.append(RemoteManager(client, f"cluster-manager-{k}"))
            except BaseException:
                client.close()
                raise

    def _log(self, k: int) -> str:
        if self.directory is None:
            return "(no log: the cluster is not started)"
        try:
            with open(os.path.join(self.directory, f"m{k}.log"), "rb") as fh:
                return fh.read()[-2000:].decode("utf-8", "replace").strip() or "(empty log)"
        except OSError as e:
            return f"(no log: {e})"

    def reset(self) -> None:
        """Empty every manager's tree (between two replays on the same processes)."""
        for m in self.managers:
            m.reset()

    def close(self) -> None:
        """Detach, SIGTERM every server, wait (SIGKILL after ``stop_timeout_s``), remove
        the directory. Idempotent; never raises for a server that is already gone."""
        for m in self.managers:
            try:
                m.close()
            except Exception:  # noqa: BLE001 - a broken client must not keep servers alive
                pass
        self.managers = []
        for p in self._procs:
            if p.poll() is None:
                p.terminate()
        for p in self._procs:
            try:
                p.wait(self.stop_timeout_s)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(10)
        for log in self._logs:
            log.close()
        self._logs = []
        if self.directory is not None:
            shutil.rmtree(self.directory, ignore_errors=True)

    def __enter__(self) -> ManagerProcesses:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@contextlib.contextmanager
def sigterm_raises() -> Iterator[None]:
    """While active (main thread only; elsewhere a no-op), SIGTERM raises ``SystemExit``
    instead of killing the interpreter outright, so ``finally`` / ``with`` blocks still stop
    the manager processes. The previous handler comes back on exit."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def _raise(signum: int, frame: FrameType | None) -> None:
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, _raise)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
