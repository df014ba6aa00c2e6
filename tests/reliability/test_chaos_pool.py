"""The chaos driver's process pool: every worker is a fresh interpreter started by this
process (never forked from a zygote), standbys are kept started ahead and replenished, dead
workers are reaped, a worker does not outlive its driver's pipe, and bad input changes
nothing. Also: no module of the project forks."""
from __future__ import annotations

import os
import re
import signal
import sys
from pathlib import Path

import pytest
from reliability_util import PROCESS_BOUND_S, STATE_BOUND_S, wait_until
from tooling import chaos, chaos_worker
from tooling.chaos import StandbyPool
from tooling.testing import ThreadedServer

from radixkv.errors import InvalidArgumentError, InvariantError

ROOT = Path(__file__).resolve().parents[2]


def _ppid_and_cmdline(pid):
    with open(f"/proc/{pid}/stat") as f:
        ppid = int(f.read().rsplit(")", 1)[1].split()[1])
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return ppid, [a.decode() for a in f.read().split(b"\0") if a]


def _gone(pid):
    """No such process any more (exited and reaped)."""
    return not os.path.exists(f"/proc/{pid}")


@pytest.fixture(scope="module")
def pool():
    p = StandbyPool(standby=2)
    yield p
    p.close()


@pytest.fixture(scope="module")
def srv():
    with ThreadedServer(dict(kv_tokens=1024, request_rows=32, max_context_len=256, lease_ttl_s=1.0)) as s:
        yield s


def _spec(srv, wid, **kw):
    return dict(wid=wid, address=srv.address, token=srv.token, seed=wid, steps=2, hold=True, hb_interval_s=0.1,
                max_life_s=60, **kw)


def test_workers_are_fresh_interpreters_started_by_the_driver(pool, srv):
    assert pool.ready() == 2
    standby_pids = {w.pid for w in pool._ready}
    base_nice = os.getpriority(os.PRIO_PROCESS, 0)
    for pid in standby_pids:  # standbys wait at a lower priority
        assert os.getpriority(os.PRIO_PROCESS, pid) == min(19, base_nice + 10)
    w = pool.spawn(_spec(srv, 1))
    assert w.pid in standby_pids and w.wid == 1 and w.alive()
    ppid, argv = _ppid_and_cmdline(w.pid)
    # a child of this process running the worker module: not forked from a zygote
    assert ppid == os.getpid()
    assert argv[0] == sys.executable and argv[1:] == ["-m", "tooling.chaos_worker"]
    ev = pool.wait_event(lambda e: e.get("wid") == 1 and e["ev"] in ("holding", "error"), STATE_BOUND_S)
    assert ev is not None and ev["ev"] == "holding", ev
    if os.geteuid() == 0:  # raising the priority back is allowed: it runs at ours
        assert os.getpriority(os.PRIO_PROCESS, w.pid) == base_nice
    # the pool replenishes: two standbys again, a third interpreter started
    assert wait_until(lambda: pool.ready() == 2, STATE_BOUND_S)
    st = pool.stats()
    assert st.started >= 3 and st.spawned == 1 and st.died_unused == 0
    pool.check_invariants()
    assert pool.kill(1) is True
    assert wait_until(lambda: _gone(w.pid), PROCESS_BOUND_S), "a killed worker must be reaped, not left a zombie"
    assert pool.kill(1) is False  # already forgotten
    pool.check_invariants()


def test_a_worker_kills_itself_when_its_driver_pipe_closes(pool, srv):
    w = pool.spawn(_spec(srv, 2))
    ev = pool.wait_event(lambda e: e.get("wid") == 2 and e["ev"] in ("holding", "error"), STATE_BOUND_S)
    assert ev is not None and ev["ev"] == "holding", ev
    w.popen.stdin.close()  # what the driver's death does: no signal is sent
    assert wait_until(lambda: not w.alive(), PROCESS_BOUND_S), "the worker outlived its driver's pipe"
    assert w.popen.wait(PROCESS_BOUND_S) == -signal.SIGKILL
    assert pool.kill(2) is False
    # its session goes with it (keep-alive off: the server finds the process gone at expiry)
    assert wait_until(lambda: srv.call(lambda s: len(s.engine.sessions)) == 0, STATE_BOUND_S)


def test_bad_input_changes_nothing(pool, srv):
    assert wait_until(lambda: pool.ready() == 2, STATE_BOUND_S)
    before = pool.stats()
    with pytest.raises(InvalidArgumentError):
        StandbyPool(standby=0)
    with pytest.raises(InvalidArgumentError):
        StandbyPool(standby=2, standby_nice=20)
    for bad in ({"address": "x"}, {"wid": -1}, {"wid": True}, {"wid": 3, "x": object()}, [1]):
        with pytest.raises(InvalidArgumentError):
            pool.spawn(bad)
    w = pool.spawn(_spec(srv, 3))
    with pytest.raises(InvalidArgumentError, match="in use"):
        pool.spawn(_spec(srv, 3))
    after = pool.stats()
    assert after.spawned == before.spawned + 1  # only the good spawn counted
    assert set(pool.workers) == {3} and pool.workers[3] is w
    pool.kill(3)
    pool.check_invariants()


def test_check_invariants_names_a_process_filed_twice(pool, srv):
    assert wait_until(lambda: pool.ready() >= 1, STATE_BOUND_S)
    w = pool.spawn(_spec(srv, 4))
    with pool._cv:
        pool._ready.append(w)  # corrupt: a running worker also filed as a standby
    try:
        with pytest.raises(InvariantError, match=rf"duplicated.*{w.pid}"):
            pool.check_invariants()
    finally:
        with pool._cv:
            pool._ready.remove(w)
    pool.check_invariants()
    pool.kill(4)


def test_close_kills_and_reaps_everything(srv):
    p = StandbyPool(standby=2)
    w = p.spawn(_spec(srv, 0))
    pids = {w.pid} | {s.pid for s in p._ready} | set(p._starting)
    p.close()
    p.close()  # idempotent
    assert all(_gone(pid) for pid in pids), [pid for pid in pids if not _gone(pid)]
    assert not p._reader.is_alive() and not p._filler.is_alive()
    with pytest.raises(InvalidArgumentError, match="closed"):
        p.spawn(_spec(srv, 1))


def test_the_kill_points_and_the_nice_variable_agree():
    assert chaos.KILL_POINTS == chaos_worker.KILL_POINTS
    assert chaos.STANDBY_NICE_ENV == chaos_worker.STANDBY_NICE_ENV


def test_no_module_of_the_project_forks():
    """Processes that share gRPC are started with spawn (a fresh interpreter), never fork."""
    fork = "fo" + "rk"  # spelled apart so this file does not match itself
    pattern = re.compile(rf"os\.{fork}\s*\(|os\.{fork}pty\s*\(|get_context\(\s*['\"]{fork}|"
                         rf"set_start_method\(\s*['\"]{fork}|\bpty\.{fork}\s*\(")
    offenders = []
    for top in ("radixkv", "service", "benchmarks", "tests", "scripts"):
        for path in sorted((ROOT / top).rglob("*.py")) if (ROOT / top).is_dir() else []:
            for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
                if pattern.search(line):
                    offenders.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not offenders, offenders
