"""A manager started with ``--host-kv-tokens``: a worker's extends over gRPC come back with
the tokens loaded from the host tier (``ExtendResult.host_len``), and the audit holds."""
import numpy as np
from radixkv.service.client import connect
from service_util import start_server, stop_server

from radixkv.engine.protocol import ExtendItem


def test_remote_extend_reports_host_loads():
    srv = start_server(["--kv-tokens", "64", "--host-kv-tokens", "256", "--write-policy", "write_back"])
    try:
        with connect(srv.address, token=srv.token, wait_s=30) as c:
            s = c.attach("tiers").session
            a = np.arange(1, 49, dtype=np.int32)
            b = np.arange(100, 148, dtype=np.int32)
            for rid, toks in (("a", a), ("b", b)):  # b pushes a to the host tier
                c.alloc_extend(s, [ExtendItem(rid, toks)])
                c.cache_finished(s, [rid])
            res = c.alloc_extend(s, [ExtendItem("a2", np.concatenate([a, a[:4]]))])[0]
            assert res.prefix_len == 48 and res.host_len == 48 and res.storage_len == 0
            c.cache_finished(s, ["a2"])
            c.check_invariants()
    finally:
        stop_server(srv)
