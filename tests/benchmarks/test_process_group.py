"""benchmarks/process_group.py: a spawned engine process that ends abruptly (``os._exit``)
leaves its own children behind unless the whole group is ended (the vLLM harness's leak)."""
import multiprocessing as mp
import os
import subprocess
import sys
import time

import pytest
from process_group import end_group, lead_group, members

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc"), reason="process groups are read from /proc")


def _parent_of_a_sleeper(conn):
    lead_group()
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    conn.send(child.pid)
    conn.recv()
    os._exit(0)  # as the harness's engine process ends: no clean-up of its children


def _wait_until(cond, timeout_s=60.0):
    end = time.monotonic() + timeout_s
    while not cond() and time.monotonic() < end:
        time.sleep(0.05)
    return cond()


def test_ending_the_group_ends_the_children_an_exited_leader_left():
    ctx = mp.get_context("spawn")
    parent, child_end = ctx.Pipe()
    proc = ctx.Process(target=_parent_of_a_sleeper, args=(child_end,))
    proc.start()
    sleeper = parent.recv()
    assert set(members(proc.pid)) == {proc.pid, sleeper}
    parent.send("exit")
    proc.join(60)
    # the leader is gone, its child lives on in the group: the leak
    assert members(proc.pid) == [sleeper]
    end_group(proc.pid)
    assert _wait_until(lambda: members(proc.pid) == []), members(proc.pid)


def test_ending_an_empty_group_is_not_an_error():
    proc = subprocess.Popen([sys.executable, "-c", "pass"], start_new_session=True)
    proc.wait()
    end_group(proc.pid)
    assert members(proc.pid) == []
