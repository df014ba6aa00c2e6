"""A chaos worker (a victim of the kill-cycle test and the soak) loads no torch.

A kill cycle consumes one fresh interpreter, so its start is what a cycle costs: with torch
(pulled in through the wire codec, the contracts and the engine config) a start took ~2 CPU-s
on this project's machine, without it ~0.3 CPU-s. A worker writes KV through ``mmap`` and
speaks gRPC: it needs neither torch nor the engine. Checked in a fresh interpreter."""
import json
import subprocess
import sys

from tooling.chaos import TOOLING_PARENT, WORKER_MODULE

HEAVY = ("torch", "radixkv.engine.embedded", "radixkv.cache", "radixkv.allocator")


def test_the_chaos_worker_module_loads_no_torch():
    code = f"import json, sys\nimport {WORKER_MODULE}\nprint(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, check=True,
                         cwd=TOOLING_PARENT)
    modules = json.loads(out.stdout.strip().splitlines()[-1])
    assert WORKER_MODULE in modules
    assert sorted(m for m in modules for h in HEAVY if m == h or m.startswith(h + ".")) == []
