"""The connector's start-up checks and its worker reports under vLLM's own aggregation, with
vLLM imported but no engine started (fast)."""
from copy import copy
from types import SimpleNamespace

import pytest
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, KVConnectorOutput

from radixkv.errors import InvalidArgumentError
from radixkv.integrations.vllm.connector import MLA_ON_CPU, RadixKVWorkerMetadata, _refuse_unsupported
from radixkv.integrations.vllm.layout import LayoutMismatchError


def vllm_config(kv_heads=2, mla=False, **parallel):
    pc = dict(tensor_parallel_size=1, pipeline_parallel_size=1, prefill_context_parallel_size=1,
              decode_context_parallel_size=1)
    pc.update(parallel)
    pc["world_size"] = pc["tensor_parallel_size"] * pc["pipeline_parallel_size"]
    mc = SimpleNamespace(model="tiny", is_hybrid=False, use_mla=mla, get_total_num_kv_heads=lambda: kv_heads)
    return SimpleNamespace(model_config=mc, parallel_config=SimpleNamespace(**pc),
                           cache_config=SimpleNamespace(cache_dtype="auto"))


def test_tensor_parallel_is_accepted_when_vllm_can_split_the_heads():
    for tp in (1, 2, 4):  # 4 ranks over 2 heads: each head replicated on 2 ranks
        _refuse_unsupported(vllm_config(tensor_parallel_size=tp), None)
    with pytest.raises(LayoutMismatchError, match="3 tensor-parallel ranks"):
        _refuse_unsupported(vllm_config(tensor_parallel_size=3), None)


@pytest.mark.parametrize("key", ["pipeline_parallel_size", "prefill_context_parallel_size",
                                 "decode_context_parallel_size"])
def test_pipeline_and_context_parallel_are_refused_by_name(key):
    with pytest.raises(InvalidArgumentError, match=f"{key}=2 is not supported: each"):
        _refuse_unsupported(vllm_config(**{key: 2}), None)


def test_mla_on_vllms_cpu_build_is_refused_with_the_reason_unless_asked_for():
    with pytest.raises(InvalidArgumentError, match="uses MLA on CPU") as ei:
        _refuse_unsupported(vllm_config(mla=True), None)
    assert MLA_ON_CPU in str(ei.value)
    for tp in (1, 2):  # one latent head, on every rank
        _refuse_unsupported(vllm_config(mla=True, tensor_parallel_size=tp), None, mla_on_cpu=True)


def _output(meta, finished=None):
    out = copy(EMPTY_MODEL_RUNNER_OUTPUT)
    out.kv_connector_output = KVConnectorOutput(finished_sending=finished, kv_connector_worker_meta=meta)
    return out


def _report(saved, failed=()):
    r = RadixKVWorkerMetadata()
    r.add(saved, set(failed))
    return r


def test_a_save_is_done_only_when_every_rank_reported_it_through_vllms_aggregator():
    agg = KVOutputAggregator(expected_finished_count=2)
    step = agg.aggregate([_output(_report({"a": 32, "b": 64})), _output(_report({"a": 32}, ["c"]))])
    meta = step.kv_connector_output.kv_connector_worker_meta
    assert meta.complete(2) == ({"a": 32}, {"b", "c"})
    # rank 0 had nothing to report: rank 1's report alone is not a save
    step = agg.aggregate([_output(None), _output(_report({"d": 32}))])
    assert step.kv_connector_output.kv_connector_worker_meta.complete(2) == ({}, {"d"})
    # a kept request is finished sending (its blocks freed) once both ranks said so
    assert agg.aggregate([_output(None, {"k"}), _output(None)]).kv_connector_output.finished_sending is None
    assert agg.aggregate([_output(None), _output(None, {"k"})]).kv_connector_output.finished_sending == {"k"}
