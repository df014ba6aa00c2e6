"""benchmarks/vllm_configs.py's ``radixkv-storage`` side: one manager per instance on one store.

No vLLM here: the managers start from a hand-written ``config.json``; what an instance would
attach to is checked through the public client (a page computed through one manager is a
storage hit for the other: the run's store is shared, and empty at its start)."""
import json
import os
import time

import numpy as np
import pytest

from radixkv.engine.protocol import ExtendItem
from radixkv.errors import InvalidArgumentError

PAGE = 16


@pytest.fixture
def spec(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({
        "model_type": "llama", "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
        "hidden_size": 16, "head_dim": 8, "dtype": "float32"}))
    return {"model": str(model), "block_size": PAGE, "manager_kv_tokens": 256, "max_model_len": 128}


def _connect(cfg):
    import radixkv

    extra = cfg["kv_connector_extra_config"]
    with open(extra["token_file"]) as f:
        return radixkv.connect(extra["address"], token=f.read(), wait_s=30, timeout_s=60)


def _run(client, rid, tokens):
    session = client.attach(rid).session
    try:
        res = client.alloc_extend(session, [ExtendItem(rid, tokens)])[0]
        client.cache_finished(session, [rid])
        return res
    finally:
        client.detach(session)


def test_two_managers_share_the_runs_store(spec, tmp_path):
    from vllm_configs import shared_side

    store = tmp_path / "store"
    store.mkdir()
    tokens = np.arange(3 * PAGE + 1, dtype=np.int32)
    with shared_side("radixkv-storage", spec, storage=f"file://{store}", instances=2,
                     manager_args="--device cpu --storage-timeout-ms 10000") as cfgs:
        assert isinstance(cfgs, list) and len(cfgs) == 2
        extras = [c["kv_connector_extra_config"] for c in cfgs]
        assert extras[0]["address"] != extras[1]["address"]
        assert all(e["defer_miss_saves"] is False for e in extras)
        a, b = (_connect(c) for c in cfgs)
        try:
            assert _run(a, "a1", tokens).prefix_len == 0
            [run_dir] = os.listdir(store)  # this run's own place in the store
            deadline = time.monotonic() + 60  # the backup follows the insert (a bound, not a timing)
            while sum(len(f) for _, _, f in os.walk(store / run_dir)) < 3 and time.monotonic() < deadline:
                time.sleep(0.05)
            res = _run(b, "b1", tokens)
            assert (res.prefix_len, res.storage_len) == (3 * PAGE, 3 * PAGE)
        finally:
            a.close()
            b.close()


def test_needs_a_storage_url(spec):
    from vllm_configs import shared_side

    with pytest.raises(InvalidArgumentError, match="--storage"), shared_side("radixkv-storage", spec):
        pass


def test_cli_storage_flag_adds_the_configuration(capsys):
    import bench_vllm

    assert bench_vllm.main(["--dry-run", "--configs", "local,radixkv-storage"]) == 2
    assert "needs --storage URL" in capsys.readouterr().err
    assert bench_vllm.main(["--dry-run", "--json", "-", "--storage", "file:///nowhere"]) == 0
    assert '"shared_hit_tokens": 8256' in capsys.readouterr().out
