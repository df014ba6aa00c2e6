"""Connectors that time vLLM's KV connector hooks, for ``vllm_miss_timeline.py`` only.

``TimedRadixKVConnector``: ``RadixKVConnector`` with every hook's start and duration
(``time.perf_counter``: CLOCK_MONOTONIC, comparable across processes) appended to the file
``$RADIXKV_HOOK_TRACE`` as ``pid hook start seconds``. ``NoOpConnector``: a connector that
matches nothing and copies nothing (vLLM's connector machinery alone), timed the same way.
"""
from __future__ import annotations

import functools
import os
import time
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorMetadata

from radixkv.integrations.vllm.connector import RadixKVConnector

HOOKS = ("get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta",
         "update_connector_output", "request_finished", "start_load_kv", "wait_for_layer_load",
         "save_kv_layer", "wait_for_save", "get_finished", "build_connector_worker_meta")


def _timed(name: str, fn: Any) -> Any:
    @functools.wraps(fn)
    def wrapper(self: Any, *a: Any, **k: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(self, *a, **k)
        finally:
            dt = time.perf_counter() - t0
            path = os.environ.get("RADIXKV_HOOK_TRACE")
            if path:
                with open(path, "a", encoding="ascii") as f:
                    f.write(f"{os.getpid()} {name} {t0:.6f} {dt:.6f}\n")
    return wrapper


def _time_hooks(cls: type) -> type:
    for name in HOOKS:
        setattr(cls, name, _timed(name, getattr(cls, name)))
    return cls


@_time_hooks
class TimedRadixKVConnector(RadixKVConnector):
    """``RadixKVConnector``, hooks timed (see the module doc)."""


@_time_hooks
class NoOpConnector(KVConnectorBase_V1):
    """Matches nothing, copies nothing (see the module doc)."""

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        return None

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        return None

    def wait_for_save(self) -> None:
        return None

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        return 0, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        return None

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return KVConnectorMetadata()
