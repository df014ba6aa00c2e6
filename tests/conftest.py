"""Test set-up shared by the whole suite.

* ``TRITON_INTERPRET=1`` is set before anything imports Triton when no CUDA device is
  present, so Triton kernels run on CPU tensors in the interpreter and can be compared
  with their torch references.
* torch runs single-threaded: the suite's tensors are small, and thread hand-offs cost
  more than they save on a 2-core machine.
* Tests marked ``cuda`` are skipped without a CUDA device.
* Hypothesis gets a CI profile with bounded examples and no deadline (timing never decides
  a test's pass/fail).
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Tiny tensors dominate the suite: intra-op threads only add overhead (and contend on
# small CI machines).
torch.set_num_threads(1)

import pytest  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

settings.register_profile(
    "ci",
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    derandomize=True,
)
settings.register_profile("dev", max_examples=200, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(params=["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
def device(request):
    """Every device test runs on CPU, and on CUDA too where one is present."""
    return torch.device(request.param)
