"""CacheEngine specifics (beyond the protocol): its request records, rollback on refusal,
the invariant audit catching corruption, sweeping and closing, and an engine living in
file-backed shared memory that a second mapping sees."""
import numpy as np
import pytest
import torch
from engine_fixtures import ManualClock, toks

from radixkv.engine import CacheEngine, EngineConfig, attach_buffers, plan_arenas
from radixkv.engine.protocol import CacheEngineAPI, DecodeItem, ExtendItem
from radixkv.engine.requests import EngineReq
from radixkv.errors import CapacityError, InvalidArgumentError, InvariantError, StaleSessionError


def test_engine_req_buffer_growth_order_and_rollback():
    r = EngineReq.create("r", toks([1, 2, 3]))
    assert r.fill_ids.tolist() == [1, 2, 3] and r.seq_len == 3 and not r.fill_ids.flags.writeable
    r.append_tokens(toks([4, 5]))  # more prompt before any decode
    assert r.origin_input_ids.tolist() == [1, 2, 3, 4, 5] and r.output_ids.size == 0
    m = r.mark()
    for i in range(1000):
        r.append_output(i % 7)
    assert r.seq_len == 1005 and r._buf.size < 2 * 1005 + 32
    r.append_tokens(toks([9, 9]))  # input after decoding goes after the output
    assert r.output_ids[-2:].tolist() == [9, 9] and r.origin_input_ids.size == 5
    assert r.fill_ids.tolist() == [1, 2, 3, 4, 5] + [i % 7 for i in range(1000)] + [9, 9]
    r.rollback(m)
    assert r.fill_ids.tolist() == [1, 2, 3, 4, 5] and r.output_ids.size == 0


def test_config_forms_and_protocol():
    e = CacheEngine({"kv_tokens": 64})
    assert e.config.kv_tokens == 64 and isinstance(e, CacheEngineAPI)
    assert CacheEngine().config == EngineConfig()
    with pytest.raises(InvalidArgumentError):
        CacheEngine("kv_tokens=64")


def test_refused_chunk_and_decode_leave_the_request_as_it_was():
    e = CacheEngine(EngineConfig(kv_tokens=32, max_context_len=64))
    s = e.attach().session
    e.alloc_extend(s, [ExtendItem("a", toks(range(20)))])
    req = e._reqs[(s.session_id, "a")]
    before = (req.fill_ids.copy(), req.kv_committed_len, e.stats())
    with pytest.raises(CapacityError):
        e.alloc_extend(s, [ExtendItem("a", toks(range(20)))])  # 20 more slots, 12 free
    assert np.array_equal(req.fill_ids, before[0]) and req.kv_committed_len == 20 and e.stats() == before[2]
    e.alloc_extend(s, [ExtendItem("b", toks(range(12)))])
    with pytest.raises(CapacityError):
        e.alloc_decode(s, [DecodeItem("a", 1)])
    assert req.seq_len == 20 and req.kv_committed_len == 20
    e.check_invariants()


def test_failed_matches_are_not_counted():
    e = CacheEngine(EngineConfig(kv_tokens=16))
    s = e.attach().session
    with pytest.raises(CapacityError):
        e.alloc_extend(s, [ExtendItem("a", toks(range(10))), ExtendItem("b", toks(range(10)))])
    st = e.stats()
    assert (st.queries, st.queried_tokens, st.hit_tokens) == (0, 0, 0)
    assert e.tree.metrics.queries == 2  # the tree did count them
    e.alloc_extend(s, [ExtendItem("a", toks(range(10)))])
    assert e.stats().queries == 1


def test_audit_catches_leaks_and_orphans():
    e = CacheEngine(EngineConfig(kv_tokens=64))
    s = e.attach().session
    e.alloc_extend(s, [ExtendItem("a", toks(range(5)))])
    e.check_invariants()
    leaked = e.pools.allocator.alloc(2)
    with pytest.raises(InvariantError, match="leaked"):
        e.check_invariants()
    e.pools.allocator.free(leaked)
    e.check_invariants()
    e.sessions.remove_requests(s.session_id, ["a"])  # the engine still has the request
    with pytest.raises(InvariantError, match="a"):
        e.check_invariants()


def test_sweep_close_and_reclaim():
    clock = ManualClock()
    e = CacheEngine(EngineConfig(kv_tokens=64, lease_ttl_s=2.0), clock=clock, epoch=11)
    assert e.epoch == 11
    s1, s2 = e.attach().session, e.attach().session
    e.alloc_extend(s1, [ExtendItem("a", toks(range(5)))])
    e.alloc_extend(s2, [ExtendItem("b", toks(range(5))), ExtendItem("c", toks(range(3)))])
    clock.t = 1.0
    e.heartbeat(s2)
    assert e.sweep(now=2.5) == [s1.session_id]
    assert e.stats().requests == 2
    assert e.reclaim(s2.session_id, "was evicted by the test") == 2
    with pytest.raises(StaleSessionError, match="evicted by the test"):
        e.heartbeat(s2)
    s3 = e.attach().session
    e.alloc_extend(s3, [ExtendItem("d", toks(range(5)))])
    e.close()
    st = e.stats()
    assert st.sessions == 0 and st.requests == 0 and st.kv_held == 0
    with pytest.raises(StaleSessionError, match="shut down"):
        e.heartbeat(s3)
    e.check_invariants()


def test_take_events_in_pieces():
    e = CacheEngine(EngineConfig(kv_tokens=64, enable_kv_events=True))
    s = e.attach().session
    for i in range(3):
        e.alloc_extend(s, [ExtendItem(f"r{i}", toks([i + 1] * 6))])
        e.cache_finished(s, [f"r{i}"])
    first = e.take_events(s, 2)
    rest = e.take_events(s)
    assert len(first) == 2 and len(rest) == 1
    assert [x["token_ids"][0] for x in first + rest] == [1, 2, 3]


def test_engine_in_shared_file_memory_seen_by_a_second_mapping(tmp_path):
    cfg = EngineConfig(kv_tokens=64, request_rows=4, max_context_len=32, head_num=1, head_dim=4)
    plans = plan_arenas(cfg)

    def mapping(name):
        path = tmp_path / f"{name}.bin"
        if not path.exists():
            with open(path, "wb") as f:
                f.truncate(plans[name].total_bytes)
        return torch.from_file(str(path), shared=True, size=plans[name].total_bytes, dtype=torch.uint8)

    mappings = {n: {"mode": "file", "path": f"{n}.bin"} for n in plans}
    e = CacheEngine(cfg, buffers={n: mapping(n) for n in plans}, mappings=mappings)
    info = e.attach("w")
    assert info.layout["pools"]["kv"]["mapping"] == {"mode": "file", "path": "kv.bin"}
    worker = attach_buffers(info.layout, {n: mapping(n) for n in plans})  # a second mapping
    (r,) = e.alloc_extend(info.session, [ExtendItem("a", toks([4, 5, 6]))])
    assert worker.req_to_token[r.req_pool_idx, :3].tolist() == r.out_cache_loc.tolist()
    loc = torch.as_tensor(r.out_cache_loc)
    worker.set_kv_buffer(0, loc, torch.full((3, 1, 4), 1.5), torch.full((3, 1, 4), -1.5))
    k, _ = e.worker_buffers().get_kv_buffer(0)
    assert k[loc].eq(1.5).all()
    e.cache_finished(info.session, ["a"])
    e.check_invariants()
