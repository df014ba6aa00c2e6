"""The protocol's state machine (``test_conformance_machine``) with the tiers on: a host tier
as large as the device pool behind it and a file:// storage tier. Its extra rule demotes
(``evict``: every freed page moves to the host tier, none is lost) and its flush empties both
in-memory tiers while storage keeps every page ever cached, so the model's predictions stay
exact: a prefix is found on whichever tier holds it (device, host, or storage after a flush),
and the rows an extend loads from the host or storage hold exactly the tokens written."""
import shutil
import tempfile
import time
from collections import Counter

import pytest
from conformance_util import assert_law
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import precondition, rule, run_state_machine_as_test
from test_conformance_machine import EngineMachine


class TierMachine(EngineMachine):
    """:class:`EngineMachine` over a tiered engine (set ``factory`` and ``ps``)."""

    seen: Counter  # per test: extends that loaded from the host tier / from storage

    def __init__(self):
        self.dir = tempfile.mkdtemp(prefix="rkv-tiers-")  # each example its own storage
        super().__init__()
        extend = self.e.alloc_extend

        def counted(session, items):
            res = extend(session, items)
            self.seen.update(t for r in res for t, n in (("host", r.host_len), ("storage", r.storage_len)) if n)
            return res

        self.e.alloc_extend = counted

    def teardown(self):
        shutil.rmtree(self.dir, ignore_errors=True)

    def config(self):
        return dict(super().config(), host_kv_tokens=4096, storage=f"file://{self.dir}/pages",
                    storage_timeout_ms=60_000.0)

    def _drain(self):
        deadline = time.monotonic() + 60
        while self.e.stats().storage_pending:
            assert time.monotonic() < deadline, "storage writes still pending"
            time.sleep(0.005)

    @precondition(lambda self: self.sessions)
    @rule(n=st.sampled_from([1, 8, 4096]))
    def demote(self, n):
        before = self.e.stats()
        got = self.e.evict(self.sessions[sorted(self.sessions)[0]], n).tokens
        after = self.e.stats()
        assert got == before.kv_evictable - after.kv_evictable and (got >= n or after.kv_evictable == 0)
        assert after.host_used >= before.host_used  # nothing left the host tier (it has room for all)
        self.evicted += got

    @precondition(lambda self: self.sessions and self.cached and len(self.running) < 20)
    @rule(data=st.data(), tail=st.lists(st.integers(0, 9), min_size=1, max_size=4))
    def reuse(self, data, tail):
        """A new request continuing a cached sequence (on whichever tier it is now; first
        demoting every unlocked page when drawn)."""
        if data.draw(st.booleans()):
            self.demote(4096)
        ek = data.draw(st.sampled_from(sorted(self.cached, key=repr)))
        prompt = list(data.draw(st.sampled_from(self.cached[ek]))) + tail
        EngineMachine.new_request(self, data, prompt, ek)

    @precondition(lambda self: self.sessions)
    @rule()
    def flush(self):
        """Both in-memory tiers emptied; storage holds every page cached so far (drained
        first), so nothing the model knows is lost."""
        s = self.sessions[sorted(self.sessions)[0]]
        self._drain()
        ok = self.e.flush(s)
        assert ok == (not self.running)
        if ok:
            st_ = self.e.stats()
            assert (st_.host_used, st_.kv_evictable) == (0, 0)
            assert st_.storage_written_pages > 0 or not self.cached
            assert_law(st_)


@pytest.mark.parametrize("ps", [1, 4])
def test_tiered_state_machine(engine_factory, ps):
    machine = type("Machine", (TierMachine,), {"factory": engine_factory, "ps": ps, "seen": Counter()})
    run_state_machine_as_test(machine, settings=settings(max_examples=20, stateful_step_count=40, deadline=None,
                                                         derandomize=True))
    assert machine.seen["host"] and machine.seen["storage"], machine.seen  # the tiers served extends
