"""Client-local decode steps (``radixkv.service.client.local_decode``) against decode reserves.

Unit part (no server): the table answers exactly what the embedded engine answers whenever
it answers at all, logs the call, writes the mapped ``req_to_token``, drops itself on a
failed flush or an epoch change, and its ``check_invariants`` finds corruption.

Integration part: one spawned ``radixkv serve --decode-reserve 4`` (Unix socket in a temp
dir) and one embedded ``CacheEngine`` with the same config; every call of this module is
made on both (so their states stay identical from test to test). A seeded random scheduler
drives them call for call and asserts equal results (slots, lengths, rows, reserves,
cached lengths, stats, errors), that a decode call whose requests all hold >= 2 reserved
slots sends no RPC, that the next other call of the session replays the log first (one
``ApplyDecodes``), that the worker's mapped ``req_to_token`` rows match the embedded
engine's right after a local decode, and the invariants at idle on both.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from engine_fixtures import comparable
from radixkv.service.client.local_decode import LocalDecodes, PendingCall, replay_request
from radixkv.service.wire import codec as wire
from radixkv.service.wire._gen import cache_manager_pb2 as pb

from radixkv.engine import CacheEngine, EngineConfig
from radixkv.engine.protocol import DecodeItem, DecodeResult, ExtendItem, ExtendResult, MatchQuery, Session
from radixkv.errors import InvariantError, LengthMismatchError, NotFoundError, RadixKVError, StaleSessionError

CONFIG = dict(device="cpu", kv_tokens=384, page_size=1, request_rows=12, max_context_len=80,
              max_requests_per_session=6, lease_ttl_s=600.0, decode_reserve=4)
S1 = Session("s1", 7, 600.0)


_norm = comparable


def toks(rng, n):
    return rng.integers(1, 50, n).astype(np.int32)


# ----------------------------------------------------------------------------- wire


def test_wire_carries_reserves():
    res = [ExtendResult("a", 3, 2, 2, 5, np.array([7, 8, 9], np.int64), -1, np.array([11, 12], np.int64)),
           ExtendResult("b", 4, 0, 0, 1, np.array([1], np.int64), 2)]
    back = wire.extend_results_from_msg(wire.extend_results_to_msg(res), ["a", "b"])
    assert _norm(back) == _norm(res)
    r = DecodeResult(*(np.array([i, i + 1], np.int64) for i in range(4)), np.array([5, 6, 7], np.int64),
                     np.array([1, 2], np.int64))
    assert _norm(wire.decode_result_from_msg(wire.decode_result_to_msg(r), 2)) == _norm(r)
    for lens in ([1, 1], [3], [4, -1]):  # do not add up / wrong count / negative
        bad = wire.decode_result_to_msg(r._replace(reserved_lens=np.array(lens, np.int64)))
        with pytest.raises(LengthMismatchError):
            wire.decode_result_from_msg(bad, 2)


def test_replay_request_round_trips():
    calls = [PendingCall(["a", "b"], np.array([5, 2**31 - 1], np.int32)), PendingCall(["a"], np.array([0], np.int32))]
    msg = pb.ApplyDecodesRequest.FromString(replay_request(S1, calls).SerializeToString())
    assert (msg.session.session_id, msg.session.epoch) == ("s1", 7)
    rids, lens, idx, toks = wire.apply_decodes_from_msg(msg)
    assert (rids, lens.tolist(), idx.tolist(), toks.tolist()) == (["a", "b"], [2, 1], [0, 1, 0], [5, 2**31 - 1, 0])


def test_serve_flag_and_config_file_key(tmp_path):
    import argparse

    from radixkv.service.server.cli import add_serve_arguments, engine_config_from_args

    from radixkv.errors import InvalidArgumentError

    p = add_serve_arguments(argparse.ArgumentParser())
    assert engine_config_from_args(p.parse_args(["--decode-reserve", "8"])).decode_reserve == 8
    f = tmp_path / "engine.json"
    f.write_text('{"decode_reserve": 5}')
    assert engine_config_from_args(p.parse_args(["--config", str(f)])).decode_reserve == 5
    assert engine_config_from_args(p.parse_args(["--config", str(f), "--decode-reserve", "3"])).decode_reserve == 3
    with pytest.raises(InvalidArgumentError, match="page_size"):
        engine_config_from_args(p.parse_args(["--decode-reserve", "2", "--page-size", "4", "--kv-tokens", "64"]))


# ----------------------------------------------------------------------------- the table alone


def _start(t, e, s, rng, rid, max_len, live):
    """One new request ``rid`` of 1..max_len tokens on engine and table (kept in ``live``
    unless the engine refuses it)."""
    try:
        t.observe_extend(s, e.alloc_extend(s, [ExtendItem(rid, toks(rng, int(rng.integers(1, max_len))))]))
        live.append(rid)
    except RadixKVError:
        pass


def _finish(t, e, s, live, i):
    """``live[i]`` finishes on engine and table."""
    rid = live.pop(i)
    e.cache_finished(s, [rid])
    t.forget(s, [rid])


def _decode_both(t, e, s, rids, items, local_items, live):
    """The table's answer to ``local_items`` and the engine's to ``items`` (the same call):
    equal when the table answered; a call the engine refuses ends its requests. Returns
    the table's answer, or None."""
    mine = t.try_local(s, local_items)
    try:
        got = e.alloc_decode(s, items)
    except RadixKVError:
        assert mine is None, "answered a call the engine refuses"
        for r in list(rids):
            live.remove(r)
            e.release(s, [r])
            t.forget(s, [r])
        return None
    if mine is None:
        t.observe_decode(s, rids, got)
    else:
        assert _norm(mine) == _norm(got), (mine, got)
    return mine


@pytest.mark.parametrize("hybrid", [False, True])
def test_table_answers_exactly_what_the_engine_answers(hybrid):
    """Seeded: the engine decides; the table, fed only the engine's replies, answers every
    call it can and each answer equals the engine's, field for field (hybrid: the state
    slot included)."""
    rng = np.random.default_rng(5)
    cfg = dict(CONFIG, layer_types="FK", state_slots=16) if hybrid else CONFIG
    e = CacheEngine(EngineConfig(**cfg))
    s = e.attach("w").session
    t = LocalDecodes()
    live, answered, n = [], 0, 0
    for _ in range(300):
        if len(live) < 3 or rng.random() < 0.1:
            n += 1
            _start(t, e, s, rng, f"r{n}", 30, live)
            continue
        if rng.random() < 0.1:
            _finish(t, e, s, live, int(rng.integers(len(live))))
            continue
        rids = list(rng.choice(live, size=int(rng.integers(1, len(live) + 1)), replace=False))
        items = [DecodeItem(r, int(rng.integers(0, 50))) for r in rids]
        if _decode_both(t, e, s, rids, items, items, live) is not None:
            answered += 1
        t.check_invariants()
    assert answered > 50, answered
    assert t.pending(s) == answered == t.stats().local_calls


@pytest.mark.parametrize("reserve", [4, 7])
def test_repeated_batches_answer_what_the_engine_answers(reserve):
    """A scheduler's shape: the same batch decoded step after step (the table's array fast
    path), now and then reordered, shrunk or joined by a new request, interleaved with
    finishes. Every answer equals the engine's, a returned array never aliases the table
    (scribbling on it changes no later answer), and the invariants hold throughout."""
    rng = np.random.default_rng(11)
    e = CacheEngine(EngineConfig(**dict(CONFIG, decode_reserve=reserve)))
    s = e.attach("w").session
    t = LocalDecodes()
    live: list[str] = []
    answered = n = 0
    for step in range(400):
        if len(live) < 2 or rng.random() < 0.08:
            n += 1
            _start(t, e, s, rng, f"r{n}", 12, live)
            continue
        if rng.random() < 0.05:
            _finish(t, e, s, live, 0)
            continue
        if rng.random() < 0.1:
            rng.shuffle(live)
        batch = live if rng.random() < 0.9 else live[:-1]
        items = [DecodeItem(r, int(rng.integers(0, 50))) for r in batch]
        mine = _decode_both(t, e, s, batch, items, tuple(items) if step % 2 else items, live)
        if mine is not None:
            answered += 1
            for a in mine[:6]:  # the caller owns what it got (track_slots: a shared empty array)
                a[...] = -7
        t.check_invariants()
    assert answered > 100, answered
    assert t.pending(s) == answered == t.stats().local_calls


def test_a_declined_call_changes_nothing():
    t = LocalDecodes()
    t.observe_extend(S1, [ExtendResult("a", 1, 0, 0, 3, np.zeros(3, np.int64), -1, np.array([4, 5, 6], np.int64)),
                          ExtendResult("b", 2, 0, 0, 2, np.zeros(2, np.int64), -1, np.array([7, 8, 9], np.int64))])
    good = [DecodeItem("a", 1), DecodeItem("b", 2)]
    for bad in ([DecodeItem("a", True), DecodeItem("b", 2)], [DecodeItem("a", np.int64(1)), DecodeItem("b", 2)],
                [DecodeItem("a", -1), DecodeItem("b", 2)], [DecodeItem("a", 1 << 31), DecodeItem("b", 2)],
                [("a", 1), DecodeItem("b", 2)], [DecodeItem(b"a", 1), DecodeItem("b", 2)],
                [DecodeItem("a", 1), DecodeItem("a", 2)], [DecodeItem("a", 1), DecodeItem("zz", 2)]):
        assert t.try_local(S1, bad) is None
        assert t.pending(S1) == 0
    first = t.try_local(S1, good)
    assert first is not None and first.out_cache_loc.tolist() == [4, 7]
    assert t.try_local(S1, [DecodeItem("a", True), DecodeItem("b", 2)]) is None  # the batch is kept as it was
    second = t.try_local(S1, good)
    assert second.out_cache_loc.tolist() == [5, 8] and second.seq_lens.tolist() == [5, 4]
    assert second.reserved.tolist() == [6, 9] and second.reserved_lens.tolist() == [1, 1]
    assert t.try_local(S1, good) is None  # one slot each left: the manager answers
    assert t.stats().requests == 0 and t.pending(S1) == 2  # both left the table with the batch
    t.check_invariants()


def test_replay_shares_the_index_of_a_repeated_batch():
    rids = ["a", "b", "c"]
    calls = [PendingCall(rids, np.array([1, 2, 3], np.int32)), PendingCall(rids, np.array([4, 5, 6], np.int32)),
             PendingCall(["c", "d"], np.array([7, 8], np.int32)), PendingCall(rids, np.array([9, 9, 9], np.int32))]
    copies = [PendingCall(list(c.rids), c.token_ids) for c in calls]
    assert replay_request(S1, calls).SerializeToString() == replay_request(S1, copies).SerializeToString()
    got = wire.apply_decodes_from_msg(replay_request(S1, calls))
    assert got[0] == ["a", "b", "c", "d"] and got[2].tolist() == [0, 1, 2, 0, 1, 2, 2, 3, 0, 1, 2]


def test_table_declines_what_it_cannot_know():
    t = LocalDecodes()
    t.observe_extend(S1, [ExtendResult("a", 1, 0, 0, 3, np.array([1, 2, 3], np.int64), -1, np.array([4, 5], np.int64)),
                          ExtendResult("b", 2, 0, 0, 1, np.array([6], np.int64), -1, np.array([7], np.int64))])
    assert t.try_local(S1, []) is None
    assert t.try_local(S1, [DecodeItem("b", 1)]) is None  # 1 reserved slot: the manager may top up
    assert t.try_local(S1, [DecodeItem("zz", 1)]) is None
    assert t.try_local(S1, [DecodeItem("a", 1), DecodeItem("a", 2)]) is None
    assert t.try_local(Session("other", 7, 1.0), [DecodeItem("a", 1)]) is None
    assert t.pending(S1) == 0
    r = t.try_local(S1, [DecodeItem("a", 9)])
    assert _norm(r) == _norm(DecodeResult(*(np.array([v], np.int64) for v in (4, 4, 1, -1)), np.array([5], np.int64),
                                          np.array([1], np.int64)))
    assert t.try_local(S1, [DecodeItem("a", 9)]) is None  # one slot left now
    off = LocalDecodes(enabled=False)
    off.observe_extend(S1, [ExtendResult("a", 1, 0, 0, 3, np.zeros(3, np.int64), -1, np.array([4, 5, 6], np.int64))])
    assert off.try_local(S1, [DecodeItem("a", 1)]) is None and off.stats().requests == 0


def test_flush_sends_the_log_in_order_and_a_failure_drops_the_table():
    t = LocalDecodes()
    t.observe_extend(S1, [ExtendResult("a", 1, 0, 0, 3, np.zeros(3, np.int64), -1, np.array([4, 5, 6, 7], np.int64))])
    for tok in (11, 12):
        assert t.try_local(S1, [DecodeItem("a", tok)]) is not None
    sent = []
    assert t.flush(S1, lambda s, calls: sent.append((s, calls))) == 2
    assert [(c.rids, c.token_ids.tolist()) for c in sent[0][1]] == [(["a"], [11]), (["a"], [12])]
    assert t.flush(S1, lambda s, calls: sent.append(calls)) == 0 and len(sent) == 1  # nothing pending: no RPC
    t.observe_extend(S1, [ExtendResult("b", 2, 0, 0, 3, np.zeros(3, np.int64), -1, np.array([8, 9, 10], np.int64))])
    assert t.try_local(S1, [DecodeItem("b", 1)]) is not None

    def fail(s, calls):
        raise StaleSessionError("gone")

    with pytest.raises(StaleSessionError):
        with t.guard(S1, fail):
            raise AssertionError("the call must not run after a failed flush")
    assert t.stats().sessions == 0 and t.try_local(S1, [DecodeItem("b", 1)]) is None
    # a heartbeat's transport error keeps the table (and its log); a stale session drops it
    t.observe_extend(S1, [ExtendResult("c", 3, 0, 0, 3, np.zeros(3, np.int64), -1, np.array([1, 2, 3], np.int64))])
    t.try_local(S1, [DecodeItem("c", 1)])
    with pytest.raises(NotFoundError):
        with t.guard(S1, None):
            raise NotFoundError("transient")
    assert t.pending(S1) == 1
    with pytest.raises(StaleSessionError):
        with t.guard(S1, None):
            raise StaleSessionError("gone")
    assert t.pending(S1) == 0


def test_epoch_change_drops_every_table():
    t = LocalDecodes()
    t.observe_extend(S1, [ExtendResult("a", 1, 0, 0, 3, np.zeros(3, np.int64), -1, np.array([4, 5, 6], np.int64))])
    t.try_local(S1, [DecodeItem("a", 1)])
    assert t.try_local(Session("s1", 8, 1.0), [DecodeItem("a", 1)]) is None  # a stale/unknown epoch: no change
    assert t.pending(S1) == 1 and t.stats().drops == 0
    s2 = Session("s2", 8, 1.0)  # a reply from a restarted manager
    t.observe_extend(s2, [ExtendResult("a", 1, 0, 0, 3, np.zeros(3, np.int64), -1, np.array([4, 5], np.int64))])
    assert t.stats().sessions == 1 and t.pending() == 0 and t.stats().drops == 1
    assert t.try_local(S1, [DecodeItem("a", 1)]) is None and t.try_local(s2, [DecodeItem("a", 1)]) is not None


def test_local_decode_writes_the_mapped_row_or_nothing():
    t = LocalDecodes()
    r2t = torch.zeros((4, 8), dtype=torch.int32)
    t.map_req_to_token(7, r2t)
    t.observe_extend(S1, [ExtendResult("a", 2, 0, 0, 3, np.zeros(3, np.int64), -1, np.array([40, 41, 42], np.int64)),
                          ExtendResult("b", 3, 0, 0, 6, np.zeros(6, np.int64), -1, np.array([50, 51], np.int64))])
    t.try_local(S1, [DecodeItem("a", 1), DecodeItem("b", 1)])
    assert r2t[2, 3].item() == 40 and r2t[3, 6].item() == 50 and int(r2t.count_nonzero()) == 2
    # a position outside the table: InvariantError, nothing written or logged
    t.observe_extend(S1, [ExtendResult("c", 1, 0, 0, 8, np.zeros(8, np.int64), -1, np.array([60, 61], np.int64))])
    before = t.stats()
    with pytest.raises(InvariantError, match="items"):
        t.try_local(S1, [DecodeItem("a", 1), DecodeItem("c", 1)])
    assert t.stats() == before and int(r2t.count_nonzero()) == 2


def test_local_decode_refuses_a_negative_position_from_the_manager():
    """Issue 34, item 7: a seq_len < 0 in a manager's reply (altered or buggy) would make the
    position negative, which torch wraps to the row's end: refused, nothing written."""
    t = LocalDecodes()
    r2t = torch.zeros((4, 8), dtype=torch.int32)
    t.map_req_to_token(7, r2t)
    t.observe_extend(S1, [ExtendResult("n", 2, 0, 0, -3, np.zeros(0, np.int64), -1, np.array([70, 71], np.int64))])
    before = t.stats()
    with pytest.raises(InvariantError, match="items"):
        t.try_local(S1, [DecodeItem("n", 1)])
    assert t.stats() == before and int(r2t.count_nonzero()) == 0


def test_check_invariants_names_corruption():
    t = LocalDecodes()
    t.observe_extend(S1, [ExtendResult("a", 1, 0, 0, 3, np.zeros(3, np.int64), -1, np.array([4, 5, 6], np.int64)),
                          ExtendResult("b", 2, 0, 0, 3, np.zeros(3, np.int64), -1, np.array([7, 8], np.int64))])
    t.check_invariants()
    t._tables[("s1", 7)].reqs["b"].reserve[1] = 5  # slot 5 now in two reserves
    with pytest.raises(InvariantError, match=r"\[5\]"):
        t.check_invariants()
    t._tables[("s1", 7)].reqs["b"].reserve[1] = 9
    t._tables[("s1", 7)].reqs["b"].row = 1  # row 1 held twice
    with pytest.raises(InvariantError, match=r"rows \[1\]"):
        t.check_invariants()


# ----------------------------------------------------------------------------- against a manager


class Pair:
    """A spawned manager and an embedded engine with the same config, called alike."""

    def __init__(self):
        from service_util import start_server

        flags = sum(([f"--{k.replace('_', '-')}", str(v)] for k, v in CONFIG.items()), [])
        self.srv = start_server(flags + ["--sweep-interval-s", "0.5"])
        self.emb = CacheEngine(EngineConfig(**CONFIG))

    def client(self, **kw):
        from radixkv.service.client import connect

        return connect(self.srv.address, token=self.srv.token, wait_s=60, timeout_s=60, **kw)


@pytest.fixture(scope="module")
def pair():
    from service_util import stop_server

    p = Pair()
    yield p
    assert stop_server(p.srv) == 0
    assert not p.srv.shm_files()


#: The client methods whose pending replay rides on their Step message.
RIDING = ("match", "alloc_extend", "alloc_decode", "cache_unfinished", "cache_finished", "release", "evict")


class Driver:
    """Both engines, sessions on each, and a model of every request's reserve (from the
    embedded replies) that predicts which decode calls the client answers locally."""

    def __init__(self, pair, client, n_sessions=2):
        self.emb, self.c = pair.emb, client
        self.s = []
        for i in range(n_sessions):
            info = client.attach(f"w{i}")
            self.s.append((pair.emb.attach(f"w{i}").session, info.session))
        self.r2t_remote = client.worker_buffers(info).req_to_token  # every session's rows (one table)
        self.r2t_emb = pair.emb.pools.req_to_token_pool.req_to_token
        self.known = [{} for _ in self.s]  # rid -> reserve length, per session
        self.live = [[] for _ in self.s]
        self.local_decodes = self.rpc_decodes = self.ridden = 0

    def rpcs(self):
        return sum(self.c.rpc_counts.values())

    def both(self, method, si, *args, local=False):
        """``local``: the client should answer the call itself (else it replays first)."""
        out = []
        pending = self.c.local.pending(self.s[si][1])
        applied, flushes = self.c.rpc_counts.get("ApplyDecodes", 0), self.c.local.flushes
        ride = self.c.steps is not None and self.c.steps.rides_replay and method in RIDING
        for k, engine in enumerate((self.emb, self.c)):
            try:
                out.append(("ok", getattr(engine, method)(self.s[si][k], *args)))
            except RadixKVError as e:
                out.append(("err", type(e).__name__))
        assert _norm(out[0]) == _norm(out[1]), f"{method}: embedded {out[0]} != remote {out[1]}"
        # a call not answered locally replays the local decodes before it: one replay, riding
        # on the call's Step message when the stream's manager runs them, else its own RPC
        replays = 1 if pending and not local else 0
        assert self.c.local.flushes == flushes + replays
        assert self.c.rpc_counts.get("ApplyDecodes", 0) == applied + (0 if ride else replays)
        self.ridden += replays if ride else 0
        if out[0][0] == "err":
            self.known[si].clear()  # the client drops the session's table on an error
        return out[0]

    def extend(self, si, rid, tokens):
        kind, res = self.both("alloc_extend", si, [ExtendItem(rid, tokens)])
        if kind == "ok":
            self.known[si][rid] = res[0].reserved.size
            if rid not in self.live[si]:
                self.live[si].append(rid)

    def decode(self, si, rids, rng):
        items = [DecodeItem(r, int(rng.integers(0, 50))) for r in rids]
        local = self.c.local.enabled and all(self.known[si].get(r, 0) >= 2 for r in rids)
        n0 = self.rpcs()
        kind, res = self.both("alloc_decode", si, items, local=local)
        assert (self.rpcs() == n0) == local, (rids, self.known[si], self.c.rpc_counts)
        self.local_decodes += local
        self.rpc_decodes += not local
        if kind == "ok":
            for rid, n in zip(rids, res.reserved_lens.tolist()):
                self.known[si][rid] = n
            rows, seq = res.req_pool_indices.tolist(), res.seq_lens.tolist()
            for row, n in zip(rows, seq):  # the worker sees the row already (its mapped table)
                assert self.r2t_remote[row, :n].tolist() == self.r2t_emb[row, :n].tolist()

    def finish(self, si, rid, how):
        if self.both(how, si, [rid])[0] == "ok" and how != "cache_unfinished":
            self.live[si].remove(rid)
            self.known[si].pop(rid, None)

    def stats(self, si=None):
        if si is None:
            assert self.emb.stats() == self.c.stats()
        else:
            self.both("stats", si)

    def idle(self):
        """Finish everything; equal stats, the conservation law and invariants on both."""
        for si in range(len(self.s)):
            for rid in list(self.live[si]):
                self.finish(si, rid, "cache_finished")
        self.stats()
        st = self.emb.stats()
        assert st.kv_held == 0 and st.kv_available + st.kv_evictable + st.kv_protected == st.kv_capacity
        self.emb.check_invariants()
        self.c.check_invariants()
        self.c.local.check_invariants()

    def close(self):
        for e_s, r_s in self.s:
            self.emb.detach(e_s)
            self.c.detach(r_s)
        assert self.emb.stats() == self.c.stats()
        self.c.close()


def run_scheduler(pair, seed, steps, **client_kw):
    rng = np.random.default_rng(seed)
    prefixes = [toks(np.random.default_rng(100 + i), 12) for i in range(3)]
    d = Driver(pair, pair.client(**client_kw))
    n = 0
    for _ in range(steps):
        si = int(rng.integers(len(d.s)))
        live, op = d.live[si], rng.random()
        if not live or op < 0.15:
            n += 1
            prompt = np.concatenate([prefixes[int(rng.integers(3))], toks(rng, int(rng.integers(1, 24)))])
            d.extend(si, f"s{seed}-{n}", prompt)
        elif op < 0.2:
            d.extend(si, live[int(rng.integers(len(live)))], toks(rng, int(rng.integers(1, 6))))
        elif op < 0.6:  # a run of decode steps over one batch
            rids = list(rng.choice(live, size=int(rng.integers(1, len(live) + 1)), replace=False))
            for _ in range(int(rng.integers(1, 6))):
                d.decode(si, rids, rng)
        elif op < 0.75:
            d.finish(si, live[int(rng.integers(len(live)))],
                     ["cache_unfinished", "cache_finished", "release"][int(rng.integers(3))])
        elif op < 0.8:
            d.stats(si if rng.random() < 0.5 else None)
        elif op < 0.85:
            d.both("evict", si, int(rng.integers(0, 64)))
        elif op < 0.9:
            d.both("match", si, [MatchQuery(np.concatenate([prefixes[int(rng.integers(3))], toks(rng, 3)]))])
        else:
            d.both("cache_unfinished", si, list(live))
    d.idle()
    counts = dict(d.c.rpc_counts)
    stats = d.c.local.stats()
    d.close()
    return d, counts, stats


@pytest.mark.parametrize("step_stream", [True, False], ids=["stream", "unary"])
def test_lockstep_with_local_decode(pair, step_stream):
    d, counts, st = run_scheduler(pair, 11, 260, step_stream=step_stream)
    assert d.local_decodes > 40 and d.rpc_decodes > 10, (d.local_decodes, d.rpc_decodes)
    assert st.local_calls == d.local_decodes and st.replayed_calls == d.local_decodes
    assert counts.get("AllocDecode", 0) == d.rpc_decodes and st.flushes <= d.local_decodes
    assert counts.get("ApplyDecodes", 0) == st.flushes - d.ridden
    assert (d.ridden > 10) == step_stream, d.ridden  # over the stream most replays ride on a call


def test_lockstep_without_local_decode(pair):
    d, counts, st = run_scheduler(pair, 12, 160, local_decode=False)
    assert d.local_decodes == 0 and st.local_calls == 0 and "ApplyDecodes" not in counts
    assert counts["AllocDecode"] == d.rpc_decodes > 40


def test_flush_error_surfaces_when_the_session_was_reclaimed(pair):
    rng = np.random.default_rng(3)
    d = Driver(pair, pair.client(), n_sessions=1)
    d.both("evict", 0, CONFIG["kv_tokens"])  # room for reserves (they never evict)
    d.extend(0, "x1", toks(rng, 10))
    assert d.known[0]["x1"] == CONFIG["decode_reserve"]
    d.decode(0, ["x1"], rng)
    assert d.c.local.pending(d.s[0][1]) == 1
    admin = pair.client()
    admin.detach(d.s[0][1])  # another client ends the session meanwhile
    pair.emb.detach(d.s[0][0])
    with pytest.raises(StaleSessionError, match="ApplyDecodes call 0"):
        d.c.cache_finished(d.s[0][1], ["x1"])
    assert d.c.local.pending() == 0 and d.c.local.stats().sessions == 0
    with pytest.raises(StaleSessionError):
        pair.emb.cache_finished(d.s[0][0], ["x1"])
    assert pair.emb.stats() == d.c.stats()
    pair.emb.check_invariants()
    d.c.check_invariants()
    admin.close()
    d.c.close()


def test_apply_decodes_error_names_the_call_and_keeps_the_calls_before(pair):
    rng = np.random.default_rng(4)
    d = Driver(pair, pair.client(local_decode=False), n_sessions=1)
    d.extend(0, "y1", toks(rng, 6))
    (e_s, r_s) = d.s[0]
    calls = [PendingCall(["y1"], np.array([3], np.int32)), PendingCall(["nobody"], np.array([3], np.int32))]
    with pytest.raises(NotFoundError, match="ApplyDecodes call 1 of 2"):
        d.c._apply(r_s, calls)
    pair.emb.alloc_decode(e_s, [DecodeItem("y1", 3)])  # call 0 stays applied
    # the failure after an applied call is a reply, kept by the reply cache: a retry with
    # the same request id gets it again and does not apply call 0 a second time
    req = replay_request(r_s, calls)
    first = d.c._call("ApplyDecodes", req, request_id="retry-1")
    again = d.c._call("ApplyDecodes", req, request_id="retry-1")
    assert first.applied == again.applied == 1 and first.error.code == again.error.code != 0
    assert "ApplyDecodes call 1 of 2" in again.error.details
    pair.emb.alloc_decode(e_s, [DecodeItem("y1", 3)])  # once, as the manager did
    empty = pb.ApplyDecodesRequest(session=wire.session_to_msg(r_s))
    assert d.c._call("ApplyDecodes", empty).applied == 0
    broken = replay_request(r_s, [PendingCall(["y1"], np.array([1], np.int32))])
    broken.rid_index_i32 = wire.pack([1], wire.I32)  # names a rid the request does not carry
    with pytest.raises(RadixKVError, match="rid_index"):  # refused whole: nothing applied
        d.c._call("ApplyDecodes", broken)
    d.decode(0, ["y1"], rng)  # both agree on where y1 stands
    d.idle()
    d.close()


@pytest.mark.parametrize("step_stream", [True, False], ids=["stream", "unary"])
def test_a_replay_riding_on_a_call_runs_first_and_a_failed_one_stops_the_call(pair, step_stream):
    from radixkv.service.client.step_lane import Replay

    rng = np.random.default_rng(5)
    d = Driver(pair, pair.client(local_decode=False, step_stream=step_stream), n_sessions=1)
    d.extend(0, "z1", toks(rng, 6))  # over the stream, the manager's answer says it runs replays
    assert (d.c.steps is not None and d.c.steps.rides_replay) == step_stream
    (e_s, r_s) = d.s[0]
    bad = Replay(replay_request(r_s, [PendingCall(["z1"], np.array([3], np.int32)),
                                      PendingCall(["nobody"], np.array([3], np.int32))]), "ride-1")
    req = pb.CacheRequest(session=wire.session_to_msg(r_s), rids=["z1"])
    sent = dict(d.c.rpc_counts)
    with pytest.raises(NotFoundError, match="ApplyDecodes call 1 of 2"):
        d.c._call("CacheFinished", req, replay=bad)
    assert not bad.applied  # the replay stopped at call 1: the call did not run
    # riding over the stream: no ApplyDecodes RPC; unary: the replay went first on its own
    assert d.c.rpc_counts.get("ApplyDecodes", 0) - sent.get("ApplyDecodes", 0) == (0 if step_stream else 1)
    pair.emb.alloc_decode(e_s, [DecodeItem("z1", 3)])  # call 0 stays applied, once
    # the same replay sent again (a broken stream's fallback) gets the kept reply: call 0 not twice
    with pytest.raises(NotFoundError, match="ApplyDecodes call 1 of 2"):
        d.c._call("CacheFinished", req, replay=bad)
    good = Replay(replay_request(r_s, [PendingCall(["z1"], np.array([4], np.int32))]), "ride-2")
    res = d.c._call("CacheUnfinished", req, replay=good)
    assert good.applied and len(res.cached_len_i64) == 8
    pair.emb.alloc_decode(e_s, [DecodeItem("z1", 4)])
    assert pair.emb.cache_unfinished(e_s, ["z1"]) == wire.cache_results_from_msg(res, ["z1"])
    again = Replay(good.request, "ride-2")  # a retry of that replay: answered, not applied twice
    d.c._call("Release", pb.ReleaseRequest(session=wire.session_to_msg(r_s), rids=["z1"]), replay=again)
    assert again.applied
    pair.emb.release(e_s, ["z1"])
    d.live[0].remove("z1")
    d.known[0].pop("z1", None)
    d.idle()
    d.close()
