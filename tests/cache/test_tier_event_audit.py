"""The tiered cache's audit of its KV events: every node's pages were last announced on the
tier they are on (``GPU`` with device rows, else ``CPU``); a stale announcement is named."""
import numpy as np
import pytest
from tier_util import make_cache, serve

from radixkv.cache.kv_events import MEDIUM_CPU
from radixkv.errors import InvariantError


def _seq(start, n):
    return np.arange(start * 100, start * 100 + n, dtype=np.int32)


def test_audit_names_a_node_announced_on_another_tier():
    c = make_cache(device_tokens=8, host_tokens=16, events=True)
    serve(c, _seq(1, 8))
    serve(c, _seq(2, 8))  # 1 demoted to the host
    c.check_invariants()
    on_host = [x for x in c.iter_nodes() if x.block_hashes and not x.vbuf]
    assert on_host and all(c.kv_events.medium_of(h) == "CPU" for x in on_host for h in x.block_hashes)
    dev = next(x for x in c.iter_nodes() if x.block_hashes and x.vbuf)
    c.kv_events._media[dev.block_hashes[0]] = MEDIUM_CPU  # an announcement the tree contradicts
    with pytest.raises(InvariantError, match=rf"another tier .*nodes \[{dev.id}\]"):
        c.check_invariants()
