"""SIGSTOP past the lease, then SIGCONT: the lease expires, later calls are refused as stale,
and what the worker held is quarantined until its process is gone (or a timeout passes).

The risk being guarded: the resumed worker still writes into the KV slots it held before it
notices its session is gone. With quarantine those slots are not reused, so the stale write
lands in memory nobody else owns; without quarantine (the control case) the slots were given
to another worker and the stale write corrupts its KV: the control test shows the risk is
real, so the quarantine test can fail.
"""
from __future__ import annotations

import json
import signal
import time

import numpy as np
import pytest
import torch
from radixkv.service.server.manager import ServeOptions
from reliability_util import check_law, live_sessions, wait_until
from tooling.testing import ThreadedServer

from radixkv.engine.protocol import ExtendItem
from radixkv.errors import CapacityError

TTL, SWEEP = 1.0, 0.05
CONFIG = dict(kv_tokens=2048, request_rows=64, max_context_len=256, lease_ttl_s=TTL)
PROBE_MARK = 77.0


def _victim(chaos, srv, wid):
    w = chaos.spawn(dict(wid=wid, address=srv.address, token=srv.token, seed=wid, steps=4, keepalive=False,
                          hold=True, hb_interval_s=0.1, marker=-5.0, max_life_s=120))
    sid = None
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        for ev in chaos.drain(0.05):
            if ev.get("wid") != wid:
                continue
            if ev["ev"] == "attached":
                sid = ev["sid"]
            elif ev["ev"] == "holding":
                return w, sid, set(ev["held"])  # the slots of its running requests
            elif ev["ev"] == "error":
                raise AssertionError(ev)
    raise AssertionError("the victim never reached its holding loop")


def _probe_fill(c, s):
    """Allocate every KV slot the engine will give (evicting the tree): the slots, and the
    rids that hold them. Writes PROBE_MARK into layer 0's K rows of those slots."""
    got, rids, i = [], [], 0
    while True:
        try:
            r = c.alloc_extend(s, [ExtendItem(f"probe-{i}", np.full(256, 3 + i, dtype=np.int32))])[0]
        except CapacityError:
            break
        got.append(r.out_cache_loc)
        rids.append(r.rid)
        i += 1
    for n in (128, 64, 32, 16, 8, 4, 2, 1):  # the remainder, in smaller pieces
        while True:
            try:
                r = c.alloc_extend(s, [ExtendItem(f"probe-{i}", np.full(n, 3 + i, dtype=np.int32))])[0]
            except CapacityError:
                break
            got.append(r.out_cache_loc)
            rids.append(r.rid)
            i += 1
    return np.concatenate(got), rids


def _await(chaos, wid, kind, timeout_s=30.0):
    ev = chaos.wait_event(lambda e: e.get("wid") == wid and e["ev"] in (kind, "error"), timeout_s)
    assert ev is not None and ev["ev"] == kind, ev
    return ev


@pytest.mark.parametrize("quarantine", [True, False], ids=["quarantine", "control-no-quarantine"])
def test_sigstop_past_the_lease_then_sigcont(chaos, quarantine):
    opts = ServeOptions(sweep_interval_s=SWEEP, grace_s=1.0, quarantine_s=60.0 if quarantine else 0.0)
    with ThreadedServer(CONFIG, options=opts) as srv:
        c = srv.client()
        w, sid, victim_locs = _victim(chaos, srv, 1)
        assert sid and victim_locs
        assert w.signal(signal.SIGSTOP)
        t_stop = time.monotonic()

        def ended():
            def look(s):
                try:
                    rec = s.engine.sessions.record(sid)
                except Exception:
                    return ("reclaimed", None, None)
                return ("fenced", rec.fenced_at, rec.expires_at) if rec.fenced_at is not None else None
            return srv.call(look)

        state = wait_until(ended, 30, every_s=0.005)
        t_seen = time.monotonic()
        assert state is not None, "the paused worker's lease never expired"
        kind, fenced_at, expires_at = state
        assert kind == ("fenced" if quarantine else "reclaimed")
        st = c.stats()
        check_law(st)
        s = c.attach("probe").session
        probe_locs, probe_rids = _probe_fill(c, s)
        wb = c.worker_buffers(c.attach("reader"))
        k, _ = wb.get_kv_buffer(0)
        k[torch.as_tensor(probe_locs)] = PROBE_MARK
        overlap = set(probe_locs.tolist()) & victim_locs
        assert w.signal(signal.SIGCONT)
        refused = _await(chaos, 1, "refused")
        assert refused["code"] == "FAILED_PRECONDITION"
        _await(chaos, 1, "stale_write")
        corrupted = int((k[torch.as_tensor(probe_locs)] != PROBE_MARK).any(dim=(1, 2)).sum())
        if quarantine:
            assert not overlap, "a quarantined slot was handed to another worker"
            assert corrupted == 0
            assert sid in live_sessions(srv)  # held while the process lives
        else:
            assert overlap, "control: without quarantine the freed slots go to the next worker"
            assert corrupted > 0, "control: the resumed worker's stale write lands in another's KV"
        t_kill = time.monotonic()
        chaos.kill(1)
        assert wait_until(lambda: sid not in live_sessions(srv), 30, every_s=0.005)
        t_released = time.monotonic()
        c.release(s, probe_rids)
        srv.call(lambda s_: s_.servicer.check_all())
        q = srv.call(lambda s_: s_.servicer.quarantine.stats())
        if quarantine:
            assert q.fenced == 1 and q.released_gone == 1 and q.released_timeout == 0
            print("RELIABILITY sigstop " + json.dumps({
                "ttl_s": TTL, "sweep_s": SWEEP,
                "expiry_to_fence_ms": round((fenced_at - expires_at) * 1000, 1),
                "stop_to_detected_ms": round((t_seen - t_stop) * 1000, 1),
                "kill_to_release_ms": round((t_released - t_kill) * 1000, 1)}))


def test_quarantine_timeout_releases_a_worker_that_never_resumes(chaos):
    hold = 1.0
    opts = ServeOptions(sweep_interval_s=SWEEP, grace_s=1.0, quarantine_s=hold)
    with ThreadedServer(CONFIG, options=opts) as srv:
        c = srv.client()
        w, sid, _ = _victim(chaos, srv, 2)
        assert w.signal(signal.SIGSTOP)
        try:
            fenced = wait_until(lambda: srv.call(lambda s: s.engine.sessions.fenced()), 30, every_s=0.005)
            assert fenced == [sid]
            t_fenced = time.monotonic()
            assert wait_until(lambda: sid not in live_sessions(srv), 30, every_s=0.005)
            held_s = time.monotonic() - t_fenced
            assert w.alive(), "the worker is only stopped: released by the timeout, not by its death"
            q = srv.call(lambda s: s.servicer.quarantine.stats())
            assert (q.released_timeout, q.released_gone) == (1, 0)
            st = c.stats()
            assert st.sessions == 0 and st.requests == 0 and st.kv_held == 0
            srv.call(lambda s: s.servicer.check_all())
            print("RELIABILITY quarantine_timeout " + json.dumps({"hold_s": hold, "held_ms": round(held_s * 1000, 1)}))
        finally:
            chaos.kill(2)
