"""The vLLM tests run only where vLLM is installed (``make test`` runs them with the
``.venv-vllm`` interpreter); elsewhere the whole directory is skipped at collection."""
import importlib.util

import pytest

# ``tests/`` is on sys.path (for ``engine_fixtures``), so this very folder is a namespace package
# named ``vllm``: only a regular package (one with an origin) is the real vLLM.
_spec = importlib.util.find_spec("vllm")
if _spec is None or _spec.origin is None:
    collect_ignore_glob = ["test_*.py"]


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "tests/vllm/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(pytest.mark.vllm)
