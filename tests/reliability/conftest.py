"""Fixtures of the reliability tests: a pool of chaos worker processes (fresh interpreters,
started ahead of need, never forked) and servers sized for many concurrent victims. Every
fixture kills what it started."""
from __future__ import annotations

import pytest
from reliability_util import CHAOS_CONFIG  # noqa: F401  (re-exported for the tests)

#: Standby workers kept started: twice the kill test's 6 victims at a time. It consumes a few
#: per second, and a standby takes ~0.2 s (idle machine) to over 1 s (2 loaded cores) to start.
STANDBY = int(__import__("os").environ.get("N2STANDBY", "12"))
#: How long the pool may take to have its first standby ready: an interpreter start at nice
#: +10 took over 60 s once at load 20 (2 cores), so far beyond that.
STANDBY_START_S = 600.0


@pytest.fixture(scope="module")
def chaos():
    from tooling.chaos import StandbyPool

    pool = StandbyPool(standby=STANDBY, timeout_s=STANDBY_START_S)
    yield pool
    pool.close()
