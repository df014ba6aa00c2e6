"""The event hub (``radixkv.service.server.event_hub``): numbering, the bounded ring, independent
cursors, gap reports, outlets, invariants; a Hypothesis state machine against a plain list
model; and N concurrent asyncio watchers that must all receive the same gap-free sequence."""
import asyncio
import random

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from radixkv.service.server.event_hub import KIND_KV, KIND_STATE, EventHub, Lost
from radixkv.service.server.servicer import encode_record
from radixkv.service.wire import events as event_wire
from radixkv.service.wire._gen import cache_manager_pb2 as pb

from radixkv.cache.hybrid.state_events import StateRemoved, StateStored
from radixkv.cache.kv_events import AllBlocksCleared, BlockRemoved, KVEventRecorder
from radixkv.errors import CapacityError, InvalidArgumentError, InvariantError


class Source:
    """A destructive queue standing in for the tree's recorder."""

    def __init__(self):
        self.pending = []
        self.made = 0

    def add(self, n, state=False):
        for _ in range(n):
            h = self.made
            self.pending.append(StateStored(h, 4) if state else BlockRemoved((h,), "GPU"))
            self.made += 1

    def __call__(self):
        out, self.pending = self.pending, []
        return out


def ids(records):
    return [r.seq for r in records]


def test_pump_numbers_every_event_once_and_cursors_do_not_compete():
    src = Source()
    hub = EventHub(src, capacity=8, encode=encode_record)
    a = hub.subscribe("a", 0)
    src.add(3)
    assert hub.pump() == 3 and hub.pump() == 0
    b = hub.subscribe("b", 0)
    late = hub.subscribe("late")  # from the next event
    src.add(2)
    hub.pump()
    ra, rb, rl = hub.read(a), hub.read(b), hub.read(late)
    assert ids(ra.records) == ids(rb.records) == [0, 1, 2, 3, 4] and ids(rl.records) == [3, 4]
    assert [r.event.block_hashes[0] for r in ra.records] == [0, 1, 2, 3, 4]
    assert ra.lost is None and not ra.more and ra.next_seq == 5
    assert hub.read(a).records == [] and ids(hub.read(b, 0).records) == []
    s = hub.stats()
    assert (s.next_seq, s.oldest_seq, s.retained, s.kv_events, s.cursors, s.lost) == (5, 0, 5, 5, 3, 0)
    hub.check_invariants()


def test_a_cursor_behind_the_ring_is_told_what_it_lost():
    src = Source()
    hub = EventHub(src, capacity=4)
    slow = hub.subscribe("slow", 0)
    src.add(10)
    hub.pump()
    res = hub.read(slow, 2)
    assert res.lost == Lost(0, 6) and ids(res.records) == [6, 7] and res.more
    assert ids(hub.read(slow).records) == [8, 9]
    assert slow.lost == 6 and hub.stats().lost == 6 and hub.stats().oldest_seq == 6
    resumed = hub.subscribe("resume", 3)  # older than the ring: accepted, reported on read
    assert hub.read(resumed).lost == Lost(3, 3)
    hub.check_invariants()


def test_bad_input_is_refused_and_changes_nothing():
    src = Source()
    hub = EventHub(src, capacity=4)
    src.add(2)
    hub.pump()
    before = hub.stats()
    with pytest.raises(InvalidArgumentError, match="start_seq 3 is ahead"):
        hub.subscribe("x", 3)
    with pytest.raises(InvalidArgumentError):
        hub.subscribe("x", -1)
    with pytest.raises(InvalidArgumentError, match="event 1 of the batch"):
        hub.append([AllBlocksCleared(), {"type": "AllBlocksCleared"}])
    c = hub.subscribe("c", 0)
    with pytest.raises(InvalidArgumentError):
        hub.read(c, -1)
    with pytest.raises(InvalidArgumentError, match="encoder"):
        hub.read(c, 0, 100)
    other = EventHub(Source()).subscribe("o")
    with pytest.raises(InvalidArgumentError, match="not subscribed"):
        hub.read(other)
    assert hub.stats()._replace(cursors=1) == before._replace(cursors=1) and c.next_seq == 0
    for bad in (0, True, 2.5):
        with pytest.raises(InvalidArgumentError):
            EventHub(src, capacity=bad)
    hub.check_invariants()


def test_state_events_are_their_own_kind_and_travel_numbered():
    rec = KVEventRecorder(page_size=2)
    rec.on_stored(None, [1, 2, 3, 4])
    h = rec.block_hashes([1, 2, 3, 4])
    src = Source()
    src.pending = rec.take_events() + [StateStored(h[-1], 4), StateRemoved((h[-1],)), AllBlocksCleared()]
    hub = EventHub(src, encode=encode_record)
    c = hub.subscribe("c", 0)
    hub.pump()
    recs = hub.read(c).records
    assert [r.kind for r in recs] == [KIND_KV, KIND_STATE, KIND_STATE, KIND_KV]
    assert (hub.stats().kv_events, hub.stats().state_events) == (2, 2)
    for r in recs:  # the gRPC form: numbered, and the same dict back
        msg = pb.KVEvent.FromString(hub.encoded(r))
        assert msg.seq == r.seq and event_wire.event_from_msg(msg) == r.event.to_dict()
    lost = event_wire.lost_to_msg(5, 3)
    assert event_wire.numbered_event_from_msg(lost) == (5, {"type": "EventsLost", "first_seq": 5, "count": 3})


def test_encoding_happens_once_per_record_and_max_bytes_bounds_a_read():
    calls = []

    def encode(r):
        calls.append(r.seq)
        return b"x" * 10

    src = Source()
    hub = EventHub(src, encode=encode)
    a, b = hub.subscribe("a", 0), hub.subscribe("b", 0)
    src.add(5)
    hub.pump()
    for cur in (a, b):
        for r in hub.read(cur).records:
            hub.encoded(r)
    assert calls == [0, 1, 2, 3, 4]
    c = hub.subscribe("c", 0)
    res = hub.read(c, 0, 25)  # two records fit in 25 bytes
    assert ids(res.records) == [0, 1] and res.more
    assert ids(hub.read(c, 0, 5).records) == [2]  # at least one, even past the budget


def test_outlets_get_every_batch_in_order_and_retry_after_capacity_errors():
    src = Source()
    hub = EventHub(src, capacity=64)
    got, refuse = [], [False]

    def outlet(records):
        if refuse[0]:
            raise CapacityError("full", requested=1, available=0)
        got.append(ids(records))

    def broken(records):
        raise RuntimeError("boom")

    hub.add_outlet("o", outlet)
    hub.add_outlet("broken", broken)
    src.add(2)
    hub.pump()
    refuse[0] = True
    src.add(3)
    hub.pump()
    refuse[0] = False
    src.add(1)
    hub.pump()
    assert got == [[0, 1], [2, 3, 4, 5]]
    s = hub.stats()
    assert s.outlet_retries == 1 and s.outlet_errors == 3
    hub.check_invariants()


def test_check_invariants_names_the_broken_seq_and_cursor():
    src = Source()
    hub = EventHub(src, capacity=8)
    src.add(4)
    hub.pump()
    hub.check_invariants()
    saved = hub._records[2]
    hub._records[2] = None
    with pytest.raises(InvariantError, match=r"seqs \[2\]"):
        hub.check_invariants()
    hub._records[2] = saved._replace(kind=KIND_STATE)
    with pytest.raises(InvariantError, match="wrong kind"):
        hub.check_invariants()
    hub._records[2] = saved
    c = hub.subscribe("c")
    c.next_seq = 99
    with pytest.raises(InvariantError, match=rf"cursors \[{c.cid}\]"):
        hub.check_invariants()
    c.next_seq = 4
    hub._kinds[KIND_KV] += 1
    with pytest.raises(InvariantError, match="numbered"):
        hub.check_invariants()


def test_wait_wakes_on_new_events_stop_and_timeout():
    async def main():
        src = Source()
        hub = EventHub(src)
        cur = hub.subscribe("w")
        assert await hub.wait(cur, 0.01) is False  # timeout
        waiter = asyncio.ensure_future(hub.wait(cur, 10))
        await asyncio.sleep(0)
        src.add(1)
        hub.pump()
        assert await asyncio.wait_for(waiter, 5) is True
        hub.read(cur)
        stop = asyncio.Event()
        waiter = asyncio.ensure_future(hub.wait(cur, 10, stop))
        await asyncio.sleep(0)
        stop.set()
        assert await asyncio.wait_for(waiter, 5) is False
        hub.close()
        assert await asyncio.wait_for(hub.wait(cur, 10), 5) is False and hub.pump() == 0

    asyncio.run(main())


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_n_concurrent_watchers_receive_the_same_gap_free_sequence(seed):
    """Watchers subscribe at seq 0, a producer pumps random batches (KV and state events)
    interleaved with the watchers' reads of random sizes; every watcher ends with exactly
    0..total-1, in order, each event the producer's."""
    rng = random.Random(seed)
    n_watchers, total_batches = 4, 60

    async def main():
        src = Source()
        hub = EventHub(src, capacity=4096, encode=encode_record)
        stop = asyncio.Event()
        seen = {i: [] for i in range(n_watchers)}

        async def watcher(i):
            cur = hub.subscribe(f"w{i}", 0)
            while True:
                res = hub.read(cur, rng.randint(1, 7))
                assert res.lost is None
                seen[i].extend((r.seq, r.event) for r in res.records)
                if not res.more:
                    if stop.is_set() and cur.next_seq == hub.next_seq:
                        return
                    await hub.wait(cur, 0.05, stop)
                await asyncio.sleep(0)

        tasks = [asyncio.ensure_future(watcher(i)) for i in range(n_watchers)]
        for _ in range(total_batches):
            src.add(rng.randint(0, 9), state=rng.random() < 0.2)
            hub.pump()
            hub.check_invariants()
            for _ in range(rng.randint(0, 3)):
                await asyncio.sleep(0)
        stop.set()
        await asyncio.wait_for(asyncio.gather(*tasks), 30)
        return src.made, seen, hub

    made, seen, hub = asyncio.run(main())
    assert made > 0
    first = seen[0]
    assert [s for s, _ in first] == list(range(made))
    assert [e.block_hash if isinstance(e, StateStored) else e.block_hashes[0] for _, e in first] == list(range(made))
    for i in range(1, n_watchers):
        assert seen[i] == first
    assert hub.stats().lost == 0


class HubMachine(RuleBasedStateMachine):
    """The hub against a model: the list of every event ever appended and, per cursor, its
    position; a read must return model[pos:end] after the lost prefix [pos, oldest)."""

    @initialize(cap=st.integers(1, 12))
    def setup(self, cap):
        self.src = Source()
        self.hub = EventHub(self.src, capacity=cap, encode=encode_record)
        self.cap = cap
        self.model = []
        self.pos = {}
        self.cursors = {}

    @rule(n=st.integers(0, 6), state=st.booleans())
    def produce_and_pump(self, n, state):
        before = self.src.made
        self.src.add(n, state)
        assert self.hub.pump() == n
        self.model.extend(range(before, before + n))

    @rule(data=st.data())
    def subscribe(self, data):
        start = data.draw(st.one_of(st.none(), st.integers(0, len(self.model))))
        c = self.hub.subscribe("m", start)
        self.cursors[c.cid] = c
        self.pos[c.cid] = len(self.model) if start is None else start

    @precondition(lambda self: self.cursors)
    @rule(data=st.data(), n=st.integers(0, 5), budget=st.sampled_from([0, 0, 1, 40]))
    def read(self, data, n, budget):
        cid = data.draw(st.sampled_from(sorted(self.cursors)))
        res = self.hub.read(self.cursors[cid], n, budget)
        pos = self.pos[cid]
        oldest = max(0, len(self.model) - self.cap)
        if pos < oldest:
            assert res.lost == Lost(pos, oldest - pos)
            pos = oldest
        else:
            assert res.lost is None
        got = [r.seq for r in res.records]
        want_max = len(self.model) - pos if n == 0 else min(n, len(self.model) - pos)
        assert got == list(range(pos, pos + len(got)))
        assert len(got) == want_max or (budget and got)
        assert [self.model[s] for s in got] == [
            r.event.block_hash if isinstance(r.event, StateStored) else r.event.block_hashes[0]
            for r in res.records]
        self.pos[cid] = pos + len(got)
        assert res.next_seq == self.pos[cid] and res.more == (self.pos[cid] < len(self.model))

    @precondition(lambda self: self.cursors)
    @rule(data=st.data())
    def unsubscribe(self, data):
        cid = data.draw(st.sampled_from(sorted(self.cursors)))
        self.hub.unsubscribe(self.cursors.pop(cid))
        del self.pos[cid]

    @invariant()
    def consistent(self):
        if not hasattr(self, "hub"):
            return
        self.hub.check_invariants()
        s = self.hub.stats()
        assert s.next_seq == len(self.model) and s.cursors == len(self.cursors)
        assert s.retained == min(self.cap, len(self.model))


TestHubMachine = HubMachine.TestCase
