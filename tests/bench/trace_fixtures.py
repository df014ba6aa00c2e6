"""Trace helpers shared by the hit-rate tests: the tiny Mooncake-format trace they write to
a temp file, and the path of a full Mooncake trace when one is available."""
import os

#: Six requests in Mooncake's JSONL layout: shared chains 0-1-..., a second root 4.
ROWS = [
    {"timestamp": 0, "input_length": 10, "output_length": 3, "hash_ids": [0, 1, 2]},
    {"timestamp": 1, "input_length": 12, "output_length": 1, "hash_ids": [0, 1, 3]},
    {"timestamp": 2, "input_length": 5, "output_length": 2, "hash_ids": [4, 5]},
    {"timestamp": 3, "input_length": 9, "output_length": 2, "hash_ids": [0, 1, 6]},
    {"timestamp": 4, "input_length": 16, "output_length": 2, "hash_ids": [0, 1, 3, 7]},
    {"timestamp": 5, "input_length": 6, "output_length": 2, "hash_ids": [4, 8]},
]


def bundled_trace(name, shared_fallback=False):
    """The path of Mooncake trace ``name`` bundled in ``radixkv.data`` or, with
    ``shared_fallback``, the shared copy beside the repository; None when absent."""
    try:
        from radixkv.data import mooncake_trace

        p = str(mooncake_trace(name))
        if os.path.isfile(p):
            return p
    except ImportError:
        pass
    if shared_fallback:
        p = os.path.join(os.path.dirname(__file__), "..", "..", "..", "shared", "traces", "mooncake",
                         f"{name}_trace.jsonl")
        if os.path.isfile(p):
            return p
    return None
