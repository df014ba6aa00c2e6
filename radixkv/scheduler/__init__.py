"""The scheduler flow around the cache (seed section 5; SGLang's mem_cache/common.py)."""
from radixkv.scheduler.req import Req  # noqa: F401
