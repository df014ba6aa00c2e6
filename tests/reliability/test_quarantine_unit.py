"""Fencing in the session table and the quarantine policy, on an embedded engine and a fake
clock (no server): who is held, for how long, and that nothing leaks either way."""
from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
from engine_fixtures import ManualClock
from radixkv.service.server.quarantine import ProcessHandle, Quarantine
from reliability_util import PROCESS_BOUND_S

from radixkv.engine import CacheEngine, EngineConfig
from radixkv.engine.protocol import ExtendItem
from radixkv.engine.sessions import SessionTable
from radixkv.errors import InvalidArgumentError, InvariantError, StaleSessionError


def test_a_fenced_session_is_refused_but_keeps_its_requests():
    clock = ManualClock(100.0)
    t = SessionTable(5.0, 4, 4, clock=clock)
    s = t.open("w")
    t.add_requests(s.session_id, ["r1", "r2"])
    clock.t += 6
    assert t.due() == [s.session_id]
    t.fence(s.session_id, "is quarantined")
    t.fence(s.session_id, "again")  # idempotent: the first reason stays
    with pytest.raises(StaleSessionError, match="is quarantined"):
        t.lookup(s)
    with pytest.raises(StaleSessionError):
        t.renew(s.session_id)
    assert t.due() == [] and t.fenced() == [s.session_id]
    assert t.request_count() == 2 and t.rids(s.session_id) == ["r1", "r2"]  # a fence frees nothing
    t.check_invariants()
    assert t.close(s.session_id, "reclaimed") == ["r1", "r2"]
    assert t.fenced() == [] and t.request_count() == 0
    t.check_invariants()
    with pytest.raises(StaleSessionError):
        t.fence(s.session_id)
    with pytest.raises(InvalidArgumentError):
        t.fence(t.open("x").session_id, reason=5)


def _engine(clock):
    e = CacheEngine(EngineConfig(kv_tokens=256, lease_ttl_s=5.0), clock=clock)
    s = e.attach("w").session
    e.alloc_extend(s, [ExtendItem("r", np.arange(1, 33, dtype=np.int32))])
    return e, s


@pytest.fixture
def sleeper():
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    yield p
    if p.poll() is None:
        p.kill()
        p.wait(PROCESS_BOUND_S)


def test_held_while_the_process_runs_released_when_it_is_gone(sleeper):
    clock = ManualClock(100.0)
    e, s = _engine(clock)
    q = Quarantine(e, hold_s=60.0)
    q.register(s.session_id, sleeper.pid)
    clock.t += 6
    assert q.fence_due() == [s.session_id]
    assert e.sweep() == []  # the engine's own sweep leaves it alone
    with pytest.raises(StaleSessionError, match="quarantined"):
        e.heartbeat(s)
    assert e.stats().kv_held == 32 and q.release_ready() == []
    e.check_invariants()
    q.check_invariants()
    sleeper.kill()
    sleeper.wait(PROCESS_BOUND_S)
    assert q.release_ready() == [s.session_id]
    st = e.stats()
    assert st.kv_held == 0 and st.sessions == 0 and st.requests == 0
    assert q.stats().released_gone == 1 and q.stats().tracked == 0
    e.check_invariants()
    q.check_invariants()


def test_the_hold_times_out_even_while_the_process_runs(sleeper):
    clock = ManualClock(100.0)
    e, s = _engine(clock)
    q = Quarantine(e, hold_s=10.0)
    q.register(s.session_id, sleeper.pid)
    clock.t += 6
    q.fence_due()
    clock.t += 9.9
    assert q.release_ready() == []
    clock.t += 0.2
    assert q.release_ready() == [s.session_id] and e.stats().kv_held == 0
    assert q.stats().released_timeout == 1


@pytest.mark.parametrize("who", ["own", "dead", "unknown", "off"])
def test_who_is_held(who, sleeper):
    clock = ManualClock(100.0)
    e, s = _engine(clock)
    q = Quarantine(e, hold_s=0.0 if who == "off" else 10.0)
    pid = {"own": q.own_pid, "dead": sleeper.pid, "unknown": 0, "off": sleeper.pid}[who]
    q.register(s.session_id, pid)
    if who == "dead":  # it ran at attach and has exited since
        sleeper.kill()
        sleeper.wait(PROCESS_BOUND_S)
    clock.t += 6
    fenced = q.fence_due()
    e.sweep()
    if who == "unknown":  # another host or pid namespace: held for the timeout only
        assert fenced == [s.session_id] and e.stats().kv_held == 32
        clock.t += 10
        q.release_ready()
    else:
        assert fenced == []
    assert e.stats().kv_held == 0
    q.forget_ended()
    assert q.stats().tracked == 0
    e.check_invariants()


def test_a_dropped_stream_of_a_live_process_is_quarantined(sleeper):
    clock = ManualClock(100.0)
    e, s = _engine(clock)
    q = Quarantine(e, hold_s=10.0)
    q.register(s.session_id, sleeper.pid)
    assert q.end(s.session_id, "its keep-alive stream was dropped") == 0
    assert e.sessions.fenced() == [s.session_id]
    assert q.end(s.session_id, "again") == 0  # already fenced
    sleeper.kill()
    sleeper.wait(PROCESS_BOUND_S)
    assert q.release_ready() == [s.session_id]


def test_bad_pids_and_options_are_refused():
    for bad in (-1, 1 << 31, True, 1.5):
        with pytest.raises(InvalidArgumentError):
            Quarantine.check_pid(bad)
    with pytest.raises(InvalidArgumentError):
        Quarantine(None, hold_s=-1)
    assert ProcessHandle.open(0) is None


def test_invariant_names_fenced_sessions_when_quarantine_is_off():
    clock = ManualClock(100.0)
    e, s = _engine(clock)
    q = Quarantine(e, hold_s=0.0)
    e.sessions.fence(s.session_id)
    with pytest.raises(InvariantError, match=s.session_id):
        q.check_invariants()


def test_quarantine_is_on_by_default_and_can_be_turned_off():
    """Safety first: ``serve`` holds what an expired session held for up to 30 s unless told
    ``--quarantine-s 0``; the servicer a server builds gets that value."""
    import argparse

    from radixkv.service.server.cli import add_serve_arguments, serve_options_from_args
    from radixkv.service.server.manager import DEFAULT_QUARANTINE_S, ServeOptions
    from tooling.testing import ThreadedServer

    assert DEFAULT_QUARANTINE_S == 30.0 and ServeOptions().quarantine_s == 30.0
    parser = add_serve_arguments(argparse.ArgumentParser())
    assert serve_options_from_args(parser.parse_args([])).quarantine_s == 30.0
    assert serve_options_from_args(parser.parse_args(["--quarantine-s", "0"])).quarantine_s == 0.0
    with ThreadedServer(dict(kv_tokens=256)) as srv:  # default options
        assert srv.call(lambda s: s.servicer.quarantine.hold_s) == 30.0
