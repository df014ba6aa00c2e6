"""A ``mooncake_master`` on free loopback ports, for tests and benchmarks.

:func:`mooncake_missing` says exactly what to install when Mooncake cannot run here (the
Python package, or Debian's ``libibverbs1`` that its binaries link even for TCP).
:class:`MooncakeMaster` starts the master (RPC server and its HTTP metadata server) on
ports free at start, waits until both accept connections, and can be killed and started
again on the same ports (the fault tests). Its ``url()`` is a ``mooncake://`` storage URL.
"""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time

from radixkv.storage.mooncake import INSTALL_HINT

__all__ = ["INSTALL_HINT", "MooncakeMaster", "free_port", "mooncake_missing"]



def mooncake_missing() -> str | None:
    """Why Mooncake cannot run here (with what to install), or ``None`` when it can."""
    try:
        from mooncake.store import MooncakeDistributedStore  # noqa: F401
    except ImportError as exc:
        return f"Mooncake unavailable ({exc}): {INSTALL_HINT}"
    if _master_binary() is None:
        return f"mooncake_master not found next to {sys.executable}: {INSTALL_HINT}"
    return None


def _master_binary() -> str | None:
    here = os.path.join(os.path.dirname(sys.executable), "mooncake_master")
    return here if os.access(here, os.X_OK) else shutil.which("mooncake_master")


def free_port() -> int:
    """A loopback TCP port nobody listens on now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _accepts(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2):
            return True
    except OSError:
        return False


class MooncakeMaster:
    """``start()`` / ``kill()`` (SIGKILL, waited for) / ``stop()`` a master on fixed free ports.

    ``extra`` flags go to the master as given (e.g. ``--default_kv_lease_ttl=1000``). Its log
    goes to a temporary file, removed by ``stop()``.
    """

    def __init__(self, extra: tuple[str, ...] = ()) -> None:
        self.metadata_port, self.rpc_port, self.metrics_port = free_port(), free_port(), free_port()
        self.extra = extra
        self._proc: subprocess.Popen[bytes] | None = None
        self._log = tempfile.NamedTemporaryFile(prefix="mooncake-master-", suffix=".log", delete=False)

    def url(self, **params: object) -> str:
        """A ``mooncake://`` URL for this master (loopback, TCP), with extra query ``params``."""
        query = {"metadata": f"http://127.0.0.1:{self.metadata_port}/metadata", "protocol": "tcp",
                 "local_host": "127.0.0.1", **params}
        return f"mooncake://127.0.0.1:{self.rpc_port}?" + "&".join(f"{k}={v}" for k, v in query.items())

    def start(self, timeout_s: float = 30.0) -> None:
        """Start the master and wait until its RPC and metadata ports accept connections."""
        binary = _master_binary()
        if binary is None:
            raise RuntimeError(f"mooncake_master not found: {INSTALL_HINT}")
        cmd = [binary, "--enable_http_metadata_server=true", "--http_metadata_server_host=127.0.0.1",
               f"--http_metadata_server_port={self.metadata_port}", "--rpc_address=127.0.0.1",
               f"--rpc_port={self.rpc_port}", "--metrics_host=127.0.0.1", f"--metrics_port={self.metrics_port}",
               "--enable_metric_reporting=false", "--rpc_thread_num=2", *self.extra]
        self._proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout_s
        while not (_accepts(self.rpc_port) and _accepts(self.metadata_port)):
            if self._proc.poll() is not None or time.monotonic() > deadline:
                self.kill()
                with open(self._log.name, errors="replace") as f:
                    tail = f.read()[-2000:]
                raise RuntimeError(f"mooncake_master did not start: {tail}")
            time.sleep(0.05)

    def kill(self) -> None:
        """SIGKILL the master (if running) and wait for it."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait(timeout=30)
        self._proc = None

    def stop(self) -> None:
        """Kill the master and remove its log."""
        self.kill()
        self._log.close()
        if os.path.exists(self._log.name):
            os.unlink(self._log.name)
