"""Restart the manager under load: clients see UNAVAILABLE, re-attach, and carry on.

Three client threads run extend / decode / cache / release steps (writing KV into the shared
buffers) against a ``serve`` process. The manager is killed (SIGKILL: a crash, its pool files
left behind) or stopped (SIGTERM) mid-load and a new one started on the same address. Every
client sees ``ServiceUnavailableError`` while it is down, then ``StaleSessionError`` (old
epoch), re-attaches, maps the new pools and completes more steps. Afterwards: no pool file of
the old manager is left in ``/dev/shm``, this process no longer maps any of them, and the new
manager is idle and consistent once the clients detach.
"""
from __future__ import annotations

import gc
import signal
import threading
import time

import numpy as np
import pytest
import torch
from radixkv.service.client import connect
from radixkv.service.wire.errors import ServiceUnavailableError
from reliability_util import PROCESS_BOUND_S, STATE_BOUND_S, ServerProcess, check_law, wait_until

from radixkv.engine.protocol import DecodeItem, ExtendItem
from radixkv.errors import StaleSessionError

ARGS = ["--kv-tokens", "4096", "--lease-ttl-s", "5", "--sweep-interval-s", "0.1", "--grace-s", "1"]


class Client(threading.Thread):
    def __init__(self, srv, n):
        super().__init__(daemon=True)
        self.c = connect(srv.address, token=srv.token, wait_s=60, timeout_s=5)
        self.n = n
        self.stop = threading.Event()
        self.epochs, self.unavailable, self.stale, self.errors = {}, 0, 0, []
        self.info = None

    def attach(self):
        self.info = self.c.attach(f"client-{self.n}")
        self.wb = self.c.worker_buffers(self.info)

    def step(self, i):
        s = self.info.session
        rid = f"c{self.n}-{s.epoch}-{i}"
        prompt = np.arange(1 + self.n * 100 + i % 7, 40 + self.n * 100 + i % 7, dtype=np.int32)
        r = self.c.alloc_extend(s, [ExtendItem(rid, prompt)])[0]
        k, v = self.wb.get_kv_buffer(0)
        loc = torch.as_tensor(r.out_cache_loc)
        k[loc] = float(self.n)
        self.c.alloc_decode(s, [DecodeItem(rid, 3)])
        if i % 2:
            self.c.cache_finished(s, [rid])
        else:
            self.c.release(s, [rid])
        self.epochs[s.epoch] = self.epochs.get(s.epoch, 0) + 1

    def run(self):
        i = 0
        while not self.stop.is_set():
            try:
                if self.info is None:
                    self.attach()
                self.step(i)
                i += 1
            except ServiceUnavailableError:
                self.unavailable += 1
                time.sleep(0.05)
            except StaleSessionError:
                self.stale += 1
                self.info = None  # the manager restarted: attach again
            except Exception as e:  # noqa: BLE001 - reported by the test
                self.errors.append(repr(e))
                time.sleep(0.05)

    def done(self):
        self.stop.set()
        self.join(30)
        if self.info is not None:
            try:
                self.c.detach(self.info.session)
            except StaleSessionError:
                pass
        self.info = self.wb = None
        self.c.close()


def _mapped(pid):
    with open("/proc/self/maps") as f:
        return [line for line in f if f"radixkv-{pid}-" in line]


@pytest.mark.parametrize("how", ["sigkill", "sigterm"])
def test_restart_under_load(how):
    with ServerProcess(ARGS) as srv:
        clients = [Client(srv, n) for n in range(3)]
        for cl in clients:
            cl.start()
        try:
            assert wait_until(lambda: all(sum(cl.epochs.values()) >= 5 for cl in clients), STATE_BOUND_S)
            old_pid = srv.pid
            assert len([f for f in srv.shm_files(old_pid) if f.endswith(".buf")]) == 2
            if how == "sigkill":
                srv.p.send_signal(signal.SIGKILL)
                srv.p.wait(PROCESS_BOUND_S)
                assert srv.shm_files(old_pid), "a crashed manager cannot clean up: the next one must"
            else:
                assert srv.terminate() == 0
                assert not srv.shm_files(old_pid)
            assert wait_until(lambda: all(cl.unavailable for cl in clients), STATE_BOUND_S), \
                "clients must see UNAVAILABLE"
            srv.start()  # a new manager on the same address
            assert not srv.shm_files(old_pid), "the old manager's pool files are left behind"
            epochs = lambda cl: [e for e, n in cl.epochs.items() if n >= 5]  # noqa: E731
            assert wait_until(lambda: all(len(epochs(cl)) >= 2 for cl in clients), STATE_BOUND_S), \
                [cl.epochs for cl in clients]
        finally:
            for cl in clients:
                cl.done()
        assert not [e for cl in clients for e in cl.errors], [cl.errors for cl in clients]
        assert all(cl.stale >= 1 for cl in clients)
        gc.collect()
        assert not _mapped(old_pid), "this process still maps the old manager's pools"
        with connect(srv.address, token=srv.token, wait_s=30) as c:
            st = wait_until(lambda: (lambda s: s if s.sessions == 0 else None)(c.stats()), STATE_BOUND_S)
            assert st is not None and st.kv_held == 0 and st.requests == 0
            check_law(st)
            c.check_invariants()
