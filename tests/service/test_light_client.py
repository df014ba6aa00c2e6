"""A worker process stays light: ``import radixkv.service.client`` (and ``import radixkv``)
loads no server, servicer, embedded engine, tree, metrics library or kernel compiler.

Each import runs in a fresh interpreter (``subprocess``, never fork), which then reports the
modules it holds."""
import json
import subprocess
import sys

# Module names (and their submodules) a remote worker must not load by importing the client.
HEAVY = (
    "radixkv.service.server",    # the cache manager: server, servicer, event hub, quarantine, ...
    "radixkv.engine.embedded",   # the embedded engine
    "radixkv.engine.pools",      # the engine's pools (and through them the tree)
    "radixkv.cache",             # the trees
    "radixkv.scheduler",
    "radixkv.allocator",
    "radixkv.kernels",
    "prometheus_client",
    "triton",
)


def _modules_after(statement: str) -> list:
    code = f"import json, sys\n{statement}\nprint(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _loaded(modules: list, names) -> list:
    return sorted(m for m in modules for h in names if m == h or m.startswith(h + "."))


def test_importing_the_client_loads_nothing_heavy():
    modules = _modules_after("import radixkv.service.client")
    assert "radixkv.service.client.remote" in modules  # the import did happen
    assert _loaded(modules, HEAVY) == []


def test_the_client_package_exports_connect():
    modules = _modules_after("from radixkv.service.client import RemoteCacheEngine, connect")
    assert _loaded(modules, HEAVY) == []


def test_importing_radixkv_stays_cheap():
    modules = _modules_after("import radixkv")
    assert _loaded(modules, HEAVY + ("radixkv.service", "radixkv.engine", "torch", "grpc")) == []


def test_the_heavy_check_would_catch_the_server():
    """The check above can fail: importing the server does load what it forbids."""
    modules = _modules_after("import radixkv.service.server.manager")
    assert {"radixkv.service.server", "radixkv.engine.embedded", "prometheus_client"} <= set(_loaded(modules, HEAVY))
