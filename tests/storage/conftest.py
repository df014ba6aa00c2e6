"""Fixtures of the storage tests: ``mooncake_master`` on free loopback ports.

``mooncake_master`` is one master per test (the fault tests kill and restart it);
``shared_mooncake`` one per module for the tests that leave it running (each uses its own
keys). A test that needs either skips, saying exactly what to install, where Mooncake cannot run.
"""
import pytest
from tooling.mooncake_master import MooncakeMaster, mooncake_missing


def _master():
    why = mooncake_missing()
    if why is not None:
        pytest.skip(why)
    master = MooncakeMaster()
    master.start()
    return master


@pytest.fixture
def mooncake_master():
    master = _master()
    try:
        yield master
    finally:
        master.stop()


@pytest.fixture(scope="module")
def shared_mooncake():
    master = _master()
    try:
        yield master
    finally:
        master.stop()
