"""Run a snippet in a fresh interpreter under CPython's debug allocator.

``PYTHONMALLOC=debug`` fills freed blocks with a pattern and checks guard bytes, so a C
extension that reads or writes memory it no longer owns fails loudly there (used for the
compiled RadixCache paths: ``tests/cache/test_native_split.py``, ``tests/cache/test_native_rows.py``).
"""
from __future__ import annotations

import os
import subprocess
import sys

__all__ = ["run_under_debug_malloc"]


def run_under_debug_malloc(code: str, timeout_s: float) -> None:
    """Run ``code`` with ``python -c`` under ``PYTHONMALLOC=debug``; it must exit 0 having
    printed exactly ``ok`` (asserts, with the end of its stderr)."""
    env = dict(os.environ, PYTHONMALLOC="debug")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=timeout_s)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "ok", out.stdout[-2000:]
