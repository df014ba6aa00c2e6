"""The connector's settings: vLLM's ``kv_connector_extra_config`` dict, validated.

Keys: ``address`` (required: ``unix:///DIR/NAME.sock`` or ``HOST:PORT``); ``token_file``
(else ``$RADIXKV_TOKEN``); ``namespace`` (default: vLLM's model name; engines share entries
only within one, split further by LoRA and ``cache_salt``); ``connect_timeout_s`` (2);
``call_timeout_s`` (10); ``retry_interval_s`` (2: serving without the cache between
tries); ``recompute_load_failures`` (true: vLLM recomputes a load that cannot be done);
``defer_miss_saves`` (``"auto"``: a request whose first block the manager does not hold gets
no hit and no round trip, and is saved off its steps; on when vLLM's engine core runs its own
loop). Unknown keys are refused. Each key: ``docs/vllm.md``, "Config keys".
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from radixkv.errors import InvalidArgumentError

__all__ = ["ConnectorConfig"]


@dataclass(frozen=True)
class ConnectorConfig:
    address: str
    token_file: str | None = None
    namespace: str | None = None
    connect_timeout_s: float = 2.0
    call_timeout_s: float = 10.0
    retry_interval_s: float = 2.0
    recompute_load_failures: bool = True
    defer_miss_saves: bool | str = "auto"

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any] | None) -> ConnectorConfig:
        """From ``kv_connector_extra_config``. Raises ``InvalidArgumentError`` for a missing
        ``address``, an unknown key (listed) or a bad value."""
        d: dict[str, Any] = dict(extra or {})
        known = set(cls.__dataclass_fields__)
        unknown = sorted(str(k) for k in d if k not in known)
        if unknown:
            raise InvalidArgumentError(f"RadixKVConnector: unknown kv_connector_extra_config keys {unknown} "
                                       f"(known: {sorted(known)})")
        addr = d.get("address")
        if not isinstance(addr, str) or not addr:
            raise InvalidArgumentError("RadixKVConnector: kv_connector_extra_config needs 'address' "
                                       "(e.g. 'unix:///run/radixkv-manager/s.sock')")
        for key in ("token_file", "namespace"):
            v = d.get(key)
            if v is not None and (not isinstance(v, str) or not v):
                raise InvalidArgumentError(f"RadixKVConnector: {key} must be a non-empty string, got {v!r}")
        for key in ("connect_timeout_s", "call_timeout_s", "retry_interval_s"):
            if key in d:
                v = d[key]
                if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
                    raise InvalidArgumentError(f"RadixKVConnector: {key} must be a number > 0, got {v!r}")
                d[key] = float(v)
        if "recompute_load_failures" in d and not isinstance(d["recompute_load_failures"], bool):
            raise InvalidArgumentError("RadixKVConnector: recompute_load_failures must be a bool")
        if "defer_miss_saves" in d and not isinstance(d["defer_miss_saves"], bool) and d["defer_miss_saves"] != "auto":
            raise InvalidArgumentError(f"RadixKVConnector: defer_miss_saves must be true, false or 'auto', "
                                       f"got {d['defer_miss_saves']!r}")
        return cls(**d)
