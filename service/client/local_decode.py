"""Client-local decode steps: what a remote client knows of its requests' decode reserves.

When every request of a decode step holds >= 2 reserved slots, the manager makes no
allocator call and the result follows from earlier replies (``out_cache_loc = reserve[0]``,
``seq_len + 1``, same row and slot). :class:`LocalDecodes` is the client's table of this,
per session and epoch, refreshed from every reply; :meth:`LocalDecodes.try_local` answers
such a step without an RPC, logs it and writes the mapped ``req_to_token``;
:meth:`LocalDecodes.flush` replays the log as one ``ApplyDecodes`` before any other call of
the session (over a Step stream it rides on the next call). The table is dropped for a
session on any error, detach or new epoch; one client per session.

Costs: ``try_local`` O(B + reserved slots) (vector ops when the batch repeats the previous
one's rids, one loop over B to build a new one); ``flush`` O(logged items) plus one RPC.
Thread-safe (one lock held across a flush). Details: ``docs/service.md``, "Local decode steps".
"""
from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple, cast

import numpy as np
import torch
from radixkv.service.wire import codec as wire
from radixkv.service.wire._gen import cache_manager_pb2 as pb

from radixkv.engine.protocol import DecodeItem, DecodeResult, ExtendResult, Session
from radixkv.errors import InvariantError, RadixKVError, StaleSessionError, describe_ids

__all__ = ["LocalDecodes", "LocalDecodeStats", "PendingCall", "replay_request"]

log = logging.getLogger("radixkv.service")

_Key = tuple[str, int]


class PendingCall(NamedTuple):
    """One decode call answered locally, to be replayed: its rids and their int32 tokens."""

    rids: list[str]
    token_ids: np.ndarray  # int32 [B]


class LocalDecodeStats(NamedTuple):
    """Counters of a :class:`LocalDecodes` (since it was made)."""

    sessions: int  # session tables held now
    requests: int  # requests known now (with >= 2 reserved slots)
    pending_calls: int  # logged calls not yet replayed, all sessions
    local_calls: int  # decode calls answered locally
    replayed_calls: int  # logged calls sent in successful flushes
    flushes: int  # replays sent, as ApplyDecodes RPCs or riding on a call (failed ones included)
    drops: int  # session tables dropped (an error, detach, an epoch change, close)


class _Req:
    """What the client knows of one request: ``reserve[head:]`` is its reserve now."""

    __slots__ = ("row", "seq_len", "mamba", "reserve", "head")

    def __init__(self, row: int, seq_len: int, mamba: int, reserve: np.ndarray):
        self.row, self.seq_len, self.mamba, self.reserve, self.head = row, seq_len, mamba, reserve, 0

    def left(self) -> int:
        return self.reserve.size - self.head


class _Batch:
    """The requests of the last locally answered decode call, in its order, as arrays: a
    scheduler decodes the same batch step after step, so the next call with the same rids
    is answered with a few vector ops (no loop over the requests). The batch owns its
    entries' progress: ``h`` calls were answered since it was built, each entry's
    ``head`` / ``seq_len`` lag by ``h`` until :meth:`_Table.sync` writes them back."""

    __slots__ = ("rids", "ents", "rows", "mamba", "seq", "res", "left", "min_left", "uniform", "h")

    def __init__(self, rids: list[str], ents: list[_Req]):
        self.rids, self.ents, self.h = rids, ents, 0
        cur = [e.reserve[e.head:] for e in ents]
        left = np.fromiter((c.size for c in cur), np.int64, len(cur))
        width = int(left.max())
        flat = np.concatenate(cur)
        self.uniform = int(left.min()) == width
        if self.uniform:
            self.res = flat.reshape(len(cur), width)
        else:  # padded rows; a boolean mask assigns in row-major order, i.e. the concatenation's
            self.res = np.full((len(cur), width), -1, np.int64)
            self.res[np.arange(width) < left[:, None]] = flat
        self.left, self.min_left = left, int(left.min())
        self.rows = np.fromiter((e.row for e in ents), np.int64, len(ents))
        self.mamba = np.fromiter((e.mamba for e in ents), np.int64, len(ents))
        self.seq = np.fromiter((e.seq_len for e in ents), np.int64, len(ents))


class _Table:
    __slots__ = ("reqs", "pending", "session", "batch")

    def __init__(self, session: Session) -> None:
        self.reqs: dict[str, _Req] = {}
        self.pending: list[PendingCall] = []
        self.session = session  # with its secret: a replay for a session-less call names it
        self.batch: _Batch | None = None

    def sync(self) -> None:
        """Write the batch's progress back into its entries (dropping those left with < 2
        reserved slots) and forget the batch; before anything else reads ``reqs``. O(B)."""
        bt, self.batch = self.batch, None
        if bt is None or not bt.h:
            return
        h, reqs = bt.h, self.reqs
        for rid, e in zip(bt.rids, bt.ents):
            e.head += h
            e.seq_len += h
            if e.reserve.size - e.head < 2 and reqs.get(rid) is e:  # the next step may top up
                del reqs[rid]


def _key(session: Session) -> _Key:
    return (session[0], int(session[1]))


def replay_request(session: Session, calls: Sequence[PendingCall]) -> pb.ApplyDecodesRequest:
    """The ``ApplyDecodes`` request replaying ``calls`` (packed). O(items)."""
    return wire.apply_decodes_to_msg(session, calls)


class LocalDecodes:
    """The per-session tables of one client (see the module doc).

    Args:
        enabled: False: :meth:`try_local` always answers None (every decode is an RPC) and
            nothing is recorded.
    """

    def __init__(self, enabled: bool = True):
        self.enabled = bool(enabled)
        self.lock = threading.RLock()
        self._tables: dict[_Key, _Table] = {}
        self._epoch: int | None = None
        self._req_to_token: dict[int, torch.Tensor] = {}  # epoch -> the worker's mapped table
        self.local_calls = self.replayed_calls = self.flushes = self.drops = 0

    # ------------------------------------------------------------------ tables
    def _table(self, session: Session) -> _Table | None:
        """The session's table, if any: a call naming a stale epoch finds none and changes
        nothing."""
        return self._tables.get(_key(session))

    def _replied_table(self, session: Session) -> _Table:
        """The session's table, made if need be: only for a reply the manager just sent,
        which proves the session's epoch current. A new epoch drops every table of the old
        one (a restarted manager: what they said is void)."""
        key = _key(session)
        if key[1] != self._epoch:
            if self._epoch is not None:
                self.drops += len(self._tables)
                self._tables.clear()
                self._req_to_token = {e: t for e, t in self._req_to_token.items() if e == key[1]}
            self._epoch = key[1]
        t = self._tables.get(key)
        if t is None:
            t = self._tables[key] = _Table(session)
        return t

    def map_req_to_token(self, epoch: int, table: torch.Tensor) -> None:
        """The worker's view of the manager's ``req_to_token`` (epoch ``epoch``): local
        decodes of that epoch's sessions write their slots into it."""
        with self.lock:
            self._req_to_token[int(epoch)] = table

    def observe_extend(self, session: Session, results: Sequence[ExtendResult]) -> None:
        """Record where the requests of an ``alloc_extend`` reply stand. O(B + slots)."""
        if not self.enabled or not results:
            return
        with self.lock:
            t = self._replied_table(session)
            t.sync()
            reqs = t.reqs
            for r in results:
                self._put(reqs, r.rid, int(r.req_pool_idx), int(r.seq_len), int(r.mamba_slot), r.reserved)

    def observe_decode(self, session: Session, rids: Sequence[str], result: DecodeResult) -> None:
        """Record where the requests of an ``alloc_decode`` reply (over the RPC) stand."""
        if not self.enabled or not rids:
            return
        lens = result.reserved_lens
        if lens.size != len(rids):  # a manager without reserves: nothing to keep
            self.forget(session, rids)
            return
        ends = np.cumsum(lens).tolist()
        rows, seqs, slots = (a.tolist() for a in (result.req_pool_indices, result.seq_lens, result.mamba_slots))
        with self.lock:
            t = self._replied_table(session)
            t.sync()
            reqs = t.reqs
            start = 0
            for i, rid in enumerate(rids):
                self._put(reqs, rid, rows[i], seqs[i], slots[i], result.reserved[start:ends[i]])
                start = ends[i]

    @staticmethod
    def _put(reqs: dict[str, _Req], rid: str, row: int, seq_len: int, mamba: int, reserve: np.ndarray) -> None:
        if reserve.size >= 2:
            reqs[rid] = _Req(row, seq_len, mamba, np.array(reserve, dtype=np.int64))
        else:
            reqs.pop(rid, None)

    def forget(self, session: Session, rids: Sequence[str]) -> None:
        """Forget ``rids`` (finished or released). O(len(rids))."""
        with self.lock:
            t = self._table(session)
            if t is not None:
                t.sync()
                for rid in rids:
                    t.reqs.pop(rid, None)

    def drop(self, session: Session) -> int:
        """Drop the session's table and pending log (an error, detach). Returns how many
        logged calls were dropped unsent."""
        with self.lock:
            t = self._tables.pop(_key(session), None)
            if t is None:
                return 0
            self.drops += 1
            return len(t.pending)

    @contextlib.contextmanager
    def guard(self, session: Session, send: Callable[[Session, list[PendingCall]], Any] | None,
              ride: bool = False) -> Iterator[list[PendingCall]]:
        """Around one call of ``session``: first :meth:`flush` with ``send``; when the body
        (or the flush) raises a ``RadixKVError``, the session's table is dropped. ``send``
        None (a heartbeat): no flush, and only a ``StaleSessionError`` drops the table (a
        transport error must not lose the log of a session that may still live).

        ``ride``: no flush; the pending log is taken out and yielded (``[]`` when empty) for
        the body to send with its call, the manager replaying it first (one message for
        both), and to add to ``replayed_calls`` once the manager applied it. The lock is
        held until the body ends, so the log still leaves in order; a body that raises
        drops the table as a failed flush does."""
        try:
            if not ride:
                if send is not None:
                    self.flush(session, send)
                yield []
                return
            with self.lock:
                t = self._tables.get(_key(session))
                if t is not None and t.pending:
                    calls, t.pending = t.pending, []
                    self.flushes += 1
                    try:  # the body counts the replayed calls (the manager says it applied them)
                        yield calls
                    except BaseException:
                        self.drop(session)
                        raise
                    return
            yield []
        except RadixKVError as e:
            if send is not None or ride or isinstance(e, StaleSessionError):
                n = self.drop(session)
                if n:
                    log.warning("session %s: %d locally answered decode call(s) not replayed (%s)",
                                session[0], n, type(e).__name__)
            raise

    # ------------------------------------------------------------------ the local step
    def try_local(self, session: Session, items: Sequence[DecodeItem]) -> DecodeResult | None:
        """The result of decode call ``items`` when it needs no allocator call (see the module
        doc), with the call logged and the table advanced; None (nothing changed) when it may
        need one, anything is unknown, or ``items`` is not a list/tuple of ``DecodeItem`` with int
        token ids in ``[0, 2**31)`` and distinct str rids (the caller validates and asks again).
        Raises ``InvariantError`` (nothing changed) when a known slot falls outside the mapped
        ``req_to_token``.

        Checks are C-level passes over the items; a repeat of the previous call's rids is answered
        with vector ops, O(B + reserved slots); a new batch costs one loop over its B requests.
        """
        if not self.enabled or type(items) not in (list, tuple) or not items:
            return None
        if set(map(type, items)) != {DecodeItem}:
            return None
        b = len(items)
        rids_t, toks = zip(*items)
        if set(map(type, toks)) != {int} or min(toks) < 0 or max(toks) >= 1 << 31:
            return None  # bools, numpy ints, out of range: validated (and rebuilt) by the caller
        if set(map(type, rids_t)) != {str} and not all(isinstance(r, str) for r in rids_t):
            return None
        if len(set(rids_t)) != b:
            return None
        rids = list(rids_t)
        with self.lock:
            t = self._table(session)
            if t is None:
                return None
            bt = t.batch
            if bt is None or bt.rids != rids:
                t.sync()
                reqs = t.reqs
                ents = list(map(reqs.get, rids))
                if None in ents:
                    return None
                bt = _Batch(rids, cast(list[_Req], ents))
                if bt.min_left < 2:
                    return None  # the batch stays unbuilt: nothing changed
                t.batch = bt
            h = bt.h
            if bt.min_left - h < 2:
                return None
            out = bt.res[:, h].copy()
            pos = bt.seq + h
            if bt.uniform:
                reserved = np.array(bt.res[:, h + 1:]).reshape(-1)  # a copy: never a view of the batch
                lens = np.full(b, bt.res.shape[1] - h - 1, np.int64)
            else:
                lens = bt.left - (h + 1)
                reserved = bt.res[:, h + 1:][np.arange(bt.res.shape[1] - h - 1) < lens[:, None]]
            r2t = self._req_to_token.get(int(session[1]))
            if r2t is not None:
                self._write(r2t, bt.rows, pos, out)
            bt.h = h + 1
            t.pending.append(PendingCall(bt.rids, np.array(toks, np.int32)))
            self.local_calls += 1
            return DecodeResult(out, pos + 1, bt.rows.copy(), bt.mamba.copy(), reserved, lens)

    @staticmethod
    def _write(r2t: torch.Tensor, rows: np.ndarray, pos: np.ndarray, slots: np.ndarray) -> None:
        """``r2t[rows, pos] = slots`` (one scatter), after a bounds check."""
        n_rows, width = r2t.shape
        if int(rows.min()) < 0 or int(rows.max()) >= n_rows or int(pos.max()) >= width:
            bad = np.flatnonzero((rows < 0) | (rows >= n_rows) | (pos >= width))
            raise InvariantError(f"local decode: rows/positions outside req_to_token {tuple(r2t.shape)} at "
                                 f"items {describe_ids(bad)}")
        dev = r2t.device
        r2t[torch.from_numpy(rows).to(dev), torch.from_numpy(pos).to(dev)] = \
            torch.from_numpy(slots.astype(np.int32)).to(dev)

    # ------------------------------------------------------------------ replay
    def pending(self, session: Session | None = None) -> int:
        """Logged calls not yet replayed (of ``session``, or of all sessions)."""
        with self.lock:
            if session is None:
                return sum(len(t.pending) for t in self._tables.values())
            t = self._tables.get(_key(session))
            return len(t.pending) if t is not None else 0

    def flush(self, session: Session, send: Callable[[Session, list[PendingCall]], Any]) -> int:
        """Send the session's pending log with ``send(session, calls)`` (one ApplyDecodes
        RPC) unless it is empty; returns the calls sent. When ``send`` raises, the session's
        table is dropped and the error propagates."""
        with self.lock:
            t = self._tables.get(_key(session))
            if t is None or not t.pending:
                return 0
            calls, t.pending = t.pending, []
            self.flushes += 1
            try:
                send(session, calls)
            except BaseException:
                self.drop(session)
                raise
            self.replayed_calls += len(calls)
            return len(calls)

    def flush_all(self, send: Callable[[Session, list[PendingCall]], Any]) -> int:
        """Flush every session with a pending log (a session-less call that observes the
        whole engine, e.g. stats). Raises the first error (after dropping that table)."""
        with self.lock:
            pending = [t.session for t in self._tables.values() if t.pending]
            return sum(self.flush(s, send) for s in pending)

    def close(self, send: Callable[[Session, list[PendingCall]], Any]) -> None:
        """The client closes: flush every pending log, best effort (a failure is logged;
        its table dropped), then drop every table."""
        with self.lock:
            for session in [t.session for t in self._tables.values() if t.pending]:
                try:
                    self.flush(session, send)
                except Exception as e:  # noqa: BLE001 - closing goes on
                    log.warning("session %s: replaying local decodes at close failed: %s: %s", session[0],
                                type(e).__name__, e)
            self.drops += len(self._tables)
            self._tables.clear()

    # ------------------------------------------------------------------ audit
    def stats(self) -> LocalDecodeStats:
        with self.lock:
            for t in self._tables.values():
                t.sync()
            return LocalDecodeStats(len(self._tables), sum(len(t.reqs) for t in self._tables.values()),
                                    self.pending(), self.local_calls, self.replayed_calls, self.flushes, self.drops)

    def check_invariants(self) -> None:
        """Every table is of the current epoch; per session, every known request has >= 2
        reserved slots, ``seq_len`` >= 1, a row of its own, and no slot is in two reserves;
        every logged call names distinct rids with one int32 token each. Raises
        ``InvariantError`` naming the offenders. O(requests + reserved slots + log)."""
        with self.lock:
            for (sid, epoch), t in self._tables.items():
                t.sync()
                if epoch != self._epoch:
                    raise InvariantError(f"session {sid!r}: a table of epoch {epoch}, current {self._epoch}")
                short = [rid for rid, e in t.reqs.items() if e.left() < 2 or e.seq_len < 1 or e.head < 0]
                if short:
                    raise InvariantError(f"session {sid!r}: requests {short[:16]} kept with < 2 reserved slots "
                                         f"or no tokens")
                rows = np.fromiter((e.row for e in t.reqs.values()), np.int64, len(t.reqs))
                uniq, counts = np.unique(rows, return_counts=True)
                if (counts > 1).any():
                    raise InvariantError(f"session {sid!r}: rows {describe_ids(uniq[counts > 1])} held twice")
                parts = [e.reserve[e.head:] for e in t.reqs.values()]
                slots = np.concatenate(parts) if parts else np.empty(0, np.int64)
                uniq, counts = np.unique(slots, return_counts=True)
                if (counts > 1).any():
                    raise InvariantError(f"session {sid!r}: reserved slots {describe_ids(uniq[counts > 1])} "
                                         f"duplicated")
                for k, c in enumerate(t.pending):
                    if len(set(c.rids)) != len(c.rids) or c.token_ids.dtype != np.int32 \
                            or c.token_ids.shape != (len(c.rids),):
                        raise InvariantError(f"session {sid!r}: logged call {k} is malformed")
