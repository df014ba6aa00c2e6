"""The prefix cache: a radix tree from token prefixes (per namespace) to KV rows.

* :class:`RadixCache` / :class:`MatchResult`: the tree (``radix_cache``; its compiled
  variant ``NativeRadixCache`` there too), its write path (``radix_insert``), eviction
  victims (``leaf_eviction``) and audit (``tree_audit``); the compiled walks (``native``,
  ``csrc/``);
* :class:`MambaRadixCache`: the hybrid-model tree whose nodes also hold Mamba state slots
  (``hybrid/``: ``mamba_radix_cache``; its state table ``state_table``, audit ``mamba_audit``,
  policies ``mamba_policies``, state events ``state_events``);
* :class:`RadixKey`: the compact int32 key (``radix_key``); :class:`TreeNode` (``tree_node``);
* eviction policies (``policies/``), named in one registry (``eviction``: :func:`register_policy`);
* :class:`CacheMetrics` (``metrics``); KV events (``kv_events``); the KV conservation law
  (``kv_conservation``).
"""
from radixkv.cache.eviction import (
    EvictionPolicy,
    available_policies,
    make_policy,
    register_policy,
)
from radixkv.cache.hybrid.mamba_radix_cache import MambaMatchResult, MambaRadixCache
from radixkv.cache.metrics import CacheMetrics, MetricsSnapshot
from radixkv.cache.radix_cache import MatchResult, RadixCache
from radixkv.cache.radix_key import RadixKey
from radixkv.cache.tree_node import NamespaceHead, TreeNode

__all__ = [
    "RadixCache",
    "MatchResult",
    "MambaRadixCache",
    "MambaMatchResult",
    "RadixKey",
    "TreeNode",
    "NamespaceHead",
    "EvictionPolicy",
    "register_policy",
    "make_policy",
    "available_policies",
    "CacheMetrics",
    "MetricsSnapshot",
]
