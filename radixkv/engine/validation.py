"""Moved to :mod:`radixkv.validation` (one validation module for every layer).

Temporary re-export for ``radixkv.service.client``, which imports the engine's validators
from here; remove once the service imports :mod:`radixkv.validation` directly.
"""
from radixkv.validation import (  # noqa: F401
    MAX_EXTRA_KEY_LEN,
    MAX_RID_LEN,
    as_items,
    check_count,
    check_extra_key,
    check_priority,
    check_rid,
    check_rids,
    check_token_id,
    check_tokens,
)
