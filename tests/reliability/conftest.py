"""Fixtures of the reliability tests: a chaos zygote (cheap worker processes) and servers
sized for many concurrent victims. Every fixture kills what it started."""
from __future__ import annotations

import pytest

from reliability_util import CHAOS_CONFIG  # noqa: F401  (re-exported for the tests)


@pytest.fixture(scope="module")
def zygote():
    from radixkv.service.chaos import Zygote

    z = Zygote()
    yield z
    z.close()
