"""The host tiers through a manager process started from the command line (``radixkv serve
--host-kv-tokens`` / ``--host-state-slots``): the reference model (fp64) in this process
reads and writes the manager's shared memory; over host loads its logits equal the
from-scratch logits (1e-9), KV-only and hybrid (issue 31, item 6, remote); an MLA model's
latents read back bit-equal; a hybrid model with its KV in the host tier too
(``--host-kv-tokens`` beside ``--host-state-slots``), under ``--write-policy write_back`` and
``write_through`` (with ``--enable-kv-events``: the stream names both tiers)."""
import pytest
from radixkv.service.client import connect
from service_util import START_TIMEOUT_S, start_server, stop_server
from tier_workload import (
    mla_fields,
    proof_fields,
    proof_model,
    prove_logits,
    prove_mla_latents,
    replay_logits,
    storage_restart_prompts,
)


def _flags(fields):
    out = []
    for name, value in fields.items():
        out += [f"--{name.replace('_', '-')}", str(value)]
    return out


@pytest.mark.parametrize("pattern, ps, tier", [("FF", 16, {"kv_tokens": 96, "host_kv_tokens": 1024}),
                                               ("KFK", 16, {"kv_tokens": 4096, "state_slots": 5,
                                                            "host_state_slots": 16}),
                                               ("KFK", 1, {"kv_tokens": 4096, "state_slots": 5,
                                                           "host_state_slots": 16}),
                                               ("KFK", 16, {"kv_tokens": 96, "state_slots": 5,
                                                            "host_state_slots": 16, "host_kv_tokens": 1024}),
                                               ("KFK", 16, {"kv_tokens": 96, "state_slots": 5,
                                                            "host_state_slots": 16, "host_kv_tokens": 1024,
                                                            "write_policy": "write_through"})])
def test_manager_process_serves_host_loads_with_from_scratch_logits(pattern, ps, tier):
    model = proof_model(pattern)
    through = tier.get("write_policy") == "write_through"
    srv = start_server(["--device", "cpu", "--check-idle"] + _flags({**proof_fields(model, ps), **tier})
                       + (["--enable-kv-events"] if through else []))
    try:
        with connect(srv.address, token=srv.token, wait_s=START_TIMEOUT_S) as c:
            info = c.attach("proof")
            loaded = prove_logits(c, info.session, c.worker_buffers(info), model, ps, 16 if ps == 1 else 24)
            assert loaded > 0, "nothing came back from the host tier"
            st = c.stats(info.session)
            if "host_kv_tokens" in tier:  # a hybrid model's KV in the host tier too
                assert st.host_loaded_pages > 0 and (st.host_demoted_pages > 0) != through  # copied at insert
            if through:
                media = {(e["type"], e["medium"]) for e in c.take_events(info.session)
                         if e["type"].startswith("Block")}
                assert media == {("BlockStored", "GPU"), ("BlockRemoved", "GPU"), ("BlockStored", "CPU"),
                                 ("BlockRemoved", "CPU")}, media
            if "host_state_slots" in tier:  # the host state tier's counters reach a remote client
                assert st.host_state_slots == 16 and st.host_state_loaded > 0
                assert st.host_state_demoted >= st.host_state_loaded + st.host_state_used
                assert st.host_state_hits >= st.host_state_loaded and st.host_state_hit_tokens > 0
            else:
                assert st.host_state_slots == 0 and st.host_loaded_pages > 0
            c.detach(info.session)
    finally:
        assert stop_server(srv) == 0


def test_manager_process_serves_mla_latents_from_the_host_tier():
    srv = start_server(["--device", "cpu", "--check-idle"]
                       + _flags({**mla_fields(16), "kv_tokens": 96, "host_kv_tokens": 1024}))
    try:
        with connect(srv.address, token=srv.token, wait_s=START_TIMEOUT_S) as c:
            info = c.attach("proof")
            assert prove_mla_latents(c, info.session, c.worker_buffers(info), 16, 24) > 0
            assert c.stats(info.session).host_loaded_pages > 0
            c.detach(info.session)
    finally:
        assert stop_server(srv) == 0


@pytest.mark.parametrize("ps", [16])
def test_hybrid_manager_restarted_on_its_file_storage_serves_kv_and_states(ps, tmp_path):
    """``radixkv serve --storage file:///DIR`` for a hybrid model: a manager stopped (SIGTERM:
    its write queue drained) and started again on the same directory serves the earlier
    prompts' KV and states from storage, logits equal to the from-scratch ones."""
    model = proof_model("KFK")
    flags = ["--device", "cpu", "--check-idle"] + _flags({
        **proof_fields(model, ps), "kv_tokens": 96, "state_slots": 5, "host_state_slots": 16,
        "host_kv_tokens": 1024, "storage": f"file://{tmp_path}", "storage_timeout_ms": 5000})
    for restarted in (False, True):
        srv = start_server(flags)
        try:
            with connect(srv.address, token=srv.token, wait_s=START_TIMEOUT_S) as c:
                info = c.attach("proof")
                wb = c.worker_buffers(info)
                if restarted:
                    loaded = replay_logits(c, info.session, wb, model, storage_restart_prompts(ps, 24))
                    st = c.stats(info.session)
                    assert st.tier_hit_storage > 0 and loaded >= st.tier_hit_storage, (loaded, st)
                else:
                    prove_logits(c, info.session, wb, model, ps, 24)
                c.detach(info.session)
        finally:
            assert stop_server(srv) == 0
