"""Helpers of the reliability tests (servers, polling, the survivor's fingerprint)."""
from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from radixkv.engine.protocol import DecodeItem, ExtendItem

#: Bounds of the waits in tests/reliability: how long a test waits for a state before it fails,
#: never how long the state is expected to take (ms to a few s on an idle machine). Sized for 2
#: shared cores at load 30, where one interpreter start took over 60 s.
#: A process started, or a killed one reaped (``Popen.wait``, gone from ``/proc``).
PROCESS_BOUND_S = 120.0
#: A state the manager or the pool reaches by itself: a session reclaimed, clients seeing an
#: outage or a new epoch, standbys replenished, a worker's event.
STATE_BOUND_S = 120.0
#: Every victim of a kill-cycle phase reclaimed (dozens of sessions, run out by the test).
PHASE_BOUND_S = 300.0

#: An engine roomy enough for dozens of victims at once (each holds < 200 tokens).
CHAOS_CONFIG: dict[str, Any] = dict(kv_tokens=16384, request_rows=512, max_context_len=256, max_sessions=256,
                                    max_requests_per_session=64, lease_ttl_s=1.0)


def wait_until(pred: Callable[[], Any], timeout_s: float, every_s: float = 0.01) -> Any:
    """Poll ``pred`` until it returns something truthy (returned) or ``timeout_s`` passes (None)."""
    deadline = time.monotonic() + timeout_s
    while True:
        v = pred()
        if v:
            return v
        if time.monotonic() > deadline:
            return None
        time.sleep(every_s)


def live_sessions(srv: Any) -> set:
    return srv.call(lambda s: set(s.engine.sessions.session_ids()))


def check_law(s: Any) -> None:
    if s.kv_available + s.kv_evictable + s.kv_protected + s.kv_held != s.kv_capacity:
        raise AssertionError(f"KV conservation broken: {s}")
    if s.rows_capacity - s.rows_available != s.requests:
        raise AssertionError(f"rows in use != running requests: {s}")


class Survivor:
    """A well-behaved worker in this process that holds requests through the chaos and
    checks afterwards that nobody touched its rows or KV: it writes ``-(1000 + i)`` into
    layer 0's K rows of request ``i``'s slots and snapshots its ``req_to_token`` rows."""

    def __init__(self, client: Any, n: int = 3, keepalive: bool = True):
        self.c = client
        self.info = client.attach("survivor")
        self.s = self.info.session
        self.ka = client.start_keepalive(self.s, interval_s=0.1) if keepalive else None
        self.wb = client.worker_buffers(self.info)
        self.rids = [f"survivor-{i}" for i in range(n)]
        items = [ExtendItem(r, np.arange(5000 + 100 * i, 5040 + 100 * i, dtype=np.int32))
                 for i, r in enumerate(self.rids)]
        res = client.alloc_extend(self.s, items)
        dec = client.alloc_decode(self.s, [DecodeItem(r, 7) for r in self.rids])
        self.rows = {r.rid: int(r.req_pool_idx) for r in res}
        self.seq = {r.rid: int(r.seq_len) + 1 for r in res}
        self.locs: dict[str, np.ndarray] = {}
        for i, r in enumerate(res):
            self.locs[r.rid] = np.concatenate([r.out_cache_loc, dec.out_cache_loc[i:i + 1]])
        k, _ = self.wb.get_kv_buffer(0)
        for i, rid in enumerate(self.rids):
            k[torch.as_tensor(self.locs[rid])] = float(-(1000 + i))
        self.snapshot = {rid: self.wb.req_to_token[self.rows[rid], :self.seq[rid]].clone() for rid in self.rids}

    def all_locs(self) -> np.ndarray:
        return np.concatenate(list(self.locs.values()))

    def check_untouched(self) -> None:
        k, _ = self.wb.get_kv_buffer(0)
        for i, rid in enumerate(self.rids):
            row = self.wb.req_to_token[self.rows[rid], :self.seq[rid]]
            if not torch.equal(row, self.snapshot[rid]):
                raise AssertionError(f"survivor request {rid}: its req_to_token row changed")
            if not torch.equal(row.to(torch.int64), torch.as_tensor(self.locs[rid])):
                raise AssertionError(f"survivor request {rid}: its row no longer lists its slots")
            got = k[torch.as_tensor(self.locs[rid])]
            if not bool((got == float(-(1000 + i))).all()):
                raise AssertionError(f"survivor request {rid}: its KV was overwritten")
        if self.ka is not None and self.ka.error is not None:
            raise AssertionError(f"survivor keep-alive failed: {self.ka.error!r}")

    def finish(self) -> None:
        """Carry on: one more decode step, then cache and detach."""
        self.c.alloc_decode(self.s, [DecodeItem(r, 8) for r in self.rids])
        self.c.cache_finished(self.s, self.rids)
        if self.ka is not None:
            self.ka.stop()
        else:
            self.c.detach(self.s)


def percentiles(values: list[float], ps=(50, 90, 99, 100)) -> dict[str, float] | None:
    if not values:
        return None
    a = np.asarray(values, dtype=np.float64)
    return {f"p{p}": round(float(np.percentile(a, p)) * 1000, 2) for p in ps} | {"n": len(values)}


class ServerProcess:
    """``python -m radixkv.service.server.cli serve`` in its own process (subprocess, not fork), on
    a Unix socket in a fresh 0700 temp directory, token in a 0600 file. ``restart()`` starts
    a new manager on the same address; ``stop()`` ends it and removes the directory."""

    def __init__(self, args: list[str], start_timeout_s: float = 120.0):
        import os
        import secrets
        import tempfile

        self.args = list(args)
        self.directory = tempfile.mkdtemp(prefix="rkv-rel-")
        self.token = secrets.token_urlsafe(24)
        self.token_file = os.path.join(self.directory, "token")
        fd = os.open(self.token_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        os.write(fd, self.token.encode())
        os.close(fd)
        self.socket_path = os.path.join(self.directory, "sock", "s.sock")  # "sock" is made 0700 by serve
        self.address = f"unix://{self.socket_path}"
        self.start_timeout_s = start_timeout_s
        self.p: Any = None
        self.start()

    def start(self) -> None:
        import subprocess
        import sys

        from radixkv.service.client import connect

        self.p = subprocess.Popen([sys.executable, "-m", "radixkv.service.server.cli", "serve", "--address",
                                   self.address,
                                   "--token-file", self.token_file, "--log-level", "WARNING", *self.args])
        try:
            with connect(self.address, token=self.token, wait_s=self.start_timeout_s) as c:
                c.stats()
        except BaseException:
            self.kill()
            raise

    @property
    def pid(self) -> int:
        return self.p.pid

    def shm_files(self, pid: int | None = None) -> list[str]:
        import glob

        return glob.glob(f"/dev/shm/radixkv-{pid or self.pid}-*")

    def kill(self) -> None:
        if self.p is not None and self.p.poll() is None:
            self.p.kill()
            self.p.wait(PROCESS_BOUND_S)

    def terminate(self, timeout_s: float = PROCESS_BOUND_S) -> int | None:
        import subprocess

        if self.p.poll() is None:
            self.p.terminate()
            try:
                self.p.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.kill()
        return self.p.returncode

    def stop(self) -> None:
        import shutil

        self.terminate()
        shutil.rmtree(self.directory, ignore_errors=True)

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()
