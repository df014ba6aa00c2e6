"""Eviction policies beyond the classic ones of :mod:`radixkv.cache.eviction`.

Each module here defines one policy class; :mod:`radixkv.cache.eviction` registers the
built-in ones. A new policy (for example one tuned on real traces) goes in a module of its
own here and calls :func:`radixkv.cache.eviction.register_policy` when imported.
"""
from radixkv.cache.eviction import register_policy
from radixkv.cache.policies.aplru import AdaptiveProbationLRUPolicy

register_policy(AdaptiveProbationLRUPolicy.name, AdaptiveProbationLRUPolicy)
