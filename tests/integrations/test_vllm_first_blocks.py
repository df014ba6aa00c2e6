"""The vLLM connector's misses without a round trip: the first-block index fed by the
manager's KV events, and the deferred save of an index miss (no vLLM).

Against a real manager with events on; engines are a ``SchedulerSide`` + ``WorkerSide`` each
with a fake paged KV cache in vLLM's CPU layout, as in ``test_vllm_connector_sides.py``.
"""
import threading
import time

import numpy as np
import pytest
import torch
from tooling.vllm_fake import BS, HD, HEADS, KEY, LAYERS, Engine, connector_manager, idle

from radixkv.engine.config import EngineConfig
from radixkv.errors import InvalidArgumentError, InvariantError
from radixkv.integrations.vllm.config import ConnectorConfig
from radixkv.integrations.vllm.first_blocks import FirstBlockIndex
from radixkv.integrations.vllm.link import ManagerLink
from radixkv.integrations.vllm.scheduler_side import ScheduledReq, SchedulerSide


@pytest.fixture(scope="module")
def manager(tmp_path_factory):
    cfg = EngineConfig(kv_tokens=64, page_size=BS, layer_types="F" * LAYERS, head_num=HEADS, head_dim=HD,
                       kv_dtype="float32", request_rows=8, max_context_len=128, enable_kv_events=True)
    srv = connector_manager(cfg, tmp_path_factory)
    try:
        yield srv
    finally:
        srv.stop()


def until(cond, timeout_s=30.0):
    """Wait for ``cond()`` (the event stream is asynchronous); a timeout fails the test."""
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.005)


def test_the_index_is_ready_only_for_its_manager_epoch_and_once_caught_up():
    ix = FirstBlockIndex(BS)
    a = np.arange(10, 18, dtype=np.int32)
    ix.reset(ready=True, epoch=1)
    assert not ix.may_hold(KEY, a, 1)
    assert ix.may_hold(KEY, a, 2)                   # an asker of a restarted manager: ask
    ix.reset(ready=False, epoch=2)                  # a new manager's stream starts
    ix.apply([ev_stored([1], a.tolist())])
    assert ix.may_hold(KEY, a[::-1].copy(), 2)      # not caught up yet: ask
    ix.caught_up(1)                                 # another epoch's mark: nothing
    assert not ix.ready
    ix.caught_up(2)
    assert ix.ready and not ix.may_hold(KEY, a[::-1].copy(), 2) and ix.may_hold(KEY, a, 2)
    ix.reset(ready=False, epoch=3)
    ix.apply([{"type": "EventsLost", "first_seq": 0, "count": 5}])
    ix.caught_up(3)                                 # a gap before the mark: never ready
    assert not ix.ready and ix.may_hold(KEY, a, 3)


def ev_stored(hashes, tokens, parent=None, key=KEY):
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent, "token_ids": tokens,
            "extra_key": key}


def test_the_index_answers_only_when_ready_and_follows_the_events():
    ix = FirstBlockIndex(BS)
    a, b = np.arange(10, 18, dtype=np.int32), np.arange(50, 58, dtype=np.int32)
    assert ix.may_hold(KEY, a)                      # not ready: ask
    ix.reset(ready=True)
    assert not ix.may_hold(KEY, a)
    ix.apply([ev_stored([1, 2], a.tolist()), ev_stored([3], [99, 98, 97, 96], parent=2)])
    assert ix.may_hold(KEY, a) and not ix.may_hold("vllm|other", a) and not ix.may_hold(KEY, b)
    assert ix.may_hold(KEY, np.concatenate([a[:4], b]))   # only the first page is the key
    assert not ix.may_hold(KEY, np.asarray([99, 98, 97, 96], np.int32))  # not a first block
    ix.apply([{"type": "BlockRemoved", "block_hashes": [2, 3]}])
    assert ix.may_hold(KEY, a)                      # its first page (hash 1) is still stored
    ix.apply([{"type": "BlockRemoved", "block_hashes": [1]}])
    assert not ix.may_hold(KEY, a) and len(ix) == 0
    ix.apply([ev_stored([4], b[:4].tolist()), {"type": "AllBlocksCleared"}])
    assert not ix.may_hold(KEY, b)
    ix.apply([{"type": "EventsLost", "first_seq": 7, "count": 3}])
    assert ix.may_hold(KEY, b) and not ix.ready     # a gap: unsure, ask
    ix.check_invariants()
    ix._keys[("x", b"")] = 1
    with pytest.raises(InvariantError):
        ix.check_invariants()
    with pytest.raises(InvalidArgumentError):
        SchedulerSide(ManagerLink(ConnectorConfig(address="unix:///nowhere.sock"), "s"), 8, FirstBlockIndex(4))


def gate(engine):
    """Hold the engine's call queue until the returned event is set: a deferred alloc queued
    meanwhile is still in flight (its reply not taken) in the steps before that."""
    ev = threading.Event()
    engine.sched._calls.submit(None, ev.wait)
    return ev


def test_a_miss_is_answered_at_once_and_saved_after_it_finished(manager):
    a, b = Engine(manager.cfg, seed=1, index=True), Engine(manager.cfg, seed=2, index=True)
    until(lambda: a.index.ready and b.index.ready)
    prompt = list(range(300, 314))                  # 3 whole blocks + 2 tokens
    held = gate(a)
    assert a.sched.num_new_matched_tokens("r1", prompt, 0, KEY) == 0
    assert a.sched.counters["index_misses"] == 1
    a_blocks = [5, 2, 9, 1]
    plan, _ = a.step([ScheduledReq("r1", 0, len(prompt))], {"r1": a_blocks})
    assert plan[:3] == ([], [], [])                     # the row is not known yet: nothing saved
    assert a.sched.finished("r1", a_blocks)         # vLLM keeps the blocks
    plan, _ = a.step([], {})
    assert plan[:3] == ([], [], [])
    held.set()
    a.sched.flush()
    plan, _ = a.step([], {})                        # the kept blocks are saved, then freed
    assert [(op.start, op.end) for op in plan.saves] == [(0, 12)] and plan.finish == ["r1"] == a.sent
    assert a.sched.counters["committed_requests"] == 1 and a.sched.counters["deferred_saves"] == 1
    assert a.sched.pending == 0 and idle(manager, a) == (0, 0)
    # B learns A's first block from the events, asks, and loads A's KV bit for bit
    until(lambda: b.index.may_hold(KEY, np.asarray(prompt, np.int32)))
    assert b.sched.num_new_matched_tokens("q1", prompt, 0, KEY) == 12
    assert b.sched.counters["index_misses"] == 0
    b.sched.after_alloc("q1", 12)
    b_blocks = [3, 11, 0, 6]
    plan, failed = b.step([ScheduledReq("q1", 12, 2)], {"q1": b_blocks})
    assert not failed and [(op.start, op.end) for op in plan.loads] == [(0, 12)]
    ka, va = a.token_kv(a_blocks, 12)
    kb, vb = b.token_kv(b_blocks, 12)
    assert torch.equal(ka, kb) and torch.equal(va, vb)
    assert not b.sched.finished("q1", b_blocks)
    assert idle(manager, a, b) == (0, 0)
    a.close()
    b.close()


def test_a_running_miss_is_saved_in_a_later_step(manager):
    e = Engine(manager.cfg, index=True, feed=False)
    prompt = list(range(700, 717))                  # 4 whole blocks + 1
    held = gate(e)
    e.sched.num_new_matched_tokens("r", prompt, 0, KEY)
    blocks = [0, 1, 2, 3, 4]
    plan, _ = e.step([ScheduledReq("r", 0, 8)], {"r": blocks})     # a chunk: nothing saved yet
    assert plan[:3] == ([], [], [])
    held.set()
    e.sched.flush()
    plan, _ = e.step([ScheduledReq("r", 8, 9)], {"r": blocks})     # the rest: all 4 blocks saved
    assert [(op.start, op.end) for op in plan.saves] == [(0, 16)] and not plan.finish
    assert e.sched.counters["committed_requests"] == 1
    assert not e.sched.finished("r", blocks)        # nothing left to save: blocks freed at once
    assert e.sched.pending == 0 and idle(manager, e) == (0, 0)
    e.close()


def test_a_false_negative_loses_the_hit_and_never_writes_the_managers_rows(manager):
    a = Engine(manager.cfg, seed=3, index=True)
    b = Engine(manager.cfg, seed=4, index=True, feed=False)
    prompt = list(range(400, 417))                  # 4 whole blocks + 1
    a.sched.num_new_matched_tokens("r", prompt[:13], 0, KEY)   # A caches the first 3 blocks
    a.sched.flush()
    a_blocks = [7, 8, 9, 10]
    a.step([ScheduledReq("r", 0, 13)], {"r": a_blocks})
    a.sched.finished("r", a_blocks)
    a.sched.flush()
    assert b.sched.num_new_matched_tokens("q", prompt, 0, KEY) == 0    # the index lags: no hit
    b.sched.flush()
    b_blocks = [1, 2, 3, 4, 5]
    plan, _ = b.step([ScheduledReq("q", 0, 17)], {"q": b_blocks})
    assert [(op.start, op.end) for op in plan.saves] == [(12, 16)]  # past the manager's prefix
    assert b.sched.counters["index_lost_hits"] == 1
    assert b.sched.counters["committed_requests"] == 1 and b.worker.counters["saved_tokens"] == 4
    assert not b.sched.finished("q", b_blocks)
    assert idle(manager, a, b) == (0, 0)
    # a third engine loads the 4 blocks: A's first 3 (B did not overwrite them), then B's 4th
    c = Engine(manager.cfg, seed=5)                 # no index: asks the manager
    assert c.sched.num_new_matched_tokens("c", prompt, 0, KEY) == 16
    c.sched.after_alloc("c", 16)
    c_blocks = [12, 13, 14, 15, 0]
    c.step([ScheduledReq("c", 16, 1)], {"c": c_blocks})
    kc, vc = c.token_kv(c_blocks, 16)
    ka, va = a.token_kv(a_blocks, 12)
    kb, vb = b.token_kv(b_blocks, 16)
    assert torch.equal(kc[:, :12], ka) and torch.equal(vc[:, :12], va)
    assert torch.equal(kc[:, 12:], kb[:, 12:]) and torch.equal(vc[:, 12:], vb[:, 12:])
    c.sched.finished("c")
    assert idle(manager, a, b, c) == (0, 0)
    for e in (a, b, c):
        e.close()


@pytest.mark.parametrize("finish_first", [False, True])
def test_a_miss_the_manager_cannot_take_is_computed_and_forgotten(manager, finish_first):
    e = Engine(manager.cfg, blocks=32, index=True, feed=False)
    prompt = list(range(1, 127))                    # longer than the 64-slot pool
    held = gate(e)
    assert e.sched.num_new_matched_tokens("big", prompt, 0, KEY) == 0
    if finish_first:                                # aborted before it ran: released after the alloc
        assert not e.sched.finished("big")
    else:
        e.step([ScheduledReq("big", 0, len(prompt))], {"big": list(range(32))})
        assert e.sched.finished("big", list(range(32)))   # kept until the reply is in
    held.set()
    e.sched.flush()
    plan, _ = e.step([], {})
    assert plan[:3] == ([], [], [] if finish_first else ["big"])
    assert e.sched.counters["uncacheable_requests"] == (0 if finish_first else 1) and e.sched.pending == 0
    assert e.sched.link.counters["call_failures"] == 0 and e.sched.link.up   # no manager fault
    assert idle(manager, e) == (0, 0)
    e.close()


def test_a_kept_miss_of_a_lost_session_is_freed_without_a_copy(manager):
    e = Engine(manager.cfg, index=True, feed=False)
    prompt = list(range(800, 813))
    e.sched.num_new_matched_tokens("r", prompt, 0, KEY)
    e.sched.flush()
    held = gate(e)                                  # the step's report never comes before the fault
    blocks = [0, 1, 2, 3]
    e.sched._reqs["r"].computed = 13                # vLLM computed it; its save is not planned yet
    assert e.sched.finished("r", blocks)
    e.sched.link.fail(ConnectionError("manager restarted"))   # the session is gone
    plan, _ = e.step([], {})
    assert plan[:3] == ([], [], ["r"])                  # no copy into the old session's row; blocks freed
    assert e.sched.pending == 0 and e.sched.counters["dropped_requests"] == 1
    held.set()
    e.close()


@pytest.mark.parametrize("chunk", [16, 8])
def test_a_miss_finished_before_the_report_is_committed_or_released(manager, chunk):
    e = Engine(manager.cfg, index=True, feed=False)
    prompt = list(range(600 + 100 * chunk, 617 + 100 * chunk))  # not cached by the other case
    e.sched.num_new_matched_tokens("r", prompt, 0, KEY)
    e.sched.flush()
    # finished in the step that saves: whole prompt saved -> commit; half -> release
    e.step([ScheduledReq("r", 0, chunk)], {"r": [0, 1, 2, 3, 4]}, finish_before_report=["r"])
    assert e.sched.pending == 0
    assert e.sched.counters["committed_requests" if chunk == 16 else "released_requests"] == 1
    assert idle(manager, e) == (0, 0)
    e.close()


class _CallCounter:
    """A client that notes ``(method, in the caller's thread)`` of each manager call."""

    def __init__(self, inner):
        self._inner = inner
        self.calls: list[tuple[str, bool]] = []

    def __getattr__(self, name):
        attr = getattr(self._inner, name)
        if name not in ("alloc_extend", "cache_finished", "release"):
            return attr

        def counted(*args):
            self.calls.append((name, threading.current_thread() is threading.main_thread()))
            return attr(*args)
        return counted


@pytest.mark.parametrize("index", [False, True])
def test_a_miss_makes_no_call_in_vllms_thread_with_the_index(manager, index):
    """A fresh prompt's whole life (match, its step, finish, the steps after): without the
    index one ``alloc_extend`` in vLLM's thread and the save in its own step; with it none, and
    the save one step after the finish (issue 33 item 0: counts, not timing)."""
    e = Engine(manager.cfg, seed=3, index=index)
    until(lambda: not index or e.index.ready)
    client, info = e.sched.link.get()
    counter = _CallCounter(client)
    e.sched.link._live = (counter, info)
    prompt = list(range(900 + 20 * index, 914 + 20 * index))    # 3 whole blocks + 2 tokens, never seen
    held = threading.Event() if index else None                 # the deferred alloc queued behind it
    if held is not None:                                        # (a bounded wait: a call in vLLM's
        e.sched._calls.submit(None, lambda: held.wait(5))       # thread would fail, not hang)
    assert e.sched.num_new_matched_tokens("m", prompt, 0, KEY) == 0
    blocks = [4, 7, 1, 0]
    plan, _ = e.step([ScheduledReq("m", 0, len(prompt))], {"m": blocks})
    assert [(op.start, op.end) for op in plan.saves] == ([] if index else [(0, 12)])
    assert e.sched.finished("m", blocks) is index                 # kept for the deferred save
    steps_after = 0
    if held is not None:
        held.set()
        e.sched.flush()
        plan, _ = e.step([], {})
        steps_after += 1
        assert [(op.start, op.end) for op in plan.saves] == [(0, 12)] and plan.finish == ["m"]
    e.sched.flush()
    assert [c for c in counter.calls if c[1]] == ([] if index else [("alloc_extend", True)])
    assert ("cache_finished", False) in counter.calls and steps_after == int(index)
    assert (("alloc_extend", False) in counter.calls) is index     # the deferred alloc: the queue's thread
    assert e.sched.counters["committed_requests"] == 1 and idle(manager, e) == (0, 0)
    e.close()
