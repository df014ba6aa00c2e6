"""The cache manager (``radixkv serve``): it owns the engine and answers the workers' calls.

``manager`` (CacheManagerServer, ServeOptions), ``servicer`` (the RPC handlers), ``unary_rpc``
and ``step_stream`` (how a call runs), ``event_hub`` / ``event_outlets`` (KV events out),
``quarantine``, ``idempotency`` (the reply cache), ``metrics``, ``listen``, ``auth`` (the token
check) and ``cli``. Imports :mod:`radixkv.service.wire` and the engine, never the client.
"""
