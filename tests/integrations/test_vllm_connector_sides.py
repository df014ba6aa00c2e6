"""The vLLM connector's two halves against a real manager, without vLLM.

Two "engines" (a ``SchedulerSide`` + ``WorkerSide`` each, with a fake paged KV cache in vLLM's
CPU layout ``[blocks, kv_heads, block_size, 2 * head_dim]``) share one manager: what A saves,
B loads into other blocks, bit for bit; capacity, early finishes and a dead manager serve
no hit and leave the manager idle.
"""
import threading
import time

import numpy as np
import pytest
import torch
from tooling.testing import ThreadedServer
from tooling.vllm_fake import BS, HD, HEADS, KEY, LAYERS, SHAPE, Engine, idle

from radixkv.engine.config import EngineConfig
from radixkv.errors import InvalidArgumentError, InvariantError, StaleSessionError
from radixkv.integrations.vllm.config import ConnectorConfig
from radixkv.integrations.vllm.layout import LayoutMismatchError, paged_kv_views
from radixkv.integrations.vllm.link import ManagerLink
from radixkv.integrations.vllm.scheduler_side import ScheduledReq, vllm_slots
from radixkv.integrations.vllm.worker_side import WorkerSide


def test_b_loads_exactly_what_a_saved(manager):
    a, b = Engine(manager.cfg, seed=1), Engine(manager.cfg, seed=2)
    prompt = list(range(100, 114))  # 3 whole blocks + 2 tokens
    assert a.sched.num_new_matched_tokens("r1", prompt, 0, KEY) == 0
    a_blocks = [5, 2, 9, 1]
    plan, _ = a.step([ScheduledReq("r1", 0, len(prompt))], {"r1": a_blocks})
    assert [(op.start, op.end) for op in plan.saves] == [(0, 12)]
    assert a.sched.counters["committed_requests"] == 1
    a.sched.finished("r1")
    a.sched.flush()  # A's commit is sent in the background; B (another process) sees it once sent
    # B: the same 3 blocks then a different tail; it may load 3 blocks (12 tokens)
    prompt_b = prompt[:12] + [7, 7, 7, 7, 7]
    assert b.sched.num_new_matched_tokens("q1", prompt_b, 0, KEY) == 12
    assert b.sched.num_new_matched_tokens("q1", prompt_b, 0, KEY) == 12  # asked again: same answer, no new lock
    b.sched.after_alloc("q1", 12)
    b_blocks = [3, 11, 0, 6, 4]
    plan, failed = b.step([ScheduledReq("q1", 12, len(prompt_b) - 12)], {"q1": b_blocks})
    assert not failed and [(op.start, op.end) for op in plan.loads] == [(0, 12)]
    assert [(op.start, op.end) for op in plan.saves] == [(12, 16)]
    ka, va = a.token_kv(a_blocks, 12)
    kb, vb = b.token_kv(b_blocks, 12)
    assert torch.equal(ka, kb) and torch.equal(va, vb)
    b.sched.finished("q1")
    assert b.sched.pending == 0 and a.sched.pending == 0
    assert idle(manager, a, b) == (0, 0)
    # another namespace sees nothing
    assert b.sched.num_new_matched_tokens("q2", prompt_b, 0, "vllm|other-model") == 0
    b.sched.finished("q2")
    a.close()
    b.close()


def test_hit_is_capped_below_the_prompt_and_local_hits_are_subtracted(manager):
    a, b = Engine(manager.cfg), Engine(manager.cfg)
    prompt = list(range(200, 216))  # 4 whole blocks
    a.sched.num_new_matched_tokens("r", prompt, 0, KEY)
    a.step([ScheduledReq("r", 0, 16)], {"r": [0, 1, 2, 3]})
    a.sched.finished("r")
    a.sched.flush()
    # the same 16 tokens: at least one is computed, so 3 blocks at most; 1 block local
    assert b.sched.num_new_matched_tokens("s", prompt, 4, KEY) == 8
    b.sched.finished("s")  # never scheduled: released
    assert idle(manager, a, b) == (0, 0)
    a.close()
    b.close()


def test_prompt_longer_than_the_pool_is_computed_not_cached(manager):
    e = Engine(manager.cfg)
    prompt = list(range(1, 127))  # 124 tokens in whole blocks > the 64-slot pool
    assert e.sched.num_new_matched_tokens("big", prompt, 0, KEY) == 0
    assert e.sched.counters["uncacheable_requests"] == 1
    plan, _ = e.step([ScheduledReq("big", 0, len(prompt))], {"big": list(range(16))})
    assert plan[:3] == ([], [], [])
    e.sched.finished("big")
    assert idle(manager, e) == (0, 0)
    e.close()


def test_a_request_finished_before_its_save_is_released(manager):
    e = Engine(manager.cfg)
    prompt = list(range(300, 312))
    e.sched.num_new_matched_tokens("r", prompt, 0, KEY)
    e.step([ScheduledReq("r", 0, 4)], {"r": [1, 2, 3]})  # chunked: one block of three
    e.sched.finished("r")
    assert e.sched.counters["released_requests"] == 1 and e.sched.pending == 0
    assert idle(manager, e) == (0, 0)
    e.close()


def test_a_dead_manager_means_no_hit_and_no_copies(tmp_path):
    tok = tmp_path / "token"
    tok.write_text("x" * 32)
    cfg = ConnectorConfig(address=f"unix://{tmp_path}/none.sock", token_file=str(tok),
                          connect_timeout_s=0.2, retry_interval_s=60)
    e = Engine(cfg)  # register does not need the manager
    assert e.sched.num_new_matched_tokens("r", list(range(16)), 0, KEY) == 0
    plan, failed = e.step([ScheduledReq("r", 0, 16)], {"r": [0, 1, 2, 3]})
    assert plan[:3] == ([], [], []) and not failed
    assert e.sched.link.counters["connect_failures"] >= 1
    e.sched.finished("r")
    e.close()


def test_a_layout_mismatch_names_both_shapes(manager):
    w = WorkerSide(ManagerLink(manager.cfg, "w", keepalive=False, background=False), SHAPE._replace(head_dim=16))
    kv = [torch.zeros(4, HEADS, BS, 32) for _ in range(LAYERS)]
    with pytest.raises(LayoutMismatchError) as ei:
        w.register([(f"l{i}", t) for i, t in enumerate(kv)])
    assert "head_dim=16" in str(ei.value) and "head_dim=8" in str(ei.value)
    with pytest.raises(LayoutMismatchError):
        paged_kv_views(torch.zeros(4, HEADS, BS, 3 * HD), BS, HEADS, HD)


def test_cpu_layout_views_match_the_cpu_backend_split():
    kv = torch.arange(3 * HEADS * BS * 2 * HD, dtype=torch.float32).view(3, HEADS, BS, 2 * HD)
    k, v = paged_kv_views(kv, BS, HEADS, HD)
    key_cache, value_cache = kv.view(3, HEADS, 2 * BS, HD).chunk(2, dim=2)  # what CPU_ATTN does
    assert torch.equal(k, key_cache.permute(0, 2, 1, 3)) and torch.equal(v, value_cache.permute(0, 2, 1, 3))
    k[1, 2] = -1.0
    assert (kv.view(3, HEADS, 2 * BS, HD)[1, :, 2] == -1).all()  # views alias the cache


def test_invariants_name_a_broken_request(manager):
    e = Engine(manager.cfg)
    e.sched.num_new_matched_tokens("r", list(range(400, 408)), 0, KEY)
    e.sched._reqs["r"].issued = 99
    with pytest.raises(InvariantError, match="'r'"):
        e.sched.check_invariants()
    e.sched._reqs["r"].issued = e.sched._reqs["r"].prefix
    e.close()
    assert idle(manager) == (0, 0)


def test_vllm_slots_are_block_major():
    assert vllm_slots([7, 3], 2, 6, 4).tolist() == [30, 31, 12, 13]
    with pytest.raises(InvalidArgumentError):
        vllm_slots([7], 0, 5, 4)


def test_manager_rows_np_int32_prompts_are_accepted(manager):
    e = Engine(manager.cfg)
    assert e.sched.num_new_matched_tokens("r", np.arange(500, 508, dtype=np.int64), 0, KEY) == 0
    e.sched.finished("r")
    e.close()


def test_the_link_reconnects_in_the_background_when_the_manager_comes_up(tmp_path):
    import time

    srv = ThreadedServer(EngineConfig(page_size=BS, layer_types="F" * LAYERS, head_num=HEADS, head_dim=HD))
    tok = tmp_path / "token"
    tok.write_text(srv.token)
    cfg = ConnectorConfig(address=srv.options.address, token_file=str(tok), connect_timeout_s=0.2,
                          retry_interval_s=0.05)
    link = ManagerLink(cfg, "late")
    assert link.get(force=True) is None and link.counters["connect_failures"] >= 1
    srv.start()
    try:
        deadline = time.monotonic() + 30
        while link.get() is None:
            assert time.monotonic() < deadline, "no reconnection"
            time.sleep(0.02)
        client, info = link.get()
        assert client.heartbeat(info.session) > 0
        link.fail(RuntimeError("simulated call failure"))
        assert not link.up and link.counters["call_failures"] == 1
        while link.get() is None:  # back again, a new session
            assert time.monotonic() < deadline, "no reconnection"
            time.sleep(0.02)
        assert link.get()[1].session != info.session
    finally:
        link.close()
        srv.stop()


def test_ops_of_a_manager_epoch_never_mapped_fail_cleanly(manager):
    from radixkv.integrations.vllm.scheduler_side import CopyOp

    e = Engine(manager.cfg)
    before = [t.clone() for t in e.kv]
    op = CopyOp("r", 12345, 0, 0, 8, vllm_slots([6, 2], 0, 8, BS))  # an epoch that is not the manager's
    assert e.worker.load([op]) == {6, 2}  # vLLM recomputes these blocks
    assert all(torch.equal(a, b) for a, b in zip(before, e.kv, strict=True))
    saved, failed = e.worker.save([op])
    assert saved == {} and failed == {"r"}
    assert e.worker.counters["failed_load_tokens"] == 8 and e.worker.counters["failed_save_tokens"] == 8
    e.close()


@pytest.mark.parametrize("layout", ["cpu", "flash_attn"])
def test_row_geometry_addresses_the_same_elements_as_the_views(layout):
    from radixkv.integrations.vllm.layout import row_geometry

    shape = (5, HEADS, BS, 2 * HD) if layout == "cpu" else (2, 5, BS, HEADS, HD)
    kv = torch.arange(int(np.prod(shape)), dtype=torch.float32).view(*shape)
    k, v = paged_kv_views(kv, BS, HEADS, HD)
    geo = row_geometry(kv, (k, v), HD)
    blk, off = torch.tensor([4, 0, 2, 2]), torch.tensor([3, 1, 0, 3])
    kr, vr = geo.rows(blk, off, HEADS)
    flat = kv.view(-1, HD)
    assert torch.equal(flat[kr].view(4, HEADS, HD), k[blk, off])
    assert torch.equal(flat[vr].view(4, HEADS, HD), v[blk, off])


def test_the_view_indexing_fallback_copies_the_same(manager):
    a, b = Engine(manager.cfg, seed=3), Engine(manager.cfg, seed=4)
    b.worker._geometry = None  # force the slower path (layouts whose K/V are not whole rows)
    prompt = list(range(600, 613))
    a.sched.num_new_matched_tokens("r", prompt, 0, KEY)
    a.step([ScheduledReq("r", 0, 13)], {"r": [7, 1, 3, 5]})
    a.sched.finished("r")
    a.sched.flush()
    assert b.sched.num_new_matched_tokens("s", prompt, 0, KEY) == 12
    b.sched.after_alloc("s", 12)
    b.step([ScheduledReq("s", 12, 1)], {"s": [2, 9, 8, 0]})
    assert all(torch.equal(x, y) for x, y in zip(a.token_kv([7, 1, 3, 5], 12), b.token_kv([2, 9, 8, 0], 12),
                                                  strict=True))
    b.sched.finished("s")
    a.close()
    b.close()
    assert idle(manager) == (0, 0)


class _HeldClient:
    """A client whose ``cache_finished`` / ``release`` wait (up to 10 s) for ``go``, and note
    whether ``go`` was set when they ran and in which thread."""

    def __init__(self, inner):
        self._inner = inner
        self.go = threading.Event()
        self.calls: list[tuple[str, bool, bool]] = []  # (method, go was set, in the caller's thread)

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def _held(self, name, *args):
        released = self.go.wait(10)
        self.calls.append((name, released, threading.current_thread() is threading.main_thread()))
        return getattr(self._inner, name)(*args)

    def cache_finished(self, session, rids):
        return self._held("cache_finished", session, rids)

    def release(self, session, rids):
        return self._held("release", session, rids)


def test_the_commit_and_release_leave_the_step_and_land_in_order(manager):
    e = Engine(manager.cfg)
    client, info = e.sched.link.get()
    held = _HeldClient(client)
    e.sched.link._live = (held, info)
    prompt = list(range(700, 712))
    e.sched.num_new_matched_tokens("r", prompt, 0, KEY)
    e.step([ScheduledReq("r", 0, 12)], {"r": [0, 1, 2]})  # returns while the commit waits
    e.sched.finished("r")  # nor does the finish wait
    assert not held.calls and e.sched.pending == 0
    held.go.set()
    # the next match waits for the queued commit: it matches the prefix just committed
    assert e.sched.num_new_matched_tokens("r2", prompt + [1], 0, KEY) == 12
    assert held.calls == [("cache_finished", True, False)]
    e.sched.finished("r2")  # never scheduled: released, not waited for
    assert idle(manager, e) == (0, 0)
    assert [c[0] for c in held.calls] == ["cache_finished", "release"]
    assert e.sched._calls.counters == {"sent": 2, "failed": 0}
    e.close()


def test_a_failed_queued_commit_fails_the_link_and_the_manager_reclaims(manager):
    e = Engine(manager.cfg)
    client, info = e.sched.link.get()

    class Broken(_HeldClient):
        def cache_finished(self, session, rids):
            raise StaleSessionError("lease lost")

    e.sched.link._live = (Broken(client), info)
    prompt = list(range(900, 912))
    e.sched.num_new_matched_tokens("r", prompt, 0, KEY)
    e.step([ScheduledReq("r", 0, 12)], {"r": [0, 1, 2]})
    e.sched.finished("r")
    e.sched.flush()
    assert e.sched.link.counters["call_failures"] == 1 and e.sched._calls.counters["failed"] == 1
    e.sched.check_invariants()
    e.close()
    deadline = time.monotonic() + 10
    while idle(manager) != (0, 0) and time.monotonic() < deadline:  # the session's stream ended
        time.sleep(0.05)
    assert idle(manager) == (0, 0)


def test_a_stale_session_reattaches_at_once_and_the_match_is_retried_there(manager):
    """A manager that answers "stale" (it restarted) is re-attached in the caller's thread and
    the match retried once on the new session: this request is matched, saved and committed
    there, with no wait for the background reconnect (issue 34, item 8)."""
    e = Engine(manager.cfg)
    client, info = e.sched.link.get()

    class Restarted(_HeldClient):
        def alloc_extend(self, session, items):
            raise StaleSessionError("the manager restarted")

    e.sched.link._live = (Restarted(client), info)
    prompt = list(range(1000, 1012))  # 3 whole blocks
    assert e.sched.num_new_matched_tokens("r", prompt, 0, KEY) == 0
    new = e.sched.link.current()
    assert new is not None and new[1].session != info.session
    assert e.sched.link.counters["reattaches"] == 1 and e.sched.link.counters["call_failures"] == 1
    blocks = [4, 5, 6]
    plan, failed = e.step([ScheduledReq("r", 0, 12)], {"r": blocks})
    assert not failed and [(op.start, op.end, op.epoch) for op in plan.saves] == [(0, 12, new[1].session.epoch)]
    assert e.sched.counters["committed_requests"] == 1
    e.sched.finished("r")
    e.sched.flush()
    e.close()


# ------------------------------------------------------------------ what the worker half trusts (issue 34, item 7)
def snapshot(engine):
    """(vLLM's KV, every mapped manager pool's KV) as copies."""
    pools = []
    for wb in engine.worker._buffers.values():
        for layer in range(LAYERS):
            pools.extend(t.clone() for t in wb.get_kv_buffer(layer))
    return [t.clone() for t in engine.kv], pools


def same(a, b):
    return all(torch.equal(x, y) for x, y in zip(a[0] + a[1], b[0] + b[1], strict=True))


def test_rows_ranges_and_slots_from_the_manager_are_checked_before_any_copy(manager):
    """Every row, token range and slot index the manager names is checked against the mapped
    pools before any copy, negative ones included; a bad one fails the load or save (the whole
    batch) and writes nothing on either side."""
    e = Engine(manager.cfg, seed=3)
    try:
        prompt = list(range(300, 314))  # 3 whole blocks + 2 tokens
        assert e.sched.num_new_matched_tokens("good", prompt, 0, KEY) == 0
        plan, _ = e.step([ScheduledReq("good", 0, len(prompt))], {"good": [5, 2, 9, 1]})
        (ok,) = plan.saves
        assert (ok.start, ok.end) == (0, 12)
        wb = e.worker._buffers[ok.epoch]
        rows, width = wb.req_to_token.shape
        four = np.arange(4, dtype=np.int64)
        bad = {
            "row -1 (wraps to the last row)": ok._replace(row=-1, end=4, slots=four),
            "row 0 (padding)": ok._replace(row=0, end=4, slots=four),
            "row past the table": ok._replace(row=int(rows), end=4, slots=four),
            "negative start": ok._replace(start=-4, end=0, slots=four),
            "end past the row": ok._replace(start=int(width) - 2, end=int(width) + 2, slots=four),
            "start after end": ok._replace(start=4, end=0, slots=four[:0]),
            "slots shorter than the range": ok._replace(end=4, slots=four[:2]),
            "negative vLLM slot": ok._replace(end=4, slots=np.array([0, 1, 2, -1], np.int64)),
            "vLLM slot past the cache": ok._replace(end=4, slots=np.array([0, 1, 2, 16 * BS], np.int64)),
        }
        for why, op in bad.items():
            before = snapshot(e)
            saved, failed = e.worker.save([op])
            assert (saved, failed) == ({}, {op.req_id}), why
            loaded = e.worker.counters["loaded_tokens"]
            failed_blocks = e.worker.load([op])  # the blocks it names are reported for recompute
            assert failed_blocks == set((op.slots // BS).tolist()), why
            assert e.worker.counters["loaded_tokens"] == loaded, why
            assert same(before, snapshot(e)), f"{why}: something was written"
        # a good op beside a bad one in the same batch: the batch fails whole, nothing written
        before = snapshot(e)
        assert e.worker.save([ok, bad["row -1 (wraps to the last row)"]])[0] == {}
        assert same(before, snapshot(e))
        assert e.worker.save([ok]) == ({"good": ok.end}, set())  # the good one alone still goes
    finally:
        e.close()

