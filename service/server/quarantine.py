"""Quarantine: what an expired session held is not reused while its worker may still write.

A worker paused past its lease may still write the KV slots, rows and states it held (KV
never goes through the manager) after they were handed on. So a session that ends without
the worker saying so, while its process may still run, is *fenced*
(:meth:`radixkv.engine.sessions.SessionTable.fence`): its calls are refused as stale, its
requests keep what they hold. It is reclaimed at the first sweep after the process is gone
(pidfd polled, immune to pid reuse) or ``hold_s`` seconds. No quarantine when ``hold_s`` is
0, for the manager's own process, a pid known to have exited, ``Detach`` or a keep-alive the
worker closed; an unknown pid is held for the timeout. Single-threaded. Costs:
:meth:`fence_due` O(1) when nothing is due; :meth:`release_ready` O(fenced);
:meth:`forget_ended` O(tracked). See ``docs/reliability.md``.
"""
from __future__ import annotations

import logging
import os
import select
from typing import TYPE_CHECKING, NamedTuple

from radixkv.errors import InvalidArgumentError, InvariantError, StaleSessionError

if TYPE_CHECKING:
    from radixkv.engine.embedded import CacheEngine

__all__ = ["ProcessHandle", "Quarantine", "QuarantineStats", "MAX_PID"]

log = logging.getLogger("radixkv.service")

MAX_PID = (1 << 31) - 1


class ProcessHandle:
    """A handle on one process that survives pid reuse (a pidfd where the OS has them).

    ``gone()`` is True once the process has exited (a zombie counts). Without pidfds it
    falls back to ``kill(pid, 0)`` plus the ``/proc`` state (a reused pid would then read as
    alive: the quarantine timeout still bounds the hold)."""

    __slots__ = ("pid", "_fd", "_start")

    def __init__(self, pid: int, fd: int | None, start: str | None):
        self.pid = pid
        self._fd = fd
        self._start = start

    @classmethod
    def open(cls, pid: int) -> ProcessHandle | None:
        """A handle on running process ``pid``, or None when there is no such process."""
        if pid <= 0:
            return None
        opener = getattr(os, "pidfd_open", None)
        if opener is not None:
            try:
                return cls(pid, opener(pid), None)
            except ProcessLookupError:
                return None
            except OSError:
                pass  # no pidfds here: fall back
        start = _proc_start(pid)
        if start is None and not _kill0(pid):
            return None
        return cls(pid, None, start)

    def gone(self) -> bool:
        if self._fd is not None:
            p = select.poll()
            p.register(self._fd, select.POLLIN)
            return bool(p.poll(0))
        if not _kill0(self.pid):
            return True
        start = _proc_start(self.pid)
        return start is not None and self._start is not None and start != self._start

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __repr__(self) -> str:
        return f"ProcessHandle(pid={self.pid}, pidfd={self._fd is not None})"


def _kill0(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _proc_start(pid: int) -> str | None:
    """The start time field of ``/proc/<pid>/stat`` (None: no such process, a zombie, or no
    /proc)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    if fields and fields[0] in ("Z", "X"):
        return None
    return fields[19] if len(fields) > 19 else None


class QuarantineStats(NamedTuple):
    """``held``: sessions fenced now; ``fenced`` / ``released_gone`` / ``released_timeout``:
    since start; ``tracked``: sessions with a process handle."""

    held: int
    fenced: int
    released_gone: int
    released_timeout: int
    tracked: int


class Quarantine:
    """Fences sessions that end behind their worker's back, releases them when safe.

    Args:
        engine: the ``CacheEngine`` (its ``sessions`` table and ``reclaim``).
        hold_s: the longest a fenced session is held (0: no quarantine at all).
        own_pid: the manager's pid (its own in-process workers are never quarantined).
    """

    def __init__(self, engine: CacheEngine, hold_s: float, own_pid: int | None = None):
        if isinstance(hold_s, bool) or not isinstance(hold_s, (int, float)) or not 0 <= hold_s < 1e9:
            raise InvalidArgumentError(f"quarantine hold_s must be a number in [0, 1e9), got {hold_s!r}")
        self.engine = engine
        self.hold_s = float(hold_s)
        self.own_pid = os.getpid() if own_pid is None else int(own_pid)
        self._pids: dict[str, int] = {}  # session id -> reported pid (0 unknown)
        self._handles: dict[str, ProcessHandle] = {}
        self._fenced = 0
        self._gone = 0
        self._timeout = 0

    # ------------------------------------------------------------------ attach
    @staticmethod
    def check_pid(pid: object) -> int:
        """A reported pid: an int in ``[0, 2**31)`` (0: unknown). Raises ``InvalidArgumentError``."""
        if isinstance(pid, bool) or not isinstance(pid, int) or not 0 <= pid <= MAX_PID:
            raise InvalidArgumentError(f"pid must be an int in [0, 2**31), got {pid!r}")
        return pid

    def register(self, session_id: str, pid: int) -> None:
        """Remember the worker process of a new session (``pid`` checked by :meth:`check_pid`)."""
        self._pids[session_id] = pid
        if pid > 0 and pid != self.own_pid:
            h = ProcessHandle.open(pid)
            if h is not None:
                self._handles[session_id] = h

    # ------------------------------------------------------------------ decisions
    def must_hold(self, session_id: str) -> bool:
        """Whether what ``session_id`` holds must be quarantined if it ended now."""
        if self.hold_s <= 0:
            return False
        pid = self._pids.get(session_id, 0)
        if pid == self.own_pid:
            return False
        h = self._handles.get(session_id)
        if h is not None:
            return not h.gone()
        return True  # unknown process: held for the timeout

    def fence_due(self) -> list[str]:
        """Fence every session whose lease ran out and whose worker may still run (the
        engine's own sweep then reclaims the others). Returns the fenced ids."""
        if self.hold_s <= 0:
            return []
        sessions = self.engine.sessions
        out = []
        for sid in sessions.due():
            if self.must_hold(sid):
                sessions.fence(sid, "expired (its lease ran out); what it held is quarantined "
                                    "until its worker process is gone")
                self._fenced += 1
                out.append(sid)
        return out

    def end(self, session_id: str, why: str) -> int:
        """A session ended behind its worker's back (e.g. its keep-alive stream dropped):
        fence it when it must be held, else reclaim it now. Returns the requests reclaimed
        now (0 when fenced or already gone)."""
        sessions = self.engine.sessions
        try:
            rec = sessions.record(session_id)
        except StaleSessionError:
            return 0
        if rec.fenced_at is not None:
            return 0
        if self.must_hold(session_id):
            sessions.fence(session_id, f"{why}; what it held is quarantined until its worker process is gone")
            self._fenced += 1
            return 0
        return self.engine.reclaim(session_id, why)

    def release_ready(self) -> list[str]:
        """Reclaim every fenced session whose process is gone or whose hold ran out.
        Returns their ids."""
        sessions = self.engine.sessions
        fenced = sessions.fenced()
        if not fenced:
            return []
        now = sessions.now()
        out = []
        for sid in fenced:
            h = self._handles.get(sid)
            if h is not None and h.gone():
                self._gone += 1
                why = "was reclaimed from quarantine: its worker process is gone"
            elif now - (sessions.record(sid).fenced_at or 0.0) >= self.hold_s:  # fenced(): set
                self._timeout += 1
                why = f"was reclaimed from quarantine after {self.hold_s:g} s"
            else:
                continue
            n = self.engine.reclaim(sid, why)
            log.info("session %s %s (%d request(s))", sid, why, n)
            self._drop(sid)
            out.append(sid)
        return out

    def forget_ended(self) -> None:
        """Close the process handles of sessions that are no longer live."""
        live = set(self.engine.sessions.session_ids())
        for sid in [s for s in self._pids if s not in live]:
            self._drop(sid)

    def close(self) -> None:
        for sid in list(self._pids):
            self._drop(sid)

    def _drop(self, sid: str) -> None:
        self._pids.pop(sid, None)
        h = self._handles.pop(sid, None)
        if h is not None:
            h.close()

    # ------------------------------------------------------------------ audit
    def stats(self) -> QuarantineStats:
        return QuarantineStats(len(self.engine.sessions.fenced()), self._fenced, self._gone, self._timeout,
                               len(self._handles))

    def pid_of(self, session_id: str) -> int:
        """The pid ``session_id`` reported at attach (0: unknown or not tracked)."""
        return self._pids.get(session_id, 0)

    def check_invariants(self) -> None:
        """Every process handle belongs to a tracked session, and no fenced session is
        held while quarantine is off. Raises ``InvariantError`` naming the sessions."""
        orphans = sorted(set(self._handles) - set(self._pids))
        if orphans:
            raise InvariantError(f"process handles of untracked sessions (leaked): {orphans}")
        if self.hold_s <= 0:
            fenced = self.engine.sessions.fenced()
            if fenced:
                raise InvariantError(f"sessions fenced while quarantine is off: {fenced}")
