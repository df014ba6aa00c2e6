"""The registry of the RadixCache's eviction policies: every built-in policy by name, in one
table (:data:`BUILTIN_POLICIES`), and the functions that look names up.

The interface and its contract are in :mod:`radixkv.cache.policies.base`; each policy is a
module of :mod:`radixkv.cache.policies`. A policy of your own::

    register_policy("mine", MyPolicy)        # then RadixCache(..., eviction_policy="mine")

or pass an instance (``RadixCache(..., eviction_policy=MyPolicy())``) without registering.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType

from radixkv.cache.policies.aplru import AdaptiveProbationLRUPolicy
from radixkv.cache.policies.base import (
    EvictionPolicy,
    FIFOPolicy,
    FILOPolicy,
    LFUPolicy,
    LRUPolicy,
    MRUPolicy,
    PriorityPolicy,
)
from radixkv.cache.policies.slru import SLRUPolicy
from radixkv.errors import InvalidArgumentError

# The policy classes are importable from here too (one import for the cache and its users).
__all__ = [
    "EvictionPolicy",
    "BUILTIN_POLICIES",
    "register_policy",
    "make_policy",
    "available_policies",
]

PolicyFactory = Callable[[], EvictionPolicy]

#: Every policy the package ships, by name (read-only; :func:`register_policy` adds others).
BUILTIN_POLICIES: Mapping[str, PolicyFactory] = MappingProxyType({
    cls.name: cls
    for cls in (LRUPolicy, LFUPolicy, FIFOPolicy, FILOPolicy, MRUPolicy, PriorityPolicy,
                SLRUPolicy, AdaptiveProbationLRUPolicy)
})

_REGISTRY: dict[str, PolicyFactory] = dict(BUILTIN_POLICIES)


def register_policy(name: str, factory: PolicyFactory, *, replace: bool = False) -> None:
    """Make ``factory`` (a zero-argument callable returning an :class:`EvictionPolicy`,
    typically the class) available as ``eviction_policy=name`` (case-insensitive).

    Raises:
        InvalidArgumentError: an empty name, a non-callable factory, or a name taken
            (unless ``replace``).
    """
    if not isinstance(name, str) or not name.strip():
        raise InvalidArgumentError(f"policy name must be a non-empty str, got {name!r}")
    if not callable(factory):
        raise InvalidArgumentError(f"policy factory for {name!r} is not callable")
    key = name.strip().lower()
    if key in _REGISTRY and not replace:
        raise InvalidArgumentError(f"eviction policy {key!r} is already registered")
    _REGISTRY[key] = factory


def make_policy(policy: str | EvictionPolicy) -> EvictionPolicy:
    """A fresh policy for a registered name, or ``policy`` itself if it is an instance.

    Raises:
        InvalidArgumentError: an unknown name (the message lists the known ones), or a
            factory that does not return an ``EvictionPolicy``.
    """
    if isinstance(policy, EvictionPolicy):
        return policy
    if not isinstance(policy, str):
        raise InvalidArgumentError(f"eviction_policy must be a name or an EvictionPolicy, got {policy!r}")
    factory = _REGISTRY.get(policy.strip().lower())
    if factory is None:
        raise InvalidArgumentError(
            f"unknown eviction policy {policy!r}; known: {', '.join(available_policies())}"
        )
    made = factory()
    if not isinstance(made, EvictionPolicy):
        raise InvalidArgumentError(f"factory of {policy!r} returned {type(made).__name__}, not an EvictionPolicy")
    return made


def available_policies() -> list[str]:
    """Registered policy names, sorted."""
    return sorted(_REGISTRY)
