"""Adapters that plug radixkv into serving engines.

* ``radixkv.integrations.vllm``: ``RadixKVConnector``, a vLLM v1 KV connector that shares
  one radixkv cache manager between vLLM engine processes (``docs/vllm.md``).

Each adapter imports its engine lazily: ``import radixkv`` never needs one installed.
"""
