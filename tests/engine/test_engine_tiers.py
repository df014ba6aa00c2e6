"""The embedded engine with the host tier (and storage): configuration, per-tier results,
invariants after every call, and the proof: the reference model's logits computed over KV
loaded back from host memory (and storage) equal the from-scratch logits (fp64, 1e-9) at page
sizes 1 and 16."""
import logging
import sys
import types

import numpy as np
import pytest
import torch
from storage_double import DictStorage
from tier_workload import (
    conversations,
    mla_fields,
    proof_fields,
    proof_model,
    prove_logits,
    prove_mla_latents,
    replay_logits,
    storage_restart_prompts,
)

from radixkv.cache.hybrid.tiered_mamba_cache import TieredMambaRadixCache
from radixkv.cache.tiered_cache import TieredRadixCache
from radixkv.engine.config import EngineConfig
from radixkv.engine.embedded import CacheEngine
from radixkv.engine.protocol import ExtendItem, MatchQuery
from radixkv.errors import InvalidArgumentError
from radixkv.reference import HybridConfig, HybridModel, ModelCache
from radixkv.storage.tier_controller import default_read_threads

VOCAB = 50
TOL = 1e-9


@pytest.mark.parametrize("bad", [dict(host_kv_tokens=-1), dict(host_kv_tokens=10, page_size=4, kv_tokens=64),
                                 dict(write_policy="later"), dict(storage="file:///x"),
                                 dict(host_kv_tokens=64, storage="nourl"), dict(storage_admit="some"),
                                 dict(host_kv_tokens=64, layer_types="FK"), dict(host_state_slots=4),
                                 dict(host_state_slots=-1, layer_types="FK"),
                                 dict(storage_timeout_ms=-1.0), dict(storage_read_threads=-1)])
def test_bad_tier_settings_are_refused(bad):
    with pytest.raises(InvalidArgumentError):
        EngineConfig(**bad)


def test_the_storage_read_threads_reach_the_controller(tmp_path):
    for n, want in ((3, 3), (0, default_read_threads())):
        eng = CacheEngine(EngineConfig(host_kv_tokens=64, storage=f"file://{tmp_path}/s{n}", storage_read_threads=n))
        try:
            assert eng.tree.storage.read_threads == want
        finally:
            eng.close()


def test_host_tier_off_by_default_keeps_the_plain_tree():
    eng = CacheEngine(EngineConfig())
    assert type(eng.tree) is not TieredRadixCache and eng.pools.host_pool is None
    eng2 = CacheEngine(EngineConfig(host_kv_tokens=256))
    assert isinstance(eng2.tree, TieredRadixCache) and eng2.pools.host_pool.num_pages == 256
    eng3 = CacheEngine(EngineConfig(layer_types="FK", host_kv_tokens=256, host_state_slots=8))
    assert isinstance(eng3.tree, TieredMambaRadixCache) and eng3.pools.host_pool.num_pages == 256


@pytest.mark.parametrize("ps", [1, 16])
@pytest.mark.parametrize("policy", ["write_back", "write_through"])
def test_hybrid_host_kv_tier_logits_under_both_policies_with_events(ps, policy):
    """A hybrid model's KV in the host tier with ``write_policy`` and KV events (no longer
    refused): the reference model's logits over host KV + state loads equal the from-scratch
    ones; ``write_through`` copies at insert and demotes nothing, ``write_back`` the reverse;
    the events name both tiers (the recorder's tiers audited after every call)."""
    model = proof_model("KFK")
    eng = CacheEngine(EngineConfig(**proof_fields(model, ps), kv_tokens=96, state_slots=5, host_state_slots=16,
                                   host_kv_tokens=1024, write_policy=policy, enable_kv_events=True))
    assert isinstance(eng.tree, TieredMambaRadixCache) and eng.tree.write_policy == policy
    s = eng.attach("proof").session
    assert prove_logits(eng, s, eng.worker_buffers(), model, ps, 24) > 0
    t = eng.tier_stats()
    assert t["loaded_pages"] > 0
    assert (t["written_through_pages"] > 0, t["demoted_pages"] > 0) == (policy == "write_through",
                                                                        policy == "write_back"), t
    media = {(e["type"], e["medium"]) for e in eng.take_events(s) if e["type"].startswith("Block")}
    assert media == {("BlockStored", "GPU"), ("BlockRemoved", "GPU"), ("BlockStored", "CPU"),
                     ("BlockRemoved", "CPU")}, media
    from radixkv.service.server.metrics import ServiceMetrics

    m = ServiceMetrics()  # what serve --metrics-port exports (it needs every tier counter)
    m.update_tiers(t)
    text = m.exposition().decode()
    assert f'radixkv_tier_pages_total{{move="written_through"}} {float(t["written_through_pages"])}' in text


class Proof:
    """An embedded engine and the reference model (KV-only) on its buffers: every extend's
    logits are compared with forward_reference from scratch."""

    def __init__(self, ps, storage=None, device="cpu", storage_url=None, **cfg):
        base = dict(layer_types="FF", head_num=2, head_dim=8, kv_dtype="float64", page_size=ps,
                    request_rows=4, max_context_len=256, device=device, storage=storage_url)
        base.update(cfg)
        self.eng = CacheEngine(EngineConfig(**base), storage=storage)
        self.session = self.eng.attach("proof").session
        self.wb = self.eng.worker_buffers()
        self.mc = ModelCache.over(self.wb)
        self.model = HybridModel(HybridConfig(vocab=VOCAB, hidden=16, num_heads=2, head_dim=8, layer_pattern="FF",
                                              dtype=torch.float64, seed=5), device)
        self.tiers = np.zeros(3, dtype=np.int64)
        self.n = 0

    def run(self, tokens):
        self.n += 1
        rid = f"r{self.n}"
        res = self.eng.alloc_extend(self.session, [ExtendItem(rid, tokens)])[0]
        row = self.wb.req_to_token[res.req_pool_idx, :res.seq_len].long()
        out = self.model.extend(tokens[res.start:], res.start, row[:res.start], row[res.start:], 0, self.mc)
        ref = self.model.forward_reference(tokens)
        diff = (out - ref[res.start:]).abs().max().item()
        assert diff <= TOL, f"{rid}: logits differ from scratch by {diff:.3g} (host {res.host_len})"
        self.tiers += (res.prefix_len - res.host_len, res.host_len - res.storage_len, res.storage_len)
        self.eng.cache_finished(self.session, [rid])
        self.eng.check_invariants()
        return res


@pytest.mark.parametrize("ps", [1, 16, 64])
@pytest.mark.parametrize("policy", ["write_back", "write_through"])
def test_logits_over_host_loads_equal_the_from_scratch_logits(ps, policy):
    rng = np.random.default_rng(ps)
    kv, turn = (256, 32) if ps == 64 else (96, 24)
    p = Proof(ps, kv_tokens=kv, host_kv_tokens=1024, write_policy=policy)
    for tokens in conversations(rng, 4, 3, turn, VOCAB):  # 4 conversations do not fit the device at once
        p.run(tokens)
    assert p.tiers[1] > 0, "no KV came back from the host tier"
    assert p.eng.tree.tier_stats["loaded_pages"] > 0


@pytest.mark.parametrize("ps", [1, 16])
def test_logits_over_storage_loads_equal_the_from_scratch_logits(ps):
    store = DictStorage()
    rng = np.random.default_rng(7)
    convs = conversations(rng, 4, 2, 16, VOCAB)  # 32 then 48 tokens
    p = Proof(ps, storage=store, kv_tokens=64, host_kv_tokens=64, storage_timeout_ms=5000.0)
    for tokens in convs:
        p.run(tokens)
    p.eng.close()  # drains the storage queue
    q = Proof(ps, storage=store, kv_tokens=64, host_kv_tokens=64, storage_timeout_ms=5000.0)  # a restart
    for tokens in convs[-4:]:
        q.run(np.concatenate([tokens, rng.integers(0, VOCAB, 8).astype(np.int32)]))
    assert q.tiers[2] > 0, "nothing came back from storage after the restart"
    q.eng.close()


@pytest.mark.parametrize("ps", [1, 16])
def test_warm_restart_over_the_file_backend(ps, tmp_path):
    """``storage="file:///DIR"`` through ``open_storage``: a restarted engine on the same
    directory serves the earlier prompts from storage, logits equal to the from-scratch ones."""
    pytest.importorskip("radixkv.storage.url", reason="the file:// backend is not in this build")
    url = f"file://{tmp_path}"
    rng = np.random.default_rng(7)
    convs = conversations(rng, 4, 2, 16, VOCAB)
    p = Proof(ps, storage_url=url, kv_tokens=64, host_kv_tokens=64, storage_timeout_ms=5000.0)
    for tokens in convs:
        p.run(tokens)
    p.eng.close()
    q = Proof(ps, storage_url=url, kv_tokens=64, host_kv_tokens=64, storage_timeout_ms=5000.0)
    for tokens in convs[-4:]:
        q.run(np.concatenate([tokens, rng.integers(0, VOCAB, 8).astype(np.int32)]))
    assert q.tiers[2] > 0
    q.eng.close()


def test_match_counts_host_tokens_and_results_name_the_tiers():
    p = Proof(1, kv_tokens=32, host_kv_tokens=128)
    a = np.arange(30, dtype=np.int32) % VOCAB
    b = (np.arange(30, dtype=np.int32) + 7) % VOCAB
    p.run(a)
    p.run(b)  # a goes to the host
    info = p.eng.match(p.session, [MatchQuery(np.concatenate([a, a[:2]]))])[0]
    assert info.prefix_len == 30
    res = p.run(np.concatenate([a, a[:2]]))
    assert res.prefix_len == 30 and res.host_len == 30 and res.storage_len == 0


@pytest.mark.cuda
@pytest.mark.parametrize("ps", [1, 16])
def test_cuda_host_loads_are_complete_when_the_worker_reads_them(ps):
    """On CUDA the loads run on the host pool's side stream; alloc_extend returns only after
    their events, so the model (on the default stream) reads the loaded rows whole."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    rng = np.random.default_rng(ps)
    p = Proof(ps, device="cuda", kv_tokens=96, host_kv_tokens=512)
    assert p.eng.pools.host_pool.pinned
    for tokens in conversations(rng, 4, 3, 24, VOCAB):
        p.run(tokens)
    assert p.tiers[1] > 0


def test_storage_down_at_start_runs_on_device_and_host(monkeypatch, caplog):
    def refuse(url, *, page_bytes):
        assert page_bytes == 2 * 2 * 2 * 16 * 4  # K and V, 2 layers, 2 heads x 16, fp32
        raise ConnectionRefusedError(f"{url}: nobody listens")

    monkeypatch.setitem(sys.modules, "radixkv.storage.url", types.SimpleNamespace(open_storage=refuse))
    with caplog.at_level(logging.WARNING):
        eng = CacheEngine(EngineConfig(host_kv_tokens=64, storage="mooncake://127.0.0.1:1"))
    assert isinstance(eng.tree, TieredRadixCache) and eng.tree.storage is None
    assert any("unavailable" in r.getMessage() for r in caplog.records)
    eng.close()


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("ps", [1, 16])
def test_seeded_stress_batches_with_loads_evictions_and_aborts(seed, ps):
    """Batches of 1-3 requests sharing prefixes over a device pool that holds about one of
    them: loads, demotions and drops interleave inside one alloc_extend; some requests are
    aborted instead of cached. Every logit equals the from-scratch one; the audit holds."""
    rng = np.random.default_rng(seed)
    p = Proof(ps, kv_tokens=128, host_kv_tokens=192, request_rows=4,
              write_policy=["write_back", "write_through"][seed % 2])
    stems = [rng.integers(0, VOCAB, 32).astype(np.int32) for _ in range(4)]
    for step in range(16):
        k = int(rng.integers(1, 4))
        items = []
        for j in range(k):
            stem = stems[int(rng.integers(0, 4))]
            cut = int(rng.integers(8, 33))
            toks = np.concatenate([stem[:cut], rng.integers(0, VOCAB, int(rng.integers(1, 12))).astype(np.int32)])
            items.append(ExtendItem(f"s{step}-{j}", toks))
        res = p.eng.alloc_extend(p.session, items)
        for it, r in zip(items, res):
            row = p.wb.req_to_token[r.req_pool_idx, :r.seq_len].long()
            out = p.model.extend(it.token_ids[r.start:], r.start, row[:r.start], row[r.start:], 0, p.mc)
            ref = p.model.forward_reference(it.token_ids)
            assert (out - ref[r.start:]).abs().max().item() <= TOL
            p.tiers += (r.prefix_len - r.host_len, r.host_len - r.storage_len, r.storage_len)
        p.eng.check_invariants()
        done = [it.rid for it in items]
        if rng.random() < 0.25:
            p.eng.release(p.session, done)
        else:
            p.eng.cache_finished(p.session, done)
        p.eng.check_invariants()
    assert p.tiers[1] > 0, f"no host loads in the run: {p.tiers}"


@pytest.mark.parametrize("ps", [1, 16, 64])
@pytest.mark.parametrize("policy", ["write_back", "write_through"])
def test_mla_latents_over_host_loads_equal_what_the_model_wrote(ps, policy):
    """An MLA pool's latent rows demote to and load from the host tier (a page row: every
    layer's latent): every cached prefix reads back bit-equal (the reference model has no
    MLA, so the oracle is the latents themselves)."""
    kv, turn = (256, 32) if ps == 64 else (96, 24)
    eng = CacheEngine(EngineConfig(kv_tokens=kv, host_kv_tokens=1024, write_policy=policy, **mla_fields(ps)))
    assert eng.pools.host_pool is not None and eng.pools.host_pool.page_bytes == 2 * ps * 8 * 8
    s = eng.attach("mla").session
    assert prove_mla_latents(eng, s, eng.worker_buffers(), ps, turn) > 0, "nothing came back from the host tier"
    assert eng.stats().host_loaded_pages > 0


def test_mla_pages_in_storage_round_trip_and_are_keyed_apart_from_mha():
    """An MLA manager's pages go to storage and come back (a second engine on the same store),
    under a fingerprint of its own: an MHA layout of the same row width never loads them."""
    from radixkv.engine.pools import kv_fingerprint

    store = DictStorage()
    fields = mla_fields(16)
    mha = {**fields, "kv_lora_rank": 0, "qk_rope_head_dim": 0}
    assert kv_fingerprint(EngineConfig(**fields)) != kv_fingerprint(EngineConfig(**mha))
    tokens = (np.arange(64, dtype=np.int32) * 7) % 50
    a = CacheEngine(EngineConfig(kv_tokens=96, host_kv_tokens=256, **fields), storage=store)
    s = a.attach().session
    (r,) = a.alloc_extend(s, [ExtendItem("w", tokens)])
    pool = a.worker_buffers().kv_pool
    rows = a.worker_buffers().req_to_token[r.req_pool_idx, :r.seq_len].long()
    for layer in range(2):
        pool.kv_buffer[layer][rows] = torch.arange(64 * 8, dtype=torch.float64).view(64, 1, 8) + 1000 * layer
    a.cache_finished(s, ["w"])
    a.close()  # drains the backups
    b = CacheEngine(EngineConfig(kv_tokens=96, host_kv_tokens=256, **fields), storage=store)
    s = b.attach().session
    (r,) = b.alloc_extend(s, [ExtendItem("r", np.concatenate([tokens, tokens[:5]]))])
    assert (r.prefix_len, r.storage_len) == (64, 64)
    rows = b.worker_buffers().req_to_token[r.req_pool_idx, :64].long()
    for layer in range(2):
        want = torch.arange(64 * 8, dtype=torch.float64).view(64, 1, 8) + 1000 * layer
        assert torch.equal(b.worker_buffers().kv_pool.kv_buffer[layer][rows], want)
    b.close()
    c = CacheEngine(EngineConfig(kv_tokens=96, host_kv_tokens=256, **mha), storage=store)
    assert c.match(c.attach().session, [MatchQuery(tokens)])[0].prefix_len == 0
    c.close()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_hybrid_host_state_tier_is_built_and_counts_host_hits(device):
    """``host_state_slots`` gives the hybrid tree a HostStatePool (pinned on CUDA); a state
    demoted there is a hit for ``match`` (``host_len``) and ``alloc_extend`` loads it back,
    the logits after it equal the from-scratch ones."""
    from radixkv.demo.workers import engine_config_for

    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    model = HybridModel(HybridConfig(vocab=VOCAB, hidden=16, num_heads=2, head_dim=8, layer_pattern="KF",
                                     dtype=torch.float64, seed=5), device)
    eng = CacheEngine(engine_config_for(model.config, state_slots=4, host_state_slots=4, request_rows=2,
                                        max_context_len=64, device=device))
    assert eng.pools.host_state_pool.pinned == (device == "cuda")
    assert eng.pools.host_state_pool is not None and eng.tree.host_state_pool is eng.pools.host_state_pool
    s = eng.attach("h").session
    mc = ModelCache.over(eng.worker_buffers())
    a = np.arange(12, dtype=np.int32) % VOCAB
    (r,) = eng.alloc_extend(s, [ExtendItem("a", a)])
    model.extend(a, 0, r.out_cache_loc[:0], r.out_cache_loc, r.mamba_slot, mc)
    eng.cache_finished(s, ["a"])
    assert eng.tree.evict(0, 1).num_states == 1  # demoted: no device state left
    info = eng.match(s, [MatchQuery(np.concatenate([a, a[:3]]))])[0]
    assert (info.prefix_len, info.host_len) == (12, 12)
    b = np.concatenate([a, a[:3]])
    (r,) = eng.alloc_extend(s, [ExtendItem("b", b)])
    assert (r.prefix_len, r.host_len) == (12, 12)
    row = eng.worker_buffers().req_to_token[r.req_pool_idx, :r.seq_len].long()
    out = model.extend(b[12:], 12, row[:12], row[12:], r.mamba_slot, mc)
    assert (out - model.forward_reference(b)[12:]).abs().max().item() <= TOL
    eng.cache_finished(s, ["b"])
    eng.check_invariants()
    assert eng.tree.host_state_counters()["host_states_loaded"] == 1
    st = eng.stats()  # the host state tier in stats() (what a remote client gets) and the metrics
    assert (st.host_state_slots, st.host_state_used, st.host_state_demoted, st.host_state_loaded,
            st.host_state_dropped, st.host_state_hits, st.host_state_hit_tokens) == (4, 0, 1, 1, 0, 2, 24)
    assert st.host_capacity == 0  # no host KV tier
    from radixkv.service.server.metrics import ServiceMetrics

    m = ServiceMetrics()
    m.update_tiers(eng.tier_stats())
    text = m.exposition().decode()
    assert 'radixkv_host_state_slots{state="capacity"} 4.0' in text
    assert 'radixkv_host_states_total{move="loaded"} 1.0' in text
    assert "radixkv_host_state_hit_tokens_total 24.0" in text and "radixkv_host_tier_tokens" not in text


def _hybrid_engine(ps, storage_url=None, storage=None, **tier):
    """An embedded engine for the KFK proof model with both host tiers and storage."""
    model = proof_model("KFK")
    kv = 256 if ps == 64 else 96
    cfg = dict(proof_fields(model, ps), kv_tokens=kv, state_slots=5, host_state_slots=16, host_kv_tokens=1024,
               storage=storage_url, storage_timeout_ms=5000.0)
    cfg.update(tier)
    eng = CacheEngine(EngineConfig(**cfg), storage=storage)
    info = eng.attach("proof")
    return model, eng, info.session, eng.worker_buffers()


@pytest.mark.parametrize("ps, policy, events", [(1, "write_back", False), (16, "write_back", True),
                                                (64, "write_back", False), (16, "write_through", True)])
def test_hybrid_warm_restart_over_the_file_backend(ps, policy, events, tmp_path):
    """A hybrid engine on ``file:///DIR``, stopped and started again on the same directory:
    the restarted one serves the earlier prompts (KV and state) from storage, and every
    extend's logits equal the from-scratch ones (fp64, 1e-9), before and after. With KV
    events the restarted engine's first events are the storage read's, on ``CPU``."""
    turn = 64 if ps == 64 else 24
    model, eng, s, wb = _hybrid_engine(ps, f"file://{tmp_path}", write_policy=policy, enable_kv_events=events)
    assert isinstance(eng.tree, TieredMambaRadixCache) and eng.tree.storage is not None
    prove_logits(eng, s, wb, model, ps, turn)
    eng.close()  # drains the write queue
    model, eng, s, wb = _hybrid_engine(ps, f"file://{tmp_path}", write_policy=policy, enable_kv_events=events)
    prompts = storage_restart_prompts(ps, turn)
    info = eng.match(s, [MatchQuery(prompts[0])])[0]  # read from storage into the host tier
    assert info.storage_len == info.host_len == (len(prompts[0]) - 8) // ps * ps, info
    if events:
        first = eng.take_events(s)[:2]
        assert [(e["type"], e["medium"]) for e in first] == [("BlockStored", "CPU"), ("StateStored", "CPU")], first
        assert len(first[0]["block_hashes"]) == info.storage_len // ps
        assert first[1]["block_hash"] == first[0]["block_hashes"][-1]
    loaded = replay_logits(eng, s, wb, model, prompts)
    st = eng.stats()
    assert st.tier_hit_storage > 0 and loaded >= st.tier_hit_storage, (loaded, st)
    assert eng.tree.storage_stats["states_fetched"] > 0
    eng.close()


def test_hybrid_storage_down_at_start_runs_on_device_and_host(monkeypatch, caplog):
    """A hybrid engine whose storage cannot be reached at start runs on its device and host
    tiers (warned once), and still proves its logits over host loads."""
    def refuse(url, *, page_bytes):
        raise ConnectionRefusedError(f"{url}: nobody listens")

    monkeypatch.setitem(sys.modules, "radixkv.storage.url", types.SimpleNamespace(open_storage=refuse))
    with caplog.at_level(logging.WARNING):
        model, eng, s, wb = _hybrid_engine(16, "mooncake://127.0.0.1:1")
    assert isinstance(eng.tree, TieredMambaRadixCache) and eng.tree.storage is None
    assert sum("unavailable" in r.getMessage() for r in caplog.records) == 1
    assert prove_logits(eng, s, wb, model, 16, 24) > 0
    eng.close()


@pytest.mark.parametrize("ps", [1, 16])
def test_hybrid_logits_over_storage_loads_within_a_run(ps):
    """A hybrid engine whose host tier holds about one conversation: host drops send its
    prefixes away, and storage (the write queue drained after each request) brings them back
    within the same run, KV and state, logits equal to the from-scratch ones."""
    store = DictStorage()
    model, eng, s, wb = _hybrid_engine(ps, storage=store, host_kv_tokens=96, host_state_slots=4)
    convs = conversations(np.random.default_rng(ps), 4, 3, 24, model.config.vocab)
    for i, tokens in enumerate(convs):
        replay_logits(eng, s, wb, model, [tokens], prefix=f"t{i}-")
        assert eng.tree.storage.drain(10.0)
    st = eng.stats()
    assert st.tier_hit_storage > 0 and st.host_dropped_pages > 0, st
    eng.close()


@pytest.mark.parametrize("damage", ["corrupt", "truncate", "delete_dir"])
def test_hybrid_storage_faults_cost_hits_never_logits(damage, tmp_path):
    """A hybrid engine's file tier damaged between a stop and a restart (every page and state
    file flipped or truncated, or the directory deleted): the restarted engine serves no
    storage hit, counts the damaged files, and its logits equal the from-scratch ones; what it
    writes then is served to the next restart (a deleted directory is recreated)."""
    import shutil

    ps, turn, url = 16, 24, f"file://{tmp_path}/s"
    model, eng, s, wb = _hybrid_engine(ps, url)
    prove_logits(eng, s, wb, model, ps, turn)
    eng.close()
    files = [p for p in (tmp_path / "s").rglob("*.page")]
    assert files
    for p in files:
        if damage == "corrupt":
            raw = bytearray(p.read_bytes())
            raw[5] ^= 0x5A
            p.write_bytes(bytes(raw))
        elif damage == "truncate":
            p.write_bytes(p.read_bytes()[:-9])
    if damage == "delete_dir":
        shutil.rmtree(tmp_path / "s")
    prompts = storage_restart_prompts(ps, turn)
    model, eng, s, wb = _hybrid_engine(ps, url)
    replay_logits(eng, s, wb, model, prompts)
    st = eng.stats()
    assert st.tier_hit_storage == 0, st
    if damage == "corrupt":  # read and found corrupt (a truncated file fails the size check first)
        assert eng.tree.storage.backend.stats().corrupt > 0
    eng.close()
    model, eng, s, wb = _hybrid_engine(ps, url)
    loaded = replay_logits(eng, s, wb, model, [np.concatenate([p, p[:4]]) for p in prompts])
    assert eng.stats().tier_hit_storage > 0 and loaded > 0
    eng.close()
