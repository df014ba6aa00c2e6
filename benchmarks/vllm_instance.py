"""One vLLM instance of ``benchmarks/bench_vllm.py``: a ``spawn``-ed process that owns an offline
``vllm.LLM`` and serves the router's requests one at a time over a pipe.

Messages (parent -> instance): ``("run", [(request_id, int32 prompt), ...])`` answers a list
of :data:`Result` dicts in the same order; ``("counters",)`` answers vLLM's own Prometheus
counters of prefix caching (local and external / connector hits, prompt tokens by source);
``("stop",)`` ends the process. At start it answers ``("ready", {"seconds", "block_size"})``
(the engine's block size: vLLM raises it for hybrid models) or ``("error", text)``.

A request is one ``LLM.generate`` call (greedy, ``max_tokens`` tokens, ``ignore_eos``):
* ``cached``: ``RequestOutput.num_cached_tokens``, the prompt tokens vLLM did not compute
  (its prefix-cache hits plus a connector's external hits), so ``prompt - cached`` is what
  this instance prefilled;
* ``ttft``: ``RequestOutput.metrics.first_token_latency`` (vLLM's own, arrival to first token);
* ``wall``: the generate call's wall time seen by the instance;
* ``cpu``: CPU seconds (user + system) this process and its children (an engine core of its
  own) had used when the request started (vLLM's worker processes left out: they busy-poll).

The engine core runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) on one thread
(``OMP_NUM_THREADS=1``, no vLLM thread binding): one instance, one process, one core's worth.
"""
from __future__ import annotations

import os
import sys
import time
import traceback
from typing import Any

from process_group import lead_group

__all__ = ["engine_kwargs", "instance_main"]

Result = dict[str, float]

_COUNTER_PREFIXES = ("vllm:prefix_cache_", "vllm:external_prefix_cache_", "vllm:prompt_tokens")


def engine_kwargs(spec: dict[str, Any]) -> dict[str, Any]:
    """``vllm.LLM`` keyword arguments of an instance ``spec`` (see ``bench_vllm.instance_spec``)."""
    kw: dict[str, Any] = {
        "model": spec["model"], "skip_tokenizer_init": True, "enforce_eager": True,
        "dtype": spec.get("dtype", "float32"), "block_size": spec["block_size"], "enable_prefix_caching": True,
        "max_model_len": spec["max_model_len"], "max_num_seqs": 4,
        "max_num_batched_tokens": spec.get("max_num_batched_tokens") or max(spec["max_model_len"], 2048),
        "kv_cache_memory_bytes": spec["kv_cache_bytes"], "seed": 0, "disable_log_stats": False}
    if int(spec.get("tp", 1)) > 1:
        kw.update(tensor_parallel_size=int(spec["tp"]), distributed_executor_backend="mp")
    if spec.get("kv_transfer_config"):
        from vllm.config import KVTransferConfig

        kw["kv_transfer_config"] = KVTransferConfig(**spec["kv_transfer_config"])
    return kw


def _counters(llm: Any) -> list[tuple[str, dict[str, str], float]]:
    try:
        from vllm.v1.metrics.reader import Counter

        return [(m.name, dict(m.labels), float(m.value)) for m in llm.get_metrics()
                if isinstance(m, Counter) and m.name.startswith(_COUNTER_PREFIXES)]
    except Exception:  # noqa: BLE001 - counters are a cross-check, never the measurement
        return []


def _tree_cpu() -> float:
    """CPU seconds of this process and its children, vLLM's worker processes left out: they
    busy-poll for a second after every step, which would swamp what a request costs."""
    import psutil

    me = psutil.Process()
    total = 0.0
    for p in [me, *me.children(recursive=True)]:
        try:
            if any("VLLM::Worker" in part for part in p.cmdline()):
                continue
            t = p.cpu_times()
        except psutil.Error:  # a child that just ended
            continue
        total += t.user + t.system
    return total


def _serve(conn: Any, llm: Any, max_tokens: int) -> None:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    while True:
        msg = conn.recv()
        if msg[0] == "stop":
            return
        if msg[0] == "counters":
            conn.send(_counters(llm))
            continue
        out: list[Result] = []
        for rid, prompt in msg[1]:
            cpu = _tree_cpu()
            t0 = time.perf_counter()
            (res,) = llm.generate([TokensPrompt(prompt_token_ids=prompt.tolist())], params, use_tqdm=False)
            wall = time.perf_counter() - t0
            m = res.metrics
            out.append({"id": int(rid), "prompt": len(prompt), "cached": int(res.num_cached_tokens or 0),
                        "ttft": float(m.first_token_latency) if m is not None and m.first_token_latency else wall,
                        "wall": wall, "cpu": cpu})
        conn.send(out)


def instance_main(conn: Any, spec: dict[str, Any]) -> None:
    """Entry point of the spawned instance process."""
    lead_group()  # vLLM's own children go with this process when the router stops it
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    os.environ.setdefault("OMP_NUM_THREADS", str(spec.get("threads", 1)))
    os.environ.update(spec.get("env", {}))
    sys.path[:0] = spec.get("sys_path", [])
    try:
        import torch

        torch.set_num_threads(int(spec.get("threads", 1)))
        from vllm import LLM

        t0 = time.perf_counter()
        llm = LLM(**engine_kwargs(spec))
        conn.send(("ready", {"seconds": time.perf_counter() - t0,
                             "block_size": int(llm.llm_engine.vllm_config.cache_config.block_size)}))
    except BaseException:  # noqa: BLE001 - reported to the parent, which stops the run
        conn.send(("error", traceback.format_exc()))
        return
    try:
        _serve(conn, llm, int(spec.get("max_tokens", 1)))
    finally:
        conn.close()


def engine_state_dtypes(spec: dict[str, Any]) -> tuple[str, str]:
    """The (conv, temporal) state dtypes vLLM allocates for a hybrid instance ``spec``: asked of
    vLLM's config and model class (its CPU build keeps GDN's temporal state in float32 on CPUs
    with AVX512-BF16, which a model's config.json cannot tell the manager)."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader.utils import get_model_cls

    kw = {k: v for k, v in engine_kwargs(spec).items() if k in ("model", "skip_tokenizer_init", "dtype", "block_size",
                                                                 "enable_prefix_caching", "max_model_len")}
    vc = EngineArgs(**kw).create_engine_config()
    dtypes = get_model_cls(vc.model_config).get_mamba_state_dtype_from_config(vc)
    conv, temporal = (str(d).removeprefix("torch.") for d in dtypes)
    return conv, temporal
