"""Fixtures of the service tests (helpers in ``service_util``)."""
import pytest
from service_util import start_server, stop_server


@pytest.fixture(scope="module")
def server():
    """One manager for a test module: small CPU pools, 2 s leases, 1 MiB messages,
    invariants checked at every idle sweep."""
    srv = start_server(["--device", "cpu", "--kv-tokens", "2048", "--lease-ttl-s", "2.0",
                        "--sweep-interval-s", "0.1", "--check-idle", "--max-message-bytes", str(1 << 20),
                        "--grace-s", "2", "--enable-kv-events"])
    yield srv
    code = stop_server(srv)
    assert code == 0, f"server exited with {code}"
    assert not srv.shm_files(), "shared-memory files left behind"


@pytest.fixture
def client(server):
    from radixkv.service.client import connect

    c = connect(server.address, token=server.token, wait_s=30, timeout_s=30)
    yield c
    c.close()
