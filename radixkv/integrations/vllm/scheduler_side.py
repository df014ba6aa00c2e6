"""The scheduler half of the connector: match + lock, plan the copies, commit or release.

Per vLLM request, batch calls only: (1) the first ask is one ``alloc_extend`` that matches
and *locks* the cached prefix and allocates rows for the rest (answer kept for re-asks;
capacity or bad input: no hit); (2) ``after_alloc`` plans the accepted tokens' load; (3)
``build_plan`` gives each step's load ops and the save ops of the whole blocks it completes;
(4) ``on_worker_report``: once a prompt's blocks are saved, one ``cache_finished`` inserts
them and drops the lock; (5) ``finished``: a request ending earlier is ``release``d. The
lock holds from the ask to the commit or release, so no eviction can hand its rows away.

Commits and releases go to a :class:`CallQueue` sent in order off vLLM's step, each exactly
once; every call in the caller's thread waits for it first. With a :class:`FirstBlockIndex`,
a miss is answered 0 with no call and saved off the step (vLLM keeps the blocks until then);
no shared row is ever written. Hybrids: a hit only with the manager's state at its end, a
commit only with the state saved; no deferral. Steps: ``docs/vllm.md`` (scheduler side).
"""
from __future__ import annotations

import functools
import itertools
import logging
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from radixkv.engine.protocol import ExtendItem, ExtendResult, Session
from radixkv.errors import CapacityError, InvalidArgumentError, InvariantError
from radixkv.integrations.vllm.call_queue import CallQueue
from radixkv.integrations.vllm.first_blocks import FirstBlockIndex
from radixkv.integrations.vllm.link import ManagerClient, ManagerLink

__all__ = ["CopyOp", "StateOp", "StepPlan", "ScheduledReq", "SchedulerSide"]

logger = logging.getLogger("radixkv.integrations.vllm")


#: A queued ``alloc_extend``'s reply: the result, the error of a prompt the manager cannot take,
#: or None (the call failed: a manager fault, reaped from the queue).
AllocReply = ExtendResult | CapacityError | InvalidArgumentError | None


class CopyOp(NamedTuple):
    """Copy tokens ``[start, end)`` of a request between manager row ``row`` (of the
    manager epoch ``epoch``) and vLLM slots ``slots`` (int64, ``end - start`` entries)."""

    req_id: str
    epoch: int
    row: int
    start: int
    end: int
    slots: np.ndarray


class StateOp(NamedTuple):
    """Copy a hybrid request's recurrent state (every state layer) between manager state slots
    ``slots`` (of epoch ``epoch``; a load reads ``slots[0]``, a save writes each) and vLLM's state
    blocks ``blocks`` (one per state KV cache group, in group order)."""

    req_id: str
    epoch: int
    slots: tuple[int, ...]
    blocks: tuple[int, ...]


class StepPlan(NamedTuple):
    """The step's copies; ``finish``: finished requests whose blocks vLLM kept for a deferred
    save, to be reported finished sending after this step's saves (frees the blocks);
    ``state_loads`` / ``state_saves``: a hybrid model's state copies (before / after the forward)."""

    loads: list[CopyOp]
    saves: list[CopyOp]
    finish: list[str]
    state_loads: Sequence[StateOp] = ()
    state_saves: Sequence[StateOp] = ()


class ScheduledReq(NamedTuple):
    """A request of vLLM's step: tokens with KV before the step, tokens it computes."""

    req_id: str
    num_computed: int
    num_scheduled: int


@dataclass
class _Req:
    mrid: str  # the manager's rid
    n_prompt: int
    session: Session | None = None  # None: not in the manager (no hit, nothing stored)
    row: int = -1
    n_full: int = 0  # prompt tokens in whole blocks (sent to the manager)
    prefix: int = 0  # tokens the manager had (locked)
    hit: int = 0  # tokens offerable to vLLM (prefix capped below the prompt length)
    load: tuple[int, int] | None = None  # (start, end) vLLM accepted, not yet planned
    load_planned: bool = False
    issued: int = 0  # save ops planned for [prefix, issued)
    saved: int = 0  # the worker reported [prefix, saved) saved
    broken: bool = False  # a save failed: release, never commit
    finished: bool = False  # vLLM finished it; waiting for the last save report
    deferred: bool = False  # an index miss: its row comes from ``pending``, its save may outlive it
    pending: Future[AllocReply] | None = None  # the queued alloc_extend, until its reply is taken
    computed: int = 0  # tokens with KV in vLLM after the request's last scheduled step
    kept: list[int] | None = None  # finished; vLLM keeps these blocks until the plan's ``finish``
    state_slot: int = -1  # hybrid: the manager's state slot (the state at ``prefix`` on a hit)
    track: tuple[int, int] = (0, -1)  # hybrid: (track slot, its position) of the alloc
    state_planned: bool = False  # hybrid: the state at n_full is saved in a planned step

    def complete(self) -> bool:
        return not self.broken and self.saved >= self.n_full


def vllm_slots(block_ids: Sequence[int], start: int, end: int, block_size: int) -> np.ndarray:
    """vLLM slot ids of tokens ``[start, end)`` of a request with ``block_ids``."""
    t = np.arange(start, end, dtype=np.int64)
    blocks = np.asarray(block_ids, dtype=np.int64)
    if end > blocks.size * block_size:
        raise InvalidArgumentError(f"tokens up to {end} need {-(-end // block_size)} blocks, "
                                   f"the request has {blocks.size}")
    return blocks[t // block_size] * block_size + t % block_size


def _state_blocks(state_blocks_of: Callable[[str], Sequence[Sequence[int]]] | None, req_id: str,
                  index: int) -> tuple[int, ...]:
    """vLLM's state block ``index`` of ``req_id`` in each state group (the state after
    ``(index + 1) * block_size`` tokens in vLLM's ``mamba_cache_mode="align"``)."""
    if state_blocks_of is None:
        raise InvalidArgumentError("a hybrid plan needs the requests' state blocks")
    groups = state_blocks_of(req_id)
    if index < 0 or any(index >= len(g) for g in groups):
        raise InvalidArgumentError(f"request {req_id!r}: no state block {index} in {[len(g) for g in groups]}")
    return tuple(int(g[index]) for g in groups)


def _alloc_one(client: ManagerClient, session: Session,
               item: ExtendItem) -> ExtendResult | CapacityError | InvalidArgumentError:
    """``alloc_extend`` of one item, from the queue's thread: the result, or the error of a
    prompt the manager cannot take (capacity, context: not a manager fault, so not raised)."""
    try:
        return client.alloc_extend(session, [item])[0]
    except (CapacityError, InvalidArgumentError) as e:
        return e


def _release(client: ManagerClient, session: Session, reqs: list[tuple[str, Future[AllocReply] | None]]) -> None:
    """``release`` of ``reqs`` (mrid, deferred alloc or None), from the queue's thread: a
    deferred alloc queued earlier has its reply by now; one the manager refused holds nothing."""
    mrids = [m for m, fut in reqs if fut is None or not (fut.result() is None or isinstance(fut.result(), Exception))]
    if mrids:
        client.release(session, mrids)


class SchedulerSide:
    """See the module doc. ``link``: the scheduler's :class:`ManagerLink`; ``block_size``:
    vLLM's (== the manager's page size, checked at attach); ``index``: answer index misses
    with no call and save them off the step (see the module doc); ``hybrid``: copy states too."""

    def __init__(self, link: ManagerLink, block_size: int, index: FirstBlockIndex | None = None,
                 hybrid: bool = False):
        if block_size < 1:
            raise InvalidArgumentError(f"block_size must be >= 1, got {block_size}")
        if hybrid and index is not None:
            raise InvalidArgumentError("a hybrid model's saves cannot be deferred (its state blocks move on)")
        self.hybrid = hybrid
        if index is not None and index.page_size != block_size:
            raise InvalidArgumentError(f"index page size {index.page_size} != block size {block_size}")
        self.link = link
        self.bs = block_size
        self.index = index
        self._reqs: dict[str, _Req] = {}
        self._ids = itertools.count()
        self._calls = CallQueue()
        self._finish: list[str] = []  # kept requests planned, not yet handed to vLLM
        self.counters: dict[str, int] = {
            "queries": 0, "query_tokens": 0, "matched_tokens": 0, "offered_tokens": 0,
            "loaded_tokens": 0, "saved_tokens": 0, "committed_requests": 0, "released_requests": 0,
            "uncacheable_requests": 0, "dropped_requests": 0, "index_misses": 0, "index_lost_hits": 0,
            "deferred_saves": 0, "loaded_states": 0, "saved_states": 0, "state_missing_requests": 0,
        }

    # ------------------------------------------------------------------ helpers
    def _session(self) -> Session | None:
        self._reap()
        got = self.link.get()
        return got[1].session if got is not None else None

    def _reap(self) -> None:
        """Fail the link for a queued call that failed on the link's current client."""
        for client, e in self._calls.take_failures():
            got = self.link.get()
            if got is not None and got[0] is client:
                self.link.fail(e)

    def warm(self) -> None:
        """At engine start, not in a request: one ``alloc_extend`` of a one-block prompt in a
        namespace of its own, then its ``release``, so that the first request does not pay the
        first-call set-up of the client and the manager (the first match of a process measured
        13-81 ms against 3-4 ms after). A refused alloc is ignored; a failure fails the link."""
        got = self.link.get()
        if got is None:
            return
        client, info = got
        rid = f"radixkv-warm#{next(self._ids)}"
        try:
            client.alloc_extend(info.session, [ExtendItem(rid, np.zeros(self.bs, np.int32), "radixkv-warm")])
            client.release(info.session, [rid])
        except (CapacityError, InvalidArgumentError):
            pass
        except Exception as e:
            self.link.fail(e)

    def flush(self) -> None:
        """Wait until the queued commits and releases are sent (their failures reaped)."""
        self._calls.wait()
        self._reap()

    # ------------------------------------------------------------------ 1. match + lock
    def num_new_matched_tokens(self, req_id: str, prompt: Sequence[int], num_computed: int,
                               extra_key: str | None, cacheable: bool = True) -> int:
        """Tokens vLLM can load beyond its ``num_computed`` (whole blocks)."""
        st = self._reqs.get(req_id)
        if st is not None:
            if st.session is None or st.load_planned:
                return 0
            return max(0, st.hit - num_computed)
        n = len(prompt)
        st = _Req(mrid=f"{req_id}#{next(self._ids)}", n_prompt=n)
        self._reqs[req_id] = st
        n_full = n // self.bs * self.bs
        if not cacheable or n_full == 0:
            return 0
        # the whole prompt: the manager matches at most n - 1 tokens (so this is vLLM's cap
        # too), and caches only its whole pages; the tail's slot is freed at the commit
        tokens = np.asarray(prompt, dtype=np.int32)
        live = self.link.current()
        if self.index is not None and live is not None \
                and not self.index.may_hold(extra_key, tokens, live[1].session.epoch):
            return self._defer(st, tokens, extra_key, n_full)
        self.flush()  # the client is not shared with the queue's thread; see earlier commits
        got = self.link.get()
        if got is None:
            return 0
        self.counters["queries"] += 1
        self.counters["query_tokens"] += n
        for _ in range(2):  # a second try only on the session of a manager that restarted
            client, info = got
            try:
                res = client.alloc_extend(info.session, [ExtendItem(st.mrid, tokens, extra_key)])[0]
                break
            except (CapacityError, InvalidArgumentError) as e:  # longer than the pool / context: recompute
                self.counters["uncacheable_requests"] += 1
                logger.debug("radixkv: request %s not cached: %s", req_id, e)
                return 0
            except Exception as e:
                if not self.link.fail(e) or (got := self.link.current()) is None:
                    return 0
        else:
            return 0
        prefix = int(res.prefix_len) // self.bs * self.bs
        st.session, st.row, st.n_full, st.prefix = info.session, int(res.req_pool_idx), n_full, prefix
        st.state_slot, st.track = int(res.mamba_slot), (int(res.track_slot), int(res.track_seqlen))
        st.hit = min(prefix, (n - 1) // self.bs * self.bs)
        st.issued = st.saved = prefix
        if self.hybrid and st.state_slot < 1:  # no state slot: never KV without its state
            st.hit, st.broken = 0, True  # nothing offered, nothing saved; released at its end
        self.counters["matched_tokens"] += prefix
        offered = max(0, st.hit - num_computed)
        self.counters["offered_tokens"] += offered
        return offered

    def _defer(self, st: _Req, tokens: np.ndarray, extra_key: str | None, n_full: int) -> int:
        """An index miss: no hit; its ``alloc_extend`` is queued, not awaited."""
        session = self._session()
        got = self.link.get()
        if session is None or got is None:
            return 0
        client = got[0]
        st.session, st.n_full, st.deferred = session, n_full, True
        st.pending = self._calls.submit(client, functools.partial(
            _alloc_one, client, session, ExtendItem(st.mrid, tokens, extra_key)))
        self.counters["queries"] += 1
        self.counters["query_tokens"] += int(tokens.size)
        self.counters["index_misses"] += 1
        return 0

    def _settle(self, st: _Req) -> bool:
        """Take a deferred alloc's reply if it has come; False while it has not. A refused or
        failed alloc leaves nothing at the manager (a failure is reaped: the link fails)."""
        fut = st.pending
        if fut is None:
            return True
        if not fut.done():
            return False
        st.pending = None
        res = fut.result()
        if res is None or isinstance(res, Exception):
            self.counters["uncacheable_requests"] += res is not None
            st.session = None
            return True
        st.row, st.prefix = int(res.req_pool_idx), int(res.prefix_len) // self.bs * self.bs
        st.issued = st.saved = st.prefix  # the manager's prefix is not written again
        self.counters["matched_tokens"] += st.prefix
        self.counters["index_lost_hits"] += st.prefix > 0
        return True

    # ------------------------------------------------------------------ 2. accepted
    def after_alloc(self, req_id: str, num_external: int) -> None:
        st = self._reqs.get(req_id)
        if st is None or num_external <= 0 or st.session is None or st.load_planned:
            return
        if num_external > st.hit:
            raise InvariantError(f"vLLM accepted {num_external} external tokens of {req_id!r}, "
                                 f"only {st.hit} were offered")
        st.load = (st.hit - num_external, st.hit)

    # ------------------------------------------------------------------ 3. plan
    def build_plan(self, scheduled: Iterable[ScheduledReq], block_ids_of: Callable[[str], Sequence[int]],
                   state_blocks_of: Callable[[str], Sequence[Sequence[int]]] | None = None) -> StepPlan:
        """The copies of this step (``block_ids_of(req_id)``: the request's vLLM blocks;
        hybrid: ``state_blocks_of(req_id)``: its state blocks, one list per state group)."""
        self._flush_finished()
        loads: list[CopyOp] = []
        saves: list[CopyOp] = []
        state_loads: list[StateOp] = []
        state_saves: list[StateOp] = []
        current = self._session()
        self._plan_kept(current, saves)
        for sr in scheduled:
            st = self._reqs.get(sr.req_id)
            if st is None or st.session is None:
                continue
            st.computed = sr.num_computed + sr.num_scheduled
            if not self._settle(st) or st.session is None:
                continue  # its row is not known yet: its blocks are saved in a later step
            blocks: Sequence[int] | None = None
            if st.load is not None and not st.load_planned:
                blocks = block_ids_of(sr.req_id)
                s, e = st.load
                loads.append(CopyOp(sr.req_id, st.session.epoch, st.row, s, e, vllm_slots(blocks, s, e, self.bs)))
                st.load_planned = True
                self.counters["loaded_tokens"] += e - s
                if self.hybrid:  # the state after the loaded tokens: its block, and the step's running
                    # block (vLLM copies the one into the other before the forward, before the load)
                    run_at = -(-(sr.num_computed + sr.num_scheduled) // self.bs) - 1
                    for at in sorted({e // self.bs - 1, max(run_at, e // self.bs - 1)}):
                        state_loads.append(StateOp(sr.req_id, st.session.epoch, (st.state_slot,),
                                                   _state_blocks(state_blocks_of, sr.req_id, at)))
                    self.counters["loaded_states"] += 1
            if st.broken or st.session != current:
                continue  # nothing more goes to an old session
            if self.hybrid and not self._plan_state_save(st, sr, state_blocks_of, state_saves):
                continue
            upto = min(st.n_full, (sr.num_computed + sr.num_scheduled) // self.bs * self.bs)
            if upto > st.issued:
                blocks = blocks if blocks is not None else block_ids_of(sr.req_id)
                saves.append(CopyOp(sr.req_id, st.session.epoch, st.row, st.issued, upto,
                                    vllm_slots(blocks, st.issued, upto, self.bs)))
                st.issued = upto
        return StepPlan(loads, saves, self.take_finish(), state_loads, state_saves)

    def _plan_state_save(self, st: _Req, sr: ScheduledReq,
                         state_blocks_of: Callable[[str], Sequence[Sequence[int]]] | None,
                         out: list[StateOp]) -> bool:
        """Plan the save of the state at ``n_full`` when this step ends there (into the track
        slot the manager named for it, and the own slot when the prompt ends there too).
        A step passing ``n_full`` without ending there leaves no state to save: the request
        is released, never committed (returns False)."""
        end = sr.num_computed + sr.num_scheduled
        if st.state_planned or st.n_full <= st.prefix or not sr.num_computed < st.n_full <= end:
            return True
        assert st.session is not None
        slot, at = st.track
        targets = tuple(x for x, ok in ((slot, at == st.n_full and slot > 0),
                                        (st.state_slot, st.n_prompt == st.n_full and st.state_slot > 0)) if ok)
        if end != st.n_full or not targets:
            st.broken = True
            self.counters["state_missing_requests"] += 1
            return False
        out.append(StateOp(sr.req_id, st.session.epoch, targets,
                           _state_blocks(state_blocks_of, sr.req_id, st.n_full // self.bs - 1)))
        st.state_planned = True
        self.counters["saved_states"] += 1
        return True

    def take_finish(self) -> list[str]:
        """The kept requests planned to finish since the last take (``build_plan`` returns
        them; after a failed plan the caller takes them, so kept blocks are always freed)."""
        out, self._finish = self._finish, []
        return out

    def _plan_kept(self, current: Session | None, saves: list[CopyOp]) -> None:
        """Finished requests whose blocks vLLM kept: once the alloc's reply is in, their last
        save (into ``saves``) and their ids (``take_finish``: the worker reports them finished,
        which frees the blocks); they are committed or released with this step's report."""
        for rid, st in self._reqs.items():
            if st.kept is None or st.finished or not self._settle(st):
                continue
            upto = self._kept_upto(st)
            if st.session is not None and st.session == current and not st.broken and upto > st.issued:
                saves.append(CopyOp(rid, st.session.epoch, st.row, st.issued, upto,
                                    vllm_slots(st.kept, st.issued, upto, self.bs)))
                st.issued = upto
                self.counters["deferred_saves"] += 1
            st.finished = True
            self._finish.append(rid)

    # ------------------------------------------------------------------ 4. commit
    def on_worker_report(self, saved: dict[str, int], failed: Iterable[str] = ()) -> None:
        """The worker's report of one step: ``saved[req_id]``: saved up to this token;
        ``failed``: requests whose save could not be done (released, never committed)."""
        for req_id in failed:
            st = self._reqs.get(req_id)
            if st is not None:
                st.broken = True
        for req_id, end in saved.items():
            st = self._reqs.get(req_id)
            if st is not None and st.session is not None:
                st.saved = max(st.saved, min(int(end), st.issued))
        current = self._session()
        commit = [(rid, st) for rid, st in self._reqs.items() if st.session is not None and st.complete()
                  and st.session == current]
        got = self.link.get()
        if commit and current is not None and got is not None:
            client = got[0]
            self._calls.submit(client, functools.partial(client.cache_finished, current,
                                                         [st.mrid for _, st in commit]))
            for rid, st in commit:
                self.counters["saved_tokens"] += st.n_full - st.prefix
                self.counters["committed_requests"] += 1
                st.session = None  # queued: the manager forgets it when the call is sent
                if st.finished:
                    del self._reqs[rid]
        self._flush_finished()

    # ------------------------------------------------------------------ 5. end
    def finished(self, req_id: str, block_ids: Sequence[int] | None = None) -> bool:
        """vLLM finished (or aborted) the request: forget it now, or after the report of
        the save still in flight for it (committed or released then). True: a deferred save
        is not done yet, vLLM must keep its blocks ``block_ids`` (see ``build_plan``'s ``finish``)."""
        st = self._reqs.get(req_id)
        if st is None:
            return False
        self._settle(st)
        if (block_ids is not None and st.deferred and st.session is not None and not st.broken
                and (st.pending is not None or st.issued < self._kept_upto(st, len(block_ids)))):
            st.kept = [int(b) for b in block_ids]
            return True
        if st.session is not None and not st.broken and st.issued >= st.n_full > st.saved:
            st.finished = True  # the step that saved its last blocks reports right after
            return False
        del self._reqs[req_id]
        self._drop([st])
        return False

    def _kept_upto(self, st: _Req, n_blocks: int | None = None) -> int:
        """The end of a finished request's savable tokens: whole prompt blocks vLLM computed
        and still holds (``n_blocks``: its kept blocks)."""
        n_blocks = len(st.kept or ()) if n_blocks is None else n_blocks
        return min(st.n_full, st.computed // self.bs * self.bs, n_blocks * self.bs)

    def _flush_finished(self) -> None:
        done = [rid for rid, st in self._reqs.items() if st.finished]
        states = [self._reqs.pop(rid) for rid in done]
        self._drop(states)

    def _drop(self, states: list[_Req]) -> None:
        """Release, in one call, the manager requests of ``states`` (current session only;
        an old session's were reclaimed with it)."""
        live = [st for st in states if st.session is not None]
        if not live:
            return
        current = self._session()
        mine = [(st.mrid, st.pending) for st in live if st.session == current]
        self.counters["dropped_requests"] += len(live) - len(mine)
        if mine and current is not None:
            got = self.link.get()
            if got is not None:
                client = got[0]
                self._calls.submit(client, functools.partial(_release, client, current, mine))
                self.counters["released_requests"] += len(mine)
        for st in live:
            st.session = None

    # ------------------------------------------------------------------ audit
    @property
    def pending(self) -> int:
        """Requests this side still tracks."""
        return len(self._reqs)

    def check_invariants(self) -> None:
        """Every tracked request's ranges are ordered: ``hit <= prefix <= saved <= issued
        <= n_full`` (raises ``InvariantError`` listing the bad request ids)."""
        bad = [rid for rid, st in self._reqs.items() if st.session is not None and not (
            0 <= st.hit <= st.prefix <= st.saved <= st.issued <= st.n_full <= st.n_prompt
            and st.prefix % self.bs == 0 and st.n_full % self.bs == 0)]
        if bad:
            raise InvariantError(f"radixkv connector: inconsistent request states {sorted(bad)}")

    def close(self) -> None:
        self._drop(list(self._reqs.values()))
        self._reqs.clear()
        self._calls.close()  # the queued calls are sent before the session is detached
        self._reap()
        self.link.close()
