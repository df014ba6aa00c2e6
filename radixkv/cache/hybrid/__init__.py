"""The hybrid tree: :class:`MambaRadixCache`, the radix tree of models that mix full attention
with Mamba / KDA layers (a node may also hold the recurrent state after its last token).

It builds on the plain tree of :mod:`radixkv.cache` (which never imports this package):
``mamba_radix_cache`` (the class), ``state_table`` (node <-> state slot), ``state_order``
(state eviction order), ``mamba_policies`` (admission and state eviction orders),
``mamba_audit`` (both conservation laws) and ``state_events`` (the
state events, their codec and recorder).
"""
