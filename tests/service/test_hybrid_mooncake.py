"""Two hybrid ``radixkv serve`` managers on one Mooncake Store (remote storage, issue 31 item 6
for hybrid models): what manager A cached, KV pages and the Mamba state at their end, is a
storage hit for a worker of manager B, and the reference model's logits (fp64, ``KFK``) over it
equal the from-scratch logits within 1e-9.

Each manager is its own process (spawn) with ``--storage mooncake://...`` on one
``mooncake_master`` (loopback ports, started here); this process is the worker of both. A's
write queue is waited for through ``stats().storage_pending`` (a bound, never a pass/fail
timing); without Mooncake the test skips, naming what to install.
"""
import time

import pytest
from radixkv.service.client import connect
from service_util import START_TIMEOUT_S, start_server, stop_server
from tier_workload import proof_fields, proof_model, prove_logits, replay_logits, storage_restart_prompts
from tooling.mooncake_master import MooncakeMaster, mooncake_missing

PS, TURN = 16, 24
WAIT_S = 60.0


def _flags(url):
    fields = {**proof_fields(proof_model("KFK"), PS), "kv_tokens": 96, "state_slots": 5, "host_state_slots": 16,
              "host_kv_tokens": 1024, "storage": url, "storage_timeout_ms": 10000}
    out = ["--device", "cpu", "--check-idle"]
    for name, value in fields.items():
        out += [f"--{name.replace('_', '-')}", str(value)]
    return out


def test_a_hybrid_manager_serves_another_ones_kv_and_states_from_mooncake():
    why = mooncake_missing()
    if why is not None:
        pytest.skip(why)
    master = MooncakeMaster()
    master.start()
    url = master.url(segment_bytes="16MiB", buffer_bytes="16MiB", retry_max_ms="500")
    servers = []
    try:
        servers = [start_server(_flags(url)) for _ in range(2)]
        model = proof_model("KFK")
        with connect(servers[0].address, token=servers[0].token, wait_s=START_TIMEOUT_S) as a, \
                connect(servers[1].address, token=servers[1].token, wait_s=START_TIMEOUT_S) as b:
            ia, ib = a.attach("A"), b.attach("B")
            prove_logits(a, ia.session, a.worker_buffers(ia), model, PS, TURN)
            deadline = time.monotonic() + WAIT_S
            while a.stats(ia.session).storage_pending:  # A's backups written (or failed) first
                assert time.monotonic() < deadline, f"A's storage queue not empty within {WAIT_S} s"
                time.sleep(0.1)
            sa = a.stats(ia.session)
            assert sa.storage_written_pages > 0 and sa.storage_write_failed == 0, sa
            loaded = replay_logits(b, ib.session, b.worker_buffers(ib), model, storage_restart_prompts(PS, TURN))
            sb = b.stats(ib.session)
            assert sb.tier_hit_storage > 0 and loaded >= sb.tier_hit_storage, sb
            a.check_invariants()
            b.check_invariants()
            a.detach(ia.session)
            b.detach(ib.session)
    finally:
        codes = [stop_server(s) for s in servers]
        master.stop()
    assert codes == [0] * len(servers)
