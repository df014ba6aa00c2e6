"""KV events for cluster routers: radixkv's cache events in the formats routers consume.

* :mod:`~radixkv.events.vllm_wire`: vLLM's msgpack ``KVEventBatch`` bytes (encode / decode);
* :mod:`~radixkv.events.zmq_publisher`: vLLM's ZMQ outlet (PUB + replay ROUTER);
* :mod:`~radixkv.events.dynamo`: NVIDIA Dynamo ``KvCacheEvent`` JSON and its ``tokens_hash``;
* :mod:`~radixkv.events.state_index`: the index of hybrid models' state events (the events
  themselves and their recorder are :mod:`radixkv.cache.hybrid.state_events`);
* :mod:`~radixkv.events.sources`: draining a cache, recorder or engine.

The names below load their module on first use, so one outlet's dependency (``pyzmq``,
``msgpack``, ``xxhash``) is needed only by whoever uses that outlet. The byte layouts and
how to run everything are in ``docs/events.md``.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover  (what mypy sees of the lazy names below)
    from radixkv.cache.hybrid.state_events import HybridEventRecorder as HybridEventRecorder
    from radixkv.cache.hybrid.state_events import StateRemoved as StateRemoved
    from radixkv.cache.hybrid.state_events import StateStored as StateStored
    from radixkv.cache.hybrid.state_events import any_event_from_dict as any_event_from_dict
    from radixkv.cache.hybrid.state_events import split_state_events as split_state_events
    from radixkv.events.dynamo import DynamoEventAdapter as DynamoEventAdapter
    from radixkv.events.dynamo import DynamoNamespace as DynamoNamespace
    from radixkv.events.dynamo import compute_block_hash_for_seq as compute_block_hash_for_seq
    from radixkv.events.dynamo import default_namespace as default_namespace
    from radixkv.events.dynamo import dynamo_seed as dynamo_seed
    from radixkv.events.dynamo import tokens_hashes as tokens_hashes
    from radixkv.events.sources import drain_events as drain_events
    from radixkv.events.state_index import StateIndex as StateIndex
    from radixkv.events.state_index import UsableOverlap as UsableOverlap
    from radixkv.events.vllm_wire import decode_batch as decode_batch
    from radixkv.events.vllm_wire import encode_batch as encode_batch
    from radixkv.events.zmq_flags import PublisherConfig as PublisherConfig
    from radixkv.events.zmq_publisher import ZmqEventPublisher as ZmqEventPublisher

_EXPORTS = {
    "HybridEventRecorder": "radixkv.cache.hybrid.state_events", "StateRemoved": "radixkv.cache.hybrid.state_events",
    "StateStored": "radixkv.cache.hybrid.state_events", "any_event_from_dict": "radixkv.cache.hybrid.state_events",
    "split_state_events": "radixkv.cache.hybrid.state_events",
    "StateIndex": "radixkv.events.state_index", "UsableOverlap": "radixkv.events.state_index",
    "decode_batch": "radixkv.events.vllm_wire", "encode_batch": "radixkv.events.vllm_wire",
    **dict.fromkeys(("DynamoEventAdapter", "DynamoNamespace", "compute_block_hash_for_seq", "default_namespace",
                     "dynamo_seed", "tokens_hashes"), "radixkv.events.dynamo"),
    "drain_events": "radixkv.events.sources",
    "ZmqEventPublisher": "radixkv.events.zmq_publisher", "PublisherConfig": "radixkv.events.zmq_flags",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> object:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'radixkv.events' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
