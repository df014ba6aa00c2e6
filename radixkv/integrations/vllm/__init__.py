"""``RadixKVConnector``: vLLM engines share one radixkv cache manager (``docs/vllm.md``).

Use: ``LLM(model=..., kv_transfer_config=KVTransferConfig(kv_connector="RadixKVConnector",
kv_connector_module_path="radixkv.integrations.vllm", kv_role="kv_both",
kv_connector_extra_config={"address": "unix:///run/radixkv-manager/s.sock", "token_file":
...}))``.

Modules (only ``connector`` imports vLLM; the rest is plain radixkv and tested without it):
``config`` (the ``kv_connector_extra_config`` keys), ``layout`` (vLLM's paged KV tensors as
K/V views), ``link`` (the connection to the manager), ``scheduler_side`` (match + lock, load
and save plans, commit / release), ``worker_side`` (the copies), ``first_blocks`` (the index
of the manager's first blocks), ``connector`` (the ``KVConnectorBase_V1`` subclass).
"""
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover  (what mypy sees of the lazy names below)
    from radixkv.integrations.vllm.connector import RadixKVConnector as RadixKVConnector
    from radixkv.integrations.vllm.connector import RadixKVConnectorMetadata as RadixKVConnectorMetadata
    from radixkv.integrations.vllm.connector import RadixKVWorkerMetadata as RadixKVWorkerMetadata

__all__ = ["RadixKVConnector"]


def __getattr__(name: str) -> object:
    # Lazy, so the vLLM-free modules of this package import without vLLM.
    if name in ("RadixKVConnector", "RadixKVConnectorMetadata", "RadixKVWorkerMetadata"):
        from radixkv.integrations.vllm import connector

        return getattr(connector, name)
    raise AttributeError(f"module 'radixkv.integrations.vllm' has no attribute {name!r}")
