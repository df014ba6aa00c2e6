"""The vLLM tests run only where vLLM is installed (``make test`` runs them with the
``.venv-vllm`` interpreter); elsewhere the whole directory is skipped at collection."""
import importlib.util

import pytest

if importlib.util.find_spec("vllm") is None:
    collect_ignore_glob = ["test_*.py"]


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "tests/vllm/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(pytest.mark.vllm)
