"""Engine processes that leave nothing behind: each spawned vLLM instance leads its own
process group, and stopping it ends the whole group.

vLLM starts children of its own (an engine core, a worker), and an instance that ends with
``os._exit`` (or is killed) leaves them running, re-parented to init, ~1.5 GB each. The
instance calls :func:`lead_group` first thing; the parent calls :func:`end_group` with the
instance's pid once it has stopped it (the group id is that pid, and it stays valid while any
member lives, even after the leader is gone).
"""
from __future__ import annotations

import os
import signal


def lead_group() -> None:
    """Make the calling process the leader of a new session and process group."""
    os.setsid()


def members(pgid: int) -> list[int]:
    """The pids whose process group is ``pgid`` (Linux ``/proc``; empty elsewhere)."""
    out = []
    for name in os.listdir("/proc") if os.path.isdir("/proc") else ():
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        # pid (comm) state ppid pgrp ...: comm may hold spaces, so split after its ')'
        fields = stat[stat.rfind(")") + 2:].split()
        if int(fields[2]) == pgid and fields[0] != "Z":
            out.append(int(name))
    return out


def end_group(pgid: int) -> None:
    """SIGKILL every process left in group ``pgid`` (no error when none is left)."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass
