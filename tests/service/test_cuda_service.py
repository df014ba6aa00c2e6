"""The service on a CUDA device: pools exported through CUDA IPC, mapped by spawned workers
(runs only where CUDA is present)."""
import pytest
import service_workers as workers
import torch
from service_util import run_worker

pytestmark = pytest.mark.cuda


def test_workers_share_kv_through_cuda_ipc():
    from tooling.testing import ThreadedServer

    with ThreadedServer({"device": "cuda", "kv_tokens": 1024}) as srv:
        c = srv.client()
        info = c.attach("probe")
        assert {p["mapping"]["mode"] for p in info.layout["pools"].values()} == {"cuda_ipc"}
        c.detach(info.session)
        prompt = list(range(300, 340))
        a = run_worker(workers.prefill_worker, srv.address, srv.token, "cuda-A", prompt)
        b = run_worker(workers.reuse_worker, srv.address, srv.token, "cuda-B", prompt, [1, 2])
        assert b["prefix_len"] == len(prompt) and b["rows"] == a["loc"] and b["max_abs_diff"] == 0.0
        # what A wrote is in the manager's own device memory
        k = srv.call(lambda server: server.engine.pools.kv_pool.get_key_buffer(0)[torch.tensor(a["loc"])].cpu())
        want, _ = workers.kv_of(prompt, 0, k.shape[1], k.shape[2])
        assert torch.equal(k, want)
        st = c.stats()
        assert st.kv_held == 0 and st.requests == 0
        c.check_invariants()
