"""Fixtures of the reliability tests: a pool of chaos worker processes (fresh interpreters,
started ahead of need, never forked) and servers sized for many concurrent victims. Every
fixture kills what it started."""
from __future__ import annotations

import pytest
from reliability_util import CHAOS_CONFIG  # noqa: F401  (re-exported for the tests)

#: Standby workers kept started: twice the kill test's 6 victims at a time. It consumes a few
#: per second, and a standby takes ~0.2 s (idle machine) to over 1 s (2 loaded cores) to start.
STANDBY = int(__import__("os").environ.get("N2STANDBY", "12"))


@pytest.fixture(scope="module")
def chaos():
    from tooling.chaos import StandbyPool

    pool = StandbyPool(standby=STANDBY)
    yield pool
    pool.close()
