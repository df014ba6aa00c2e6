"""Hybrid models (KDA + full attention): requests also hold a Mamba state slot; a prefix
hit forks the cached state into the request's own slot. Skipped until the Mamba-aware tree
(``radixkv.cache.mamba_radix_cache``) exists."""
import importlib.util

import numpy as np
import pytest

from radixkv.engine.protocol import DecodeItem, ExtendItem, MatchQuery

from conformance_util import Checked, assert_law, toks

HYBRID_TREE = "radixkv.cache.mamba_radix_cache"
pytestmark = pytest.mark.skipif(importlib.util.find_spec(HYBRID_TREE) is None,
                                reason=f"hybrid prefix caching needs {HYBRID_TREE}")

HYBRID = dict(layer_types="KKKF" * 2, kda_num_heads=2, kda_head_dim=8, conv_kernel=4, state_slots=16,
              request_rows=8, kv_tokens=512, max_context_len=128)


@pytest.mark.parametrize("ps", [1, 16])
def test_hybrid_life_cycle_and_state_fork(engine_factory, ps):
    e = Checked(engine_factory(page_size=ps, **HYBRID))
    s = e.attach("hybrid").session
    st = e.stats()
    assert st.state_capacity == 16 and st.state_available == 16
    p = toks(np.arange(1, 41))
    (a,) = e.alloc_extend(s, [ExtendItem("a", p)])
    assert a.mamba_slot >= 1 and a.prefix_len == 0
    d = e.alloc_decode(s, [DecodeItem("a", 3)])
    assert d.mamba_slots.tolist() == [a.mamba_slot]
    assert e.stats().state_held >= 1
    e.cache_finished(s, ["a"])
    st = e.stats()
    assert st.requests == 0 and st.state_held == 0
    assert_law(st)
    (m,) = e.match(s, [MatchQuery(np.concatenate([p, toks([3, 9, 9])]))])
    assert 0 < m.prefix_len <= m.kv_prefix_len
    (b,) = e.alloc_extend(s, [ExtendItem("b", np.concatenate([p, toks([3, 9, 9])]))])
    assert b.prefix_len > 0 and b.mamba_slot >= 1 and b.prefix_len % ps == 0
    e.release(s, ["b"])
    st = e.stats()
    assert st.state_held == 0 and st.kv_held == 0
