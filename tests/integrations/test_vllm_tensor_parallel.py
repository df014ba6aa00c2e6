"""Tensor parallel through the connector's halves, against a real manager, without vLLM.

The manager's rows hold every KV head; a rank's ``WorkerSide`` copies its own heads
(``head_shard``). What an engine at one TP size saves, an engine at another loads, bit for
bit; a save counts only when every rank's copy is done (``SaveReport``).
"""
import pytest
import torch
from tooling.vllm_fake import KEY, Engine, idle

from radixkv.integrations.vllm.layout import HeadShard, LayoutMismatchError, head_shard
from radixkv.integrations.vllm.scheduler_side import ScheduledReq
from radixkv.integrations.vllm.worker_side import SaveReport


@pytest.mark.parametrize("total, tp, rank, want", [
    (2, 1, 0, HeadShard(0, 2, True)), (2, 2, 1, HeadShard(1, 1, True)), (8, 4, 3, HeadShard(6, 2, True)),
    (2, 4, 0, HeadShard(0, 1, True)), (2, 4, 1, HeadShard(0, 1, False)), (2, 4, 2, HeadShard(1, 1, True)),
    (1, 2, 1, HeadShard(0, 1, False)),
])
def test_head_shard_follows_vllms_split(total, tp, rank, want):
    assert head_shard(total, tp, rank) == want


@pytest.mark.parametrize("total, tp, rank", [(3, 2, 0), (2, 3, 0), (4, 2, 2), (4, 2, -1)])
def test_head_shard_refuses_splits_vllm_cannot_make(total, tp, rank):
    with pytest.raises(LayoutMismatchError):
        head_shard(total, tp, rank)


def _save(engine, rid, prompt, blocks):
    assert engine.sched.num_new_matched_tokens(rid, prompt, 0, KEY) == 0
    plan, _ = engine.step([ScheduledReq(rid, 0, len(prompt))], {rid: blocks})
    assert plan.saves and engine.sched.counters["committed_requests"] >= 1
    engine.sched.finished(rid)
    engine.sched.flush()


def _load(engine, rid, prompt, blocks, want):
    assert engine.sched.num_new_matched_tokens(rid, prompt, 0, KEY) == want
    engine.sched.after_alloc(rid, want)
    plan, failed = engine.step([ScheduledReq(rid, want, len(prompt) - want)], {rid: blocks})
    assert not failed and [(op.start, op.end) for op in plan.loads] == [(0, want)]
    engine.sched.finished(rid)


@pytest.mark.parametrize("tp_save, tp_load", [(2, 1), (1, 2), (4, 1), (1, 4), (2, 4)])
def test_an_engine_at_one_tp_loads_what_another_saved(manager, tp_save, tp_load):
    a, b = Engine(manager.cfg, seed=10 + tp_save, tp=tp_save), Engine(manager.cfg, seed=20 + tp_load, tp=tp_load)
    prompt = list(range(1000 + 100 * tp_save + 10 * tp_load, 1000 + 100 * tp_save + 10 * tp_load + 14))
    a_blocks, b_blocks = [5, 2, 9, 1], [3, 11, 0, 6]
    _save(a, "r", prompt, a_blocks)
    _load(b, "s", prompt, b_blocks, 12)
    ka, va = a.token_kv(a_blocks, 12)
    assert all(torch.equal(x, y) for x, y in zip((ka, va), b.token_kv(b_blocks, 12), strict=True))
    for rank, shard in enumerate(b.shards):  # every rank, replicas included, holds its heads
        kb, vb = b.rank_kv(rank, b_blocks, 12)
        heads = slice(shard.first, shard.first + shard.num)
        assert torch.equal(kb, ka[:, :, heads]) and torch.equal(vb, va[:, :, heads])
    assert idle(manager, a, b) == (0, 0)
    a.close()
    b.close()


def test_a_save_one_rank_failed_is_never_committed(manager):
    a, b = Engine(manager.cfg, seed=30, tp=2), Engine(manager.cfg, seed=31)

    def broken(*args, **kwargs):
        raise RuntimeError("rank 1's copy failed")

    a.workers[1]._copy_rows = broken
    prompt = list(range(2000, 2013))
    assert a.sched.num_new_matched_tokens("r", prompt, 0, KEY) == 0
    a.step([ScheduledReq("r", 0, len(prompt))], {"r": [0, 1, 2, 3]})
    assert a.workers[0].counters["saved_tokens"] == 12 and a.workers[1].counters["failed_save_tokens"] == 12
    a.sched.finished("r")
    assert a.sched.counters["committed_requests"] == 0 and a.sched.counters["released_requests"] == 1
    assert b.sched.num_new_matched_tokens("s", prompt, 0, KEY) == 0  # rank 0's half was not shared
    b.sched.finished("s")
    assert idle(manager, a, b) == (0, 0)
    a.close()
    b.close()


def test_save_report_counts_a_request_saved_only_when_every_rank_saved_it():
    r0, r1 = SaveReport(), SaveReport()
    r0.add({"a": 8, "b": 4, "c": 4}, set())
    r1.add({"a": 4, "b": 4}, {"c"})
    merged = SaveReport(*r0.merged(r1))
    assert merged.ranks == {"a": 2, "b": 2, "c": 1}
    assert merged.complete(2) == ({"a": 4, "b": 4}, {"c"})
    lone = SaveReport(*SaveReport().merged(r0))  # the other rank reported nothing
    assert lone.complete(2) == ({}, {"a", "b", "c"})
    assert r0.complete(1) == ({"a": 8, "b": 4, "c": 4}, set())
