"""The prefix cache: a radix tree from token prefixes (per namespace) to KV rows.

* :class:`RadixCache` / :class:`MatchResult`: the tree (``radix_cache``), its request-level
  entry points (``req_cache``) and audit (``tree_audit``);
* :class:`MambaRadixCache`: the hybrid-model tree whose nodes also hold Mamba state slots;
* :class:`RadixKey`: the compact int32 key (``radix_key``); :class:`TreeNode` (``tree_node``);
* eviction policies (``policies/``), named in one registry (``eviction``: :func:`register_policy`);
* :class:`CacheMetrics` (``metrics``); KV events (``events``).
"""
from radixkv.cache.eviction import (
    EvictionPolicy,
    available_policies,
    make_policy,
    register_policy,
)
from radixkv.cache.metrics import CacheMetrics, MetricsSnapshot
from radixkv.cache.radix_cache import MatchResult, RadixCache
from radixkv.cache.radix_key import RadixKey
from radixkv.cache.tree_node import NamespaceHead, TreeNode
from radixkv.cache.mamba_radix_cache import MambaMatchResult, MambaRadixCache

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
