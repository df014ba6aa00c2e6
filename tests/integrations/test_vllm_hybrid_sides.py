"""The connector's two halves on a hybrid model, against a real hybrid manager, without vLLM.

Two fake engines (``SchedulerSide(hybrid=True)`` + ``WorkerSide``) with one attention layer in
vLLM's CPU layout and one recurrent layer as vLLM 0.32.0 hands it (raw int8 pages: conv state
then temporal state, padded) share a manager whose state pool has the same shapes. What A's
step ending at its last whole block leaves in its state block is what B loads, bit for bit, into
the block at the hit and the step's running block; KV never travels without the state.
Faults as for full attention: a state load that fails makes vLLM recompute the request's
loaded blocks, a dead manager serves no hit, and a manager stopped mid-batch then restarted at
the same address leaves nothing behind (the engines share through the new one, bit for bit).
"""
import time

import pytest
import torch
from tooling.vllm_fake import BS, HD, HEADS, KEY, connector_manager, idle

from radixkv.engine.config import EngineConfig
from radixkv.errors import InvalidArgumentError
from radixkv.integrations.vllm.config import ConnectorConfig
from radixkv.integrations.vllm.layout import KVShape, LayoutMismatchError, StateShape, state_page_views
from radixkv.integrations.vllm.link import ManagerLink
from radixkv.integrations.vllm.scheduler_side import ScheduledReq, SchedulerSide
from radixkv.integrations.vllm.worker_side import SaveReport, WorkerSide

STATE = StateShape("KF", (3, 4), (2, 2, 2), "float32", "float32")  # 48 + 32 bytes
SHAPE = KVShape(1, HEADS, HD, "float32", BS, state=STATE)
PAGE = 96  # vLLM pads the state page to the attention page
BLOCKS = 16


CONFIG = EngineConfig(kv_tokens=64, page_size=BS, layer_types="KF", head_num=HEADS, head_dim=HD, kv_dtype="float32",
                      request_rows=8, max_context_len=128, state_slots=24, conv_state_dims=STATE.conv,
                      temporal_state_dims=STATE.temporal)


@pytest.fixture(scope="module")
def manager(tmp_path_factory):
    srv = connector_manager(CONFIG, tmp_path_factory)
    yield srv
    srv.stop()


class HybridEngine:
    """A fake vLLM engine of a 2-layer hybrid model (layer 0 recurrent, layer 1 attention)."""

    def __init__(self, cfg, seed):
        self.sched = SchedulerSide(ManagerLink(cfg, "sched"), BS, hybrid=True)
        self.sched.link.get(force=True)
        g = torch.Generator().manual_seed(seed)
        self.kv = torch.randn(BLOCKS, HEADS, BS, 2 * HD, generator=g)
        self.raw = torch.randint(-128, 127, (BLOCKS, 1, 1, PAGE), generator=g, dtype=torch.int8)
        self.worker = WorkerSide(ManagerLink(cfg, "worker", keepalive=False, background=False), SHAPE)
        self.worker.register([("model.layers.1.attn", self.kv)], [("model.layers.0.mixer", 0, self.raw)])

    def state(self, block):
        conv, temporal = state_page_views(self.raw, STATE)
        return torch.cat([conv[block], temporal[block]])

    def step(self, sr, blocks, state_blocks, recompute=()):
        """One step of ``sr``; ``recompute``: the req ids whose loads must report failed."""
        plan = self.sched.build_plan([sr], lambda rid: blocks, lambda rid: [state_blocks])
        assert self.worker.load_requests(plan.loads, plan.state_loads) == set(recompute)
        report = SaveReport()
        report.add(*self.worker.save(plan.saves))
        report.add({}, self.worker.copy_states(plan.state_saves, to_vllm=False))
        self.sched.on_worker_report(*report.complete(1))
        self.sched.check_invariants()
        return plan


def test_b_loads_a_state_saved_at_the_last_whole_block(manager):
    a, b = HybridEngine(manager.cfg, 1), HybridEngine(manager.cfg, 2)
    prompt = list(range(100, 114))  # 3 whole blocks + 2 tokens
    assert a.sched.num_new_matched_tokens("r1", prompt, 0, KEY) == 0
    a_states = [0, 7, 3, 9]  # vLLM's state blocks: null, then the blocks of the steps
    plan = a.step(ScheduledReq("r1", 0, 8), [5, 2, 9, 1], a_states)  # ends at 8: no state to save yet
    assert not plan.state_saves
    plan = a.step(ScheduledReq("r1", 8, 4), [5, 2, 9, 1], a_states)  # ends at 12 = the last whole block
    assert [(op.slots.__len__(), op.blocks) for op in plan.state_saves] == [(1, (3,))]
    a.step(ScheduledReq("r1", 12, 2), [5, 2, 9, 1], a_states)
    assert a.sched.counters["committed_requests"] == 1
    a.sched.finished("r1")
    a.sched.flush()
    q = prompt[:12] + [7] * 5
    assert b.sched.num_new_matched_tokens("q1", q, 0, KEY) == 12
    b.sched.after_alloc("q1", 12)
    plan = b.step(ScheduledReq("q1", 12, 5), [3, 11, 0, 6, 4], [0, 0, 8, 10, 12])
    # the state at 12 goes to its block (index 2) and to the step's running block (index 4)
    assert [op.blocks for op in plan.state_loads] == [(8,), (12,)]
    assert torch.equal(b.state(8), a.state(3)) and torch.equal(b.state(12), a.state(3))
    assert not torch.equal(b.state(10), a.state(3))
    b.sched.finished("q1")
    assert idle(manager, a, b) == (0, 0)


def test_no_kv_hit_where_the_manager_holds_no_state(manager):
    a, b = HybridEngine(manager.cfg, 3), HybridEngine(manager.cfg, 4)
    prompt = list(range(300, 313))  # 3 whole blocks + 1
    assert a.sched.num_new_matched_tokens("r", prompt, 0, KEY) == 0
    a.step(ScheduledReq("r", 0, 13), [1, 2, 3, 4], [0, 0, 5, 6])  # ends past 12: no state at 12
    assert a.sched.counters["state_missing_requests"] == 1 and a.sched.counters["committed_requests"] == 0
    a.sched.finished("r")
    a.sched.flush()
    assert b.sched.num_new_matched_tokens("q", prompt, 0, KEY) == 0  # released: nothing shared
    b.sched.finished("q")
    # a state at 12 only: a prompt sharing 8 tokens of its KV gets nothing (no state at 8)
    assert a.sched.num_new_matched_tokens("r2", prompt, 0, KEY) == 0
    a.step(ScheduledReq("r2", 0, 12), [1, 2, 3, 4], [0, 0, 5, 6])
    a.step(ScheduledReq("r2", 12, 1), [1, 2, 3, 4], [0, 0, 5, 6])
    a.sched.finished("r2")
    a.sched.flush()
    assert b.sched.num_new_matched_tokens("q2", prompt[:10] + [9] * 6, 0, KEY) == 0
    assert b.sched.num_new_matched_tokens("q3", prompt[:12] + [9] * 6, 0, KEY) == 12
    b.sched.finished("q2")
    b.sched.finished("q3")
    assert idle(manager, a, b) == (0, 0)


def test_a_state_layout_vllm_does_not_hand_is_refused(manager):
    w = WorkerSide(ManagerLink(manager.cfg, "worker", keepalive=False, background=False), SHAPE)
    kv = torch.zeros(BLOCKS, HEADS, BS, 2 * HD)
    with pytest.raises(LayoutMismatchError, match="raw pages"):
        w.register([("model.layers.1.attn", kv)], [("model.layers.0.mixer", 0, torch.zeros(BLOCKS, 1, 1, 40))])
    with pytest.raises(LayoutMismatchError, match="recurrent state layers"):
        w.register([("model.layers.1.attn", kv)])
    other = WorkerSide(ManagerLink(manager.cfg, "worker", keepalive=False, background=False),
                       SHAPE._replace(state=STATE._replace(temporal=(2, 2, 3))))
    with pytest.raises(LayoutMismatchError, match="temporal_state"):
        other.register([("model.layers.1.attn", kv)], [("model.layers.0.mixer", 0, torch.zeros(BLOCKS, 1, 1, PAGE,
                                                                                                dtype=torch.int8))])


def test_a_prompt_ending_on_a_block_saves_its_state_into_its_own_slot_too(manager):
    a, b = HybridEngine(manager.cfg, 5), HybridEngine(manager.cfg, 6)
    prompt = list(range(500, 512))  # exactly 3 blocks: the tree takes the request's own slot's state
    assert a.sched.num_new_matched_tokens("r", prompt, 0, KEY) == 0
    plan = a.step(ScheduledReq("r", 0, 12), [1, 2, 3], [0, 0, 7])
    [op] = plan.state_saves
    assert len(op.slots) == 2 and op.blocks == (7,)  # the track slot and the own slot
    a.sched.finished("r")
    a.sched.flush()
    q = prompt + [1, 2, 3]
    assert b.sched.num_new_matched_tokens("q", q, 0, KEY) == 12
    b.sched.after_alloc("q", 12)
    plan = b.step(ScheduledReq("q", 12, 3), [4, 5, 6, 8], [0, 0, 9, 10])
    assert [op.blocks for op in plan.state_loads] == [(9,), (10,)]
    assert torch.equal(b.state(9), a.state(7)) and torch.equal(b.state(10), a.state(7))
    b.sched.finished("q")
    assert idle(manager, a, b) == (0, 0)


def save_whole_prompt(engine, rid, prompt, blocks, state_blocks):
    """``engine`` computes ``prompt`` (whole blocks) in one step: KV and the state at its end
    saved and committed."""
    assert engine.sched.num_new_matched_tokens(rid, prompt, 0, KEY) == 0
    engine.step(ScheduledReq(rid, 0, len(prompt)), blocks, state_blocks)
    engine.sched.finished(rid)
    engine.sched.flush()


def test_a_state_load_that_fails_makes_vllm_recompute_the_loaded_blocks(manager):
    a, b = HybridEngine(manager.cfg, 7), HybridEngine(manager.cfg, 8)
    prompt = list(range(700, 712))
    save_whole_prompt(a, "r", prompt, [1, 2, 3], [0, 0, 7])
    q = prompt + [1, 2, 3]
    assert b.sched.num_new_matched_tokens("q", q, 0, KEY) == 12
    b.sched.after_alloc("q", 12)

    def broken(*args):
        raise InvalidArgumentError("the state copy failed")

    b.worker._copy_state_group = broken
    # the KV load went through, but without its state every loaded block is recomputed
    b.step(ScheduledReq("q", 12, 3), [4, 5, 6, 8], [0, 0, 9, 10], recompute={"q"})
    assert b.worker.counters["loaded_tokens"] == 12
    del b.worker._copy_state_group
    # vLLM recomputes from token 0: nothing is loaded again, nothing leaks
    plan = b.step(ScheduledReq("q", 0, 15), [4, 5, 6, 8], [0, 0, 9, 10])
    assert not plan.loads and not plan.state_loads
    b.sched.finished("q")
    assert idle(manager, a, b) == (0, 0)
    # a state op the manager's pool cannot hold (its state gone): the same
    assert b.sched.num_new_matched_tokens("q2", q, 0, KEY) == 12
    b.sched.after_alloc("q2", 12)
    plan = b.sched.build_plan([ScheduledReq("q2", 12, 3)], lambda rid: [4, 5, 6, 8], lambda rid: [[0, 0, 9, 10]])
    gone = [op._replace(slots=(10_000,)) for op in plan.state_loads]
    # an asynchronous load (the connector's, on a hybrid model): the request fails whole
    assert b.worker.load_requests(plan.loads, gone) == {"q2"}
    assert b.worker.load_requests(plan.loads, plan.state_loads) == set()
    b.sched.finished("q2")
    # an asynchronous load is planned unscheduled (0 tokens): the state at its end, once
    assert b.sched.num_new_matched_tokens("q3", q, 0, KEY) == 12
    b.sched.after_alloc("q3", 12)
    plan = b.sched.build_plan([ScheduledReq("q3", 12, 0)], lambda rid: [4, 5, 6, 8], lambda rid: [[0, 0, 9, 10]])
    assert [op.end for op in plan.loads] == [12] and [op.blocks for op in plan.state_loads] == [(9,)]
    assert b.worker.load_requests(plan.loads, plan.state_loads) == set()
    b.sched.finished("q3")
    assert idle(manager, a, b) == (0, 0)
    manager.client().check_invariants()


def test_a_dead_manager_means_no_hit_and_no_copies(tmp_path):
    tok = tmp_path / "token"
    tok.write_text("x" * 32)
    cfg = ConnectorConfig(address=f"unix://{tmp_path}/none.sock", token_file=str(tok),
                          connect_timeout_s=0.2, retry_interval_s=60)
    e = HybridEngine(cfg, 9)  # registers its KV and state layers without the manager
    assert e.sched.num_new_matched_tokens("r", list(range(16)), 0, KEY) == 0
    plan = e.step(ScheduledReq("r", 0, 16), [0, 1, 2, 3], [0, 0, 0, 4])
    assert plan[:3] == ([], [], []) and not plan.state_loads and not plan.state_saves
    assert e.sched.link.counters["connect_failures"] >= 1
    e.sched.finished("r")
    e.sched.check_invariants()
    e.sched.close()


def wait_for_epoch(engine, old_epoch):
    deadline = time.monotonic() + 30
    while (live := engine.sched.link.current()) is None or live[1].session.epoch == old_epoch:
        assert time.monotonic() < deadline, "no re-attach to the restarted manager"
        time.sleep(0.02)


def test_a_manager_stopped_mid_batch_then_restarted_leaves_nothing_behind(tmp_path_factory):
    srv = connector_manager(CONFIG, tmp_path_factory)
    cfg = srv.cfg
    try:
        a, b = HybridEngine(cfg, 10), HybridEngine(cfg, 11)
        prompt = list(range(800, 812))
        save_whole_prompt(a, "r0", prompt, [1, 2, 3], [0, 0, 7])
        epoch = a.sched.link.current()[1].session.epoch
        # the batch: b loads r0's prefix, a computes a new prompt; the manager stops in between
        assert b.sched.num_new_matched_tokens("q", prompt + [5], 0, KEY) == 12
        b.sched.after_alloc("q", 12)
        new = list(range(900, 912))
        assert a.sched.num_new_matched_tokens("r1", new, 0, KEY) == 0
        plan_b = b.sched.build_plan([ScheduledReq("q", 12, 1)], lambda rid: [4, 5, 6, 8],
                                    lambda rid: [[0, 0, 9, 10]])
        plan_a = a.sched.build_plan([ScheduledReq("r1", 0, 12)], lambda rid: [4, 5, 6],
                                    lambda rid: [[0, 0, 11]])
        assert plan_b.loads and plan_b.state_loads and plan_a.saves and plan_a.state_saves
        srv.stop()
        # b's load from the stopped manager's still-mapped pools is whole: KV and state, bit for bit
        assert b.worker.load_requests(plan_b.loads, plan_b.state_loads) == set()
        assert torch.equal(b.state(9), a.state(7)) and torch.equal(b.state(10), a.state(7))
        # a's save lands in the old mapping; its commit fails on the dead link: committed nowhere
        report = SaveReport()
        report.add(*a.worker.save(plan_a.saves))
        report.add({}, a.worker.copy_states(plan_a.state_saves, to_vllm=False))
        a.sched.on_worker_report(*report.complete(1))
        b.sched.on_worker_report({}, set())
        for e, rid in ((a, "r1"), (b, "q")):
            e.sched.finished(rid)
            e.sched.flush()
            e.sched.check_invariants()
            assert e.sched.pending == 0
        assert report.saved == {"r1": 12} and a.sched._calls.counters["failed"] == 1
        assert a.sched.link.counters["call_failures"] >= 1
        # while it is down: no hit, no copies, the engines keep serving
        assert b.sched.num_new_matched_tokens("d", prompt + [6], 0, KEY) == 0
        plan = b.step(ScheduledReq("d", 0, 13), [4, 5, 6, 8], [0, 0, 9, 10])
        assert plan[:3] == ([], [], []) and not plan.state_loads and not plan.state_saves
        b.sched.finished("d")

        srv = srv.restarted()
        srv.cfg = cfg
        for e in (a, b):
            wait_for_epoch(e, epoch)
        assert srv.client().stats().inserted_tokens == 0  # the new manager is empty
        assert b.sched.num_new_matched_tokens("q3", prompt + [5], 0, KEY) == 0
        b.sched.finished("q3")
        # and shared again: a saves into the new epoch's pools, b loads KV and state from them
        save_whole_prompt(a, "r2", new, [4, 5, 6], [0, 0, 12])
        assert b.sched.num_new_matched_tokens("q4", new + [5], 0, KEY) == 12
        b.sched.after_alloc("q4", 12)
        b.step(ScheduledReq("q4", 12, 1), [1, 2, 3, 8], [0, 0, 13, 14])
        assert torch.equal(b.state(13), a.state(12)) and torch.equal(b.state(14), a.state(12))
        b.sched.finished("q4")
        assert idle(srv, a, b) == (0, 0)
        srv.client().check_invariants()
        a.sched.close()
        b.sched.close()
    finally:
        srv.stop()
