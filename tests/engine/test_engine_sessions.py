"""SessionTable: a Hypothesis state machine against a plain model (fake clock), plus the
error messages and limits."""
import pytest
from engine_fixtures import ManualClock
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from radixkv.engine.protocol import Session
from radixkv.engine.sessions import SessionTable
from radixkv.errors import (
    CapacityError,
    InvalidArgumentError,
    InvariantError,
    NotFoundError,
    StaleSessionError,
)

TTL = 10.0


class SessionTableMachine(RuleBasedStateMachine):
    """Model: sid -> (deadline, set of rids); rid -> sid. Expired-but-not-closed sessions are
    refused by lookup and listed by due()."""

    def __init__(self):
        super().__init__()
        self.clock = ManualClock()
        self.table = SessionTable(TTL, max_sessions=4, max_requests_per_session=3, clock=self.clock, epoch=7)
        self.deadline = {}
        self.rids = {}
        self.sessions = {}
        self.n = 0

    def _alive(self, sid):
        return sid in self.deadline and self.clock.t < self.deadline[sid]

    @rule()
    def open(self):
        if len(self.deadline) >= 4:
            with pytest.raises(CapacityError):
                self.table.open("w")
            return
        s = self.table.open("w")
        assert s.epoch == 7 and s.lease_ttl_s == TTL and s.session_id not in self.sessions
        self.sessions[s.session_id] = s
        self.deadline[s.session_id] = self.clock.t + TTL
        self.rids[s.session_id] = set()

    @rule(dt=st.sampled_from([0.0, 1.0, 4.0, 9.99, 10.0, 25.0]))
    def advance(self, dt):
        self.clock.t += dt

    @precondition(lambda self: self.sessions)
    @rule(data=st.data())
    def lookup_and_renew(self, data):
        sid = data.draw(st.sampled_from(sorted(self.sessions)))
        s = self.sessions[sid]
        if not self._alive(sid):
            with pytest.raises(StaleSessionError):
                self.table.lookup(s)
            return
        assert self.table.lookup(s).session_id == sid
        assert self.table.renew(sid) == TTL
        self.deadline[sid] = self.clock.t + TTL
        assert self.table.time_left(sid) == pytest.approx(TTL)

    @precondition(lambda self: self.sessions)
    @rule(data=st.data())
    def wrong_epoch(self, data):
        s = self.sessions[data.draw(st.sampled_from(sorted(self.sessions)))]
        with pytest.raises(StaleSessionError, match="epoch"):
            self.table.lookup(Session(s.session_id, 8, TTL))

    @rule()
    def sweep(self):
        due = self.table.due()
        want = [sid for sid, d in self.deadline.items() if d <= self.clock.t]
        assert sorted(due) == sorted(want)
        deadlines = [self.deadline[sid] for sid in due]
        assert deadlines == sorted(deadlines)  # earliest deadline first
        assert sorted(self.table.due()) == sorted(due)  # due() alone changes nothing
        for sid in due:
            assert sorted(self.table.close(sid, "expired")) == sorted(self.rids[sid])
            self._forget(sid)
            with pytest.raises(StaleSessionError, match="expired"):
                self.table.lookup(self.sessions[sid])

    @precondition(lambda self: self.deadline)
    @rule(data=st.data())
    def close(self, data):
        sid = data.draw(st.sampled_from(sorted(self.deadline)))
        assert set(self.table.close(sid)) == self.rids[sid]
        self._forget(sid)
        with pytest.raises(StaleSessionError, match="detached"):
            self.table.lookup(self.sessions[sid])
        with pytest.raises(StaleSessionError):
            self.table.close(sid)

    def _forget(self, sid):
        del self.rids[sid]
        del self.deadline[sid]

    @precondition(lambda self: self.deadline)
    @rule(data=st.data(), rid=st.sampled_from([f"r{i}" for i in range(8)]))
    def add(self, data, rid):
        sid = data.draw(st.sampled_from(sorted(self.deadline)))
        if rid in self.rids[sid]:  # ids are per session: another session's rid is free here
            with pytest.raises(InvalidArgumentError):
                self.table.add_requests(sid, [rid])
        elif len(self.rids[sid]) >= 3:
            with pytest.raises(CapacityError):
                self.table.add_requests(sid, [rid])
        else:
            self.table.add_requests(sid, [rid])
            self.rids[sid].add(rid)

    @precondition(lambda self: self.deadline)
    @rule(data=st.data(), rid=st.sampled_from([f"r{i}" for i in range(8)]))
    def classify_and_remove(self, data, rid):
        sid = data.draw(st.sampled_from(sorted(self.deadline)))
        if rid not in self.rids[sid]:  # unknown here, whether another session holds it or not
            assert self.table.classify(sid, [rid], must_exist=False) == [False]
            with pytest.raises(NotFoundError):
                self.table.classify(sid, [rid], must_exist=True)
            with pytest.raises(NotFoundError):
                self.table.remove_requests(sid, [rid])
        else:
            assert self.table.classify(sid, [rid], must_exist=True) == [True]
            self.table.remove_requests(sid, [rid])
            self.rids[sid].discard(rid)

    @invariant()
    def agrees(self):
        self.table.check_invariants()
        assert len(self.table) == len(self.deadline)
        assert self.table.request_count() == sum(len(r) for r in self.rids.values())
        for sid in self.deadline:
            assert set(self.table.rids(sid)) == self.rids[sid]


TestSessionTable = SessionTableMachine.TestCase
TestSessionTable.settings = settings(max_examples=40, stateful_step_count=40, deadline=None)


def test_invariants_name_the_session_over_its_limit():
    t = SessionTable(1.0, 2, 2, clock=ManualClock(), epoch=1)
    s = t.open()
    t.add_requests(s.session_id, ["a", "b"])
    t._sessions[s.session_id].rids["c"] = None  # corrupt on purpose
    with pytest.raises(InvariantError, match=f"{s.session_id!r} owns 3 requests, limit 2"):
        t.check_invariants()


def test_bad_arguments():
    with pytest.raises(InvalidArgumentError):
        SessionTable(0, 1, 1)
    with pytest.raises(InvalidArgumentError):
        SessionTable(1.0, 0, 1)
    with pytest.raises(InvalidArgumentError):
        SessionTable(1.0, 1, 1, clock=5)
    t = SessionTable(1.0, 1, 1)
    for bad in ("sid", ("sid", "1", 1.0), (5, 1, 1.0)):
        with pytest.raises(InvalidArgumentError):
            t.lookup(bad)
    with pytest.raises(StaleSessionError, match="unknown"):
        t.lookup(Session("nope", t.epoch, 1.0))
    with pytest.raises(InvalidArgumentError):
        t.open(worker_name=3)
    assert t.epoch > 0 and SessionTable(1.0, 1, 1).epoch != t.epoch


def test_heap_stays_bounded_under_many_renewals():
    clock = ManualClock()
    t = SessionTable(5.0, 2, 1, clock=clock)
    a = t.open()
    for _i in range(1000):
        clock.t += 0.01
        t.renew(a.session_id)
    assert len(t._heap) <= 4 * len(t) + 65
    t.check_invariants()
    clock.t += 5.0
    assert t.due() == [a.session_id]


def test_lease_boundary_is_exclusive():
    clock = ManualClock()
    t = SessionTable(10.0, 2, 1, clock=clock, epoch=3)
    s = t.open()
    clock.t = 9.5
    t.lookup(s)
    assert t.due() == []
    clock.t = 10.0  # exactly ttl after the last renewal: expired
    with pytest.raises(StaleSessionError, match="expired"):
        t.lookup(s)
    assert t.due() == [s.session_id]
    assert t.due(now=9.0) == []
