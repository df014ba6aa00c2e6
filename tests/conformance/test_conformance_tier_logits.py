"""The proof of the host tiers, embedded and remote (issue 31, item 6): the reference model
(fp64) runs multi-turn conversations through the engine's buffers with a device pool too
small for them, so cached prefixes go to the host tier and come back; every extend's logits
equal the from-scratch logits within 1e-9. KV-only models with the host KV tier
(``host_kv_tokens``); hybrid models (KDA + attention) with the host state tier
(``host_state_slots``): a state demoted to host memory and loaded back must be bit-equal, or
the recurrent layers' logits drift; and with their full-attention KV in the host tier too
(``host_kv_tokens`` beside ``host_state_slots``). MLA models (latent rows in the host tier): the reference
model has no MLA, so every cached prefix's latents must read back bit-equal to what was
written. Page sizes 1, 16 and 64; invariants after every call."""
import pytest
from conformance_util import Checked
from tier_workload import (
    mla_fields,
    proof_fields,
    proof_model,
    prove_logits,
    prove_mla_latents,
    replay_logits,
    storage_restart_prompts,
)


def _prove(engine_factory, pattern, ps, turn, events=None, **cfg):
    """``prove_logits`` through a fresh engine; ``events`` (a list) receives its events."""
    model = proof_model(pattern)
    raw = engine_factory(**proof_fields(model, ps), **cfg)
    e = Checked(raw)
    info = e.attach("proof")
    loaded = prove_logits(e, info.session, engine_factory.buffers(raw, info), model, ps, turn)
    if events is not None:
        events += e.take_events(info.session)
    return loaded


@pytest.mark.parametrize("ps", [1, 16, 64])
def test_kv_only_logits_over_host_loads(engine_factory, ps):
    kv, turn = (256, 64) if ps == 64 else (96, 24)
    loaded = _prove(engine_factory, "FF", ps, turn, kv_tokens=kv, host_kv_tokens=1024)
    assert loaded > 0, "no KV came back from the host tier"


@pytest.mark.parametrize("ps, events", [(1, False), (16, False), (64, False), (16, True)])
def test_hybrid_logits_over_host_state_loads(engine_factory, ps, events):
    """3 device state slots per running request (its own and two track slots) plus 2 for the
    tree: the 4 conversations' states cannot all stay on the device. With KV events on, the
    recorder's live states follow the demotions and loads (checked by check_invariants)."""
    turn = 64 if ps == 64 else 16
    got: list = []
    loaded = _prove(engine_factory, "KFK", ps, turn, got if events else None, kv_tokens=4096, state_slots=5,
                    host_state_slots=16, enable_kv_events=events)
    assert loaded > 0, "no state came back from the host tier"
    if events:  # the stream names the tier of each state move: demotions to CPU, loads back to GPU
        moves = {(e["type"], e["medium"]) for e in got if e["type"].startswith("State")}
        assert moves == {("StateStored", "GPU"), ("StateRemoved", "GPU"), ("StateStored", "CPU"),
                         ("StateRemoved", "CPU")}, moves


@pytest.mark.parametrize("ps, policy, events", [(1, "write_back", False), (16, "write_back", False),
                                               (64, "write_back", False), (16, "write_back", True),
                                               (1, "write_through", False), (16, "write_through", True),
                                               (64, "write_through", False)])
def test_hybrid_logits_over_host_kv_and_state_loads(engine_factory, ps, policy, events):
    """A hybrid model's full-attention KV in the host tier too (``host_kv_tokens`` beside
    ``host_state_slots``): the device pool holds about one conversation, so a turn's prefix
    comes back from the host, KV pages and state together; under both write policies
    (``write_through``: the pages were copied at insert, an eviction copies none). With KV
    events on, the pages' tier moves are in the stream (the recorder's tiers are audited)."""
    kv, turn = (256, 64) if ps == 64 else (96, 24)
    got: list = []
    loaded = _prove(engine_factory, "KFK", ps, turn, got if events else None, kv_tokens=kv, state_slots=5,
                    host_state_slots=16, host_kv_tokens=1024, write_policy=policy, enable_kv_events=events)
    assert loaded > 0, "nothing came back from the host tier"
    if events:  # demotions store on CPU then remove from GPU, loads the reverse
        moves = {(e["type"], e["medium"]) for e in got if e["type"].startswith("Block")}
        assert moves == {("BlockStored", "GPU"), ("BlockRemoved", "GPU"), ("BlockStored", "CPU"),
                         ("BlockRemoved", "CPU")}, moves


def test_hybrid_host_kv_write_policies_move_pages_differently(engine_factory):
    """The same conversations: ``write_back`` copies pages at eviction (demoted), never at
    insert; ``write_through`` copies at insert and demotes none (a victim had its copy)."""
    out = {}
    for policy in ("write_back", "write_through"):
        model = proof_model("KFK")
        raw = engine_factory(**proof_fields(model, 16), kv_tokens=96, state_slots=5, host_state_slots=16,
                             host_kv_tokens=1024, write_policy=policy)
        e = Checked(raw)
        info = e.attach("proof")
        loaded = prove_logits(e, info.session, engine_factory.buffers(raw, info), model, 16, 24)
        st = e.stats(info.session)
        out[policy] = (loaded > 0, st.host_loaded_pages > 0, st.host_demoted_pages > 0)
    assert out == {"write_back": (True, True, True), "write_through": (True, True, False)}, out


@pytest.mark.parametrize("ps", [1, 16, 64])
def test_mla_latents_over_host_loads(engine_factory, ps):
    kv, turn = (256, 64) if ps == 64 else (96, 24)
    raw = engine_factory(**mla_fields(ps), kv_tokens=kv, host_kv_tokens=1024)
    e = Checked(raw)
    info = e.attach("proof")
    loaded = prove_mla_latents(e, info.session, engine_factory.buffers(raw, info), ps, turn)
    assert loaded > 0, "no latent came back from the host tier"


@pytest.mark.parametrize("ps,kv,host_slots", [(1, 96, 16), (16, 96, 16), (64, 256, 16), (1, 1024, 1)])
def test_hybrid_logits_over_storage_loads_after_a_restart(engine_factory, ps, kv, host_slots, tmp_path):
    """A hybrid model's storage tier (``file:///DIR``): the proof's conversations through one
    engine, which is stopped (its write queue drained); an engine started again on the same
    directory serves their prefixes (KV pages and the state at their end) from storage, and
    every extend's logits, before and after, equal the from-scratch logits within 1e-9. With KV
    events (page size 16) the restarted engine's first events are its storage read's, on ``CPU``.
    One host state slot: a load back holding it evicts a device state without host room."""
    turn = 64 if ps == 64 else 24
    model = proof_model("KFK")
    cfg = dict(proof_fields(model, ps), kv_tokens=kv, state_slots=5, host_state_slots=host_slots,
               host_kv_tokens=1024, storage=f"file://{tmp_path}", storage_timeout_ms=5000.0, enable_kv_events=ps == 16)
    raw = engine_factory(**cfg)
    e = Checked(raw)
    info = e.attach("proof")
    prove_logits(e, info.session, engine_factory.buffers(raw, info), model, ps, turn)
    engine_factory.close()  # the engine stops: its storage write queue is drained
    raw = engine_factory(**cfg)
    e = Checked(raw)
    info = e.attach("proof")
    loaded = replay_logits(e, info.session, engine_factory.buffers(raw, info), model,
                           storage_restart_prompts(ps, turn))
    st = e.stats(info.session)
    assert st.tier_hit_storage > 0 and loaded >= st.tier_hit_storage, (loaded, st)
    if ps == 16:
        first = [(x["type"], x["medium"]) for x in e.take_events(info.session)[:2]]
        assert first == [("BlockStored", "CPU"), ("StateStored", "CPU")], first


@pytest.mark.parametrize("ps,host_slots", [(2, 2), (16, 2), (1, 1)])
def test_hybrid_logits_over_storage_states_for_kv_the_tree_kept(engine_factory, ps, host_slots, tmp_path):
    """Device KV for every conversation but 5 state slots and a 2-slot (or 1-slot) host state table: states
    leave the tree while their KV stays, so a turn's KV match runs past its deepest state and
    the state at its end comes from storage (read onto the tree's node, then loaded); every
    extend's logits equal the from-scratch logits within 1e-9."""
    turn = 24
    model = proof_model("KFK")
    raw = engine_factory(**proof_fields(model, ps), kv_tokens=1024, state_slots=5,
                         host_state_slots=host_slots, host_kv_tokens=1024, storage=f"file://{tmp_path}",
                         storage_timeout_ms=5000.0)
    e = Checked(raw)
    info = e.attach("proof")
    loaded = prove_logits(e, info.session, engine_factory.buffers(raw, info), model, ps, turn)
    assert loaded > 0, "no state came back from the host tier"
    tree = getattr(raw, "tree", None)
    if tree is not None:  # embedded: the tree's counters say storage gave states for kept KV
        assert tree.storage_stats["states_fetched_in_tree"] > 0, tree.storage_stats
