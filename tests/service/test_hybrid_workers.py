"""The cross-process proof for hybrid models: a real ``radixkv serve`` process on a Unix
socket in a fresh temp directory, and two worker processes started with ``spawn`` (gRPC does
not survive fork), each running the reference hybrid model (KDA + full attention, fp64)
over the manager's shared buffers.

Worker A prefills a prompt off the page grid (40 tokens, page 16) and decodes past a page
end (to 49), writing its KV and KDA states into the shared buffers -- and, at each page end
its steps pass, the state there into its ``mamba_ping_pong_track_buffer`` slot (state
tracking) -- and caches it (the tree keeps the tracked state at 48). Worker B extends A's
text plus a continuation: the manager hands it A's KV rows and a fork of that state; B reads
both straight from the shared buffers (its model does), computes only the continuation, then
decodes two greedy tokens. This process (no pools, no cache) recomputes everything from scratch with
``forward_reference``: B's logits must equal it within 1e-9, and the KV and state B saw must
be bit-identical to what A wrote. Bounded in time; the server is always stopped and must
exit 0 leaving no shared-memory file behind.
"""
import json
import traceback

import numpy as np
import pytest
import torch
from service_util import run_worker, start_server, stop_server

PAGE = 16
PROMPT_LEN = 40  # off the page grid: only a tracked state can be cached
A_DECODES = 9  # A ends at 49: its decode passes the page end at 48
CACHED = 48
TOL = 1e-9


def _setup(address, token, name):
    from radixkv.service.client import connect

    from radixkv.demo.workers import demo_model_config
    from radixkv.reference import HybridModel

    torch.set_num_threads(1)
    client = connect(address, token=token, wait_s=60, timeout_s=60)
    info = client.attach(name)
    wb = client.worker_buffers(info)
    return client, info.session, wb, HybridModel(demo_model_config())


def _full_kv(wb, rows):
    """K and V of ``rows`` in every full-attention layer, as numpy (layer order)."""
    rows = torch.as_tensor(rows, dtype=torch.int64)
    out = []
    for lid in wb.config.full_layer_ids:
        k, v = wb.get_kv_buffer(lid)
        out += [k[rows].cpu().numpy().copy(), v[rows].cpu().numpy().copy()]
    return out


def _state(wb, slot):
    """Conv and recurrent state of ``slot`` in every KDA layer, as numpy."""
    out = []
    for lid in wb.config.kda_layer_ids:
        c = wb.mamba2_layer_cache(lid)
        out += [c.conv[0][slot].cpu().numpy().copy(), c.temporal[slot].cpu().numpy().copy()]
    return out


def worker_a(address, token, prompt, q):
    """Prefill ``prompt`` from scratch, decode ``A_DECODES`` greedy tokens writing the tracked
    states, cache it; report its logits, tokens, KV and the last tracked state."""
    try:
        from radixkv.engine.protocol import DecodeItem, ExtendItem
        from radixkv.reference.model import ModelCache

        c, s, wb, model = _setup(address, token, "worker-A")
        mc = ModelCache.over(wb)
        (r,) = c.alloc_extend(s, [ExtendItem("a", prompt)])
        tracked = [(r.track_slot, r.track_seqlen)]
        logits = [model.extend(prompt, 0, r.out_cache_loc[:0], r.out_cache_loc, r.mamba_slot, mc,
                               track_slot=r.track_slot, track_seqlen=r.track_seqlen)]
        fed = [prompt]
        for _ in range(A_DECODES):
            nxt = int(torch.argmax(logits[-1][-1]))
            d = c.alloc_decode(s, [DecodeItem("a", nxt)])
            logits.append(model.decode(torch.tensor([nxt]), d.req_pool_indices, d.seq_lens, d.out_cache_loc,
                                       d.mamba_slots, mc, d.track_slots))
            tracked.append((int(d.track_slots[0]), int(d.seq_lens[0])))
            fed.append(np.array([nxt], dtype=np.int32))
        slot, pos = [t for t in tracked if t[0] > 0][-1]
        rows = wb.req_to_token[r.req_pool_idx, :CACHED].to(torch.int64)
        report = {"prefix_len": r.prefix_len, "logits": torch.cat(logits).cpu().numpy(), "kv": _full_kv(wb, rows),
                  "state": _state(wb, slot), "tracked_at": pos, "tokens": np.concatenate(fed)}
        report["cached_len"] = c.cache_finished(s, ["a"])[0].cached_len
        c.detach(s)
        c.close()
        q.put(("ok", report))
    except BaseException:
        q.put(("error", traceback.format_exc()))


def worker_b(address, token, prompt, continuation, q):
    """Extend ``prompt + continuation`` reusing the cache, decode 2 greedy tokens; report
    the reused KV and forked state as read from the shared buffers, and every logit."""
    try:
        from radixkv.engine.protocol import DecodeItem, ExtendItem, MatchQuery
        from radixkv.reference.model import ModelCache

        c, s, wb, model = _setup(address, token, "worker-B")
        mc = ModelCache.over(wb)
        full = np.concatenate([prompt, continuation]).astype(np.int32)
        (m,) = c.match(s, [MatchQuery(full)])
        (r,) = c.alloc_extend(s, [ExtendItem("b", full)])
        prefix_rows = wb.req_to_token[r.req_pool_idx, :r.start].to(torch.int64)
        report = {"match": tuple(m), "prefix_len": r.prefix_len, "start": r.start,
                  "kv": _full_kv(wb, prefix_rows), "state": _state(wb, r.mamba_slot)}
        out = model.extend(full[r.start:], r.start, prefix_rows, r.out_cache_loc, r.mamba_slot, mc,
                           track_slot=r.track_slot, track_seqlen=r.track_seqlen)
        logits, fed = [out], [full]
        for _ in range(2):
            nxt = int(torch.argmax(logits[-1][-1]))
            d = c.alloc_decode(s, [DecodeItem("b", nxt)])
            logits.append(model.decode(torch.tensor([nxt]), d.req_pool_indices, d.seq_lens, d.out_cache_loc,
                                       d.mamba_slots, mc, d.track_slots))
            fed.append(np.array([nxt], dtype=np.int32))
        report["cached_len"] = c.cache_finished(s, ["b"])[0].cached_len
        report["logits"] = torch.cat(logits).cpu().numpy()
        report["tokens"] = np.concatenate(fed)
        c.detach(s)
        c.close()
        q.put(("ok", report))
    except BaseException:
        q.put(("error", traceback.format_exc()))


@pytest.fixture
def hybrid_server(tmp_path):
    from radixkv.demo.workers import demo_model_config, engine_config_for

    cfg = engine_config_for(demo_model_config(), page_size=PAGE, kv_tokens=1024, state_slots=8, request_rows=4,
                            max_context_len=256)
    path = tmp_path / "engine.json"
    path.write_text(json.dumps(cfg.to_dict()))
    srv = start_server(["--config", str(path), "--check-idle", "--sweep-interval-s", "0.1", "--grace-s", "2"])
    try:
        yield srv
    finally:
        code = stop_server(srv)
    assert code == 0, f"server exited with {code}"
    assert not srv.shm_files(), "shared-memory files left behind"


def test_worker_b_reuses_worker_a_kv_and_state_across_processes(hybrid_server):
    from radixkv.service.client import connect

    from radixkv.demo.workers import demo_model_config
    from radixkv.reference import HybridModel

    rng = np.random.default_rng(7)
    model = HybridModel(demo_model_config())
    prompt = rng.integers(0, model.config.vocab, PROMPT_LEN).astype(np.int32)
    cont = rng.integers(0, model.config.vocab, 9).astype(np.int32)
    srv = hybrid_server

    a = run_worker(worker_a, srv.address, srv.token, prompt)
    a_tokens = a["tokens"]
    assert a["prefix_len"] == 0 and a_tokens.size == PROMPT_LEN + A_DECODES
    assert a["tracked_at"] == CACHED and a["cached_len"] == CACHED  # the decode passed 48
    ref_a = model.forward_reference(a_tokens).numpy()
    assert np.abs(a["logits"] - ref_a).max() <= TOL

    b = run_worker(worker_b, srv.address, srv.token, a_tokens, cont)
    assert b["match"] == (CACHED, CACHED)
    assert b["prefix_len"] == b["start"] == CACHED  # nothing before the tracked state recomputed
    for got, wrote in zip(b["kv"], a["kv"]):  # the KV rows B was handed hold A's K/V, bit for bit
        np.testing.assert_array_equal(got, wrote)
    for got, wrote in zip(b["state"], a["state"]):  # B's slot holds a fork of A's tracked state
        np.testing.assert_array_equal(got, wrote)
    assert any(np.abs(x).max() > 0 for x in b["state"])  # a real state, not a zero start
    tokens = b["tokens"]
    assert tokens.size == a_tokens.size + cont.size + 2
    ref = model.forward_reference(tokens).numpy()
    got = b["logits"]  # positions CACHED .. end-1: the rest of A's text and the continuation, then 2 decodes
    assert got.shape == (tokens.size - CACHED, model.config.vocab)
    diff = np.abs(got - ref[CACHED:]).max()
    assert diff <= TOL, f"logits differ from a from-scratch run by {diff:.3g}"
    assert b["cached_len"] == tokens.size - tokens.size % PAGE

    with connect(srv.address, token=srv.token, wait_s=30) as c:
        st = c.stats()
        c.check_invariants()
    assert st.requests == 0 and st.sessions == 0 and st.state_held == 0 and st.kv_held == 0
    assert st.state_evictable >= 1 and st.state_available + st.state_evictable == st.state_capacity
    assert st.kv_available + st.kv_evictable == st.kv_capacity
