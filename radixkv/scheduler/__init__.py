"""The scheduler flow around the cache (seed section 5; SGLang's mem_cache/common.py)."""
from radixkv.scheduler.batch import Batch, ForwardMode  # noqa: F401
from radixkv.scheduler.flow import (  # noqa: F401
    Conservation,
    alloc_for_decode,
    alloc_for_extend,
    check_conservation,
    conservation,
    release_kv_cache,
)
from radixkv.scheduler.req import Req, as_token_array  # noqa: F401
