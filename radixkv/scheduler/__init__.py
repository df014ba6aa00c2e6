"""The scheduler flow around the cache (SGLang's mem_cache/common.py)."""
from radixkv.scheduler.batch import Batch, ForwardMode
from radixkv.scheduler.flow import alloc_for_decode, alloc_for_extend, release_kv_cache
from radixkv.scheduler.req import Req
from radixkv.validation import as_token_array

__all__ = ["Batch", "Conservation", "ForwardMode", "Req", "alloc_for_decode", "alloc_for_extend", "as_token_array",
           "check_conservation", "conservation", "release_kv_cache"]
