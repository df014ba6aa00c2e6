"""Pools the shared-memory directory cannot back are refused at start (issue 34, item 1), and
a pool file shrunk under a running manager stops it cleanly instead of killing it by SIGBUS.

The refusals are checked without root (statvfs / posix_fallocate made to report a full
directory) and, as root, on a real 8 MiB tmpfs mounted for the test."""
from __future__ import annotations

import errno
import gc
import glob
import os
import signal
import subprocess
import sys
import tempfile
import textwrap

import numpy as np
import pytest
from radixkv.service.server.manager import CacheManagerServer, ServeOptions
from radixkv.service.wire import shm
from radixkv.service.wire.auth import Token
from radixkv.service.wire.shm import SharedBuffers
from service_util import START_TIMEOUT_S, STOP_TIMEOUT_S, end_serve, popen_serve

from radixkv.engine import EngineConfig, plan_arenas
from radixkv.errors import SharedMemorySpaceError

MIB = 1 << 20
TOKEN = Token("t" * 32)


def pool_bytes(cfg: EngineConfig) -> int:
    return sum(p.total_bytes for p in plan_arenas(cfg).values())


def config_of(mib: float) -> EngineConfig:
    """A config whose pools take about ``mib`` MiB (KV slots of 1 KiB each)."""
    return EngineConfig(kv_tokens=int(mib * 1024), head_num=1, head_dim=64, layer_types="FF", kv_dtype="float32",
                        request_rows=16, max_context_len=256)


def server_in(directory: str, cfg: EngineConfig) -> CacheManagerServer:
    return CacheManagerServer(cfg, TOKEN, ServeOptions(shm_dir=directory))


def test_a_pool_larger_than_the_space_free_is_refused_naming_directory_size_and_free(tmp_path, monkeypatch):
    cfg = config_of(4)
    need = pool_bytes(cfg)
    real = os.statvfs(str(tmp_path))
    free_blocks = (need // 2) // real.f_frsize

    class Full:
        def __getattr__(self, name):
            return free_blocks if name in ("f_bavail", "f_bfree") else getattr(real, name)

    monkeypatch.setattr(shm.os, "statvfs", lambda d: Full())
    with pytest.raises(SharedMemorySpaceError) as e:
        server_in(str(tmp_path), cfg)
    msg = str(e.value)
    assert str(tmp_path) in msg and f"{need:,}" in msg and f"{free_blocks * real.f_frsize:,}" in msg
    assert e.value.requested == need and e.value.available == free_blocks * real.f_frsize
    assert e.value.code == "RESOURCE_EXHAUSTED"
    assert os.listdir(tmp_path) == []  # nothing left behind


def test_a_reservation_the_filesystem_refuses_is_a_space_error_and_leaves_no_file(tmp_path, monkeypatch):
    def enospc(fd, offset, length):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(shm.os, "posix_fallocate", enospc)
    with pytest.raises(SharedMemorySpaceError, match="shared buffer") as e:
        server_in(str(tmp_path), config_of(1))
    assert str(tmp_path) in str(e.value)
    assert os.listdir(tmp_path) == []


def test_pool_files_are_reserved_not_sparse(tmp_path):
    sb = SharedBuffers("cpu", str(tmp_path), prefix="radixkv-1-0123abcd")
    try:
        sb.allocate("kv", 4 * MIB)
        st = os.stat(sb.descriptors["kv"].path)
        assert st.st_size == 4 * MIB and st.st_blocks * 512 >= 4 * MIB  # every byte backed
    finally:
        sb.close()


@pytest.fixture
def tmpfs_8m():
    """An 8 MiB tmpfs mounted for the test (root only), unmounted after it."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root; the statvfs / fallocate tests above cover the refusal without it")
    d = tempfile.mkdtemp(prefix="rkv-tmpfs-")
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m,mode=0700", "tmpfs", d], capture_output=True)
    if r.returncode != 0:
        os.rmdir(d)
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.decode().strip()}")
    try:
        yield d
    finally:
        gc.collect()  # the managers' mappings go with their tensors
        if subprocess.run(["umount", d], check=False).returncode != 0:
            subprocess.run(["umount", "--lazy", d], check=False)  # detached now, freed when unmapped
        os.rmdir(d)


def test_on_a_small_tmpfs_a_pool_that_does_not_fit_is_refused_and_a_second_manager_too(tmpfs_8m):
    with pytest.raises(SharedMemorySpaceError, match="tmpfs") as e:  # ~32 MiB on 8 MiB
        server_in(tmpfs_8m, config_of(32))
    assert e.value.requested > 32 * MIB and e.value.available <= 8 * MIB
    assert os.listdir(tmpfs_8m) == []
    first = server_in(tmpfs_8m, config_of(5))  # fits alone
    try:
        used = pool_bytes(config_of(5))
        assert shm.space_free(tmpfs_8m) <= 8 * MIB - used  # reserved, not sparse
        with pytest.raises(SharedMemorySpaceError):  # fits alone, not beside the first
            server_in(tmpfs_8m, config_of(5))
        first.shared.check_invariants()
    finally:
        first.shared.close()
    assert os.listdir(tmpfs_8m) == []
    del first


# ---------------------------------------------------------------- a pool file shrunk under a process

_SHRINK = textwrap.dedent("""
    import os, sys
    from radixkv.service.wire.shm import SharedBuffers
    sb = SharedBuffers("cpu", sys.argv[1], prefix="radixkv-1-0123abcd")
    t = sb.allocate("kv", 1 << 20)
    t[:] = 1
    os.truncate(sb.descriptors["kv"].path, 0)  # what a careless operator's script does
    t[4096:8192] = 2  # past the end now: SIGBUS without the guard
    print("survived", int(t[4096]), sb.repair_truncated(), os.stat(sb.descriptors["kv"].path).st_size, flush=True)
    sb.close()
""")


def test_a_write_into_a_shrunk_pool_file_is_repaired_not_a_sigbus(tmp_path):
    if not shm.SIGBUS_GUARD:
        pytest.skip("the optional C extension radixkv.service.wire._sigbus is not built (no C compiler)")
    r = subprocess.run([sys.executable, "-c", _SHRINK, str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, f"exit {r.returncode} (SIGBUS is {-signal.SIGBUS}): {r.stderr[-2000:]}"
    out = r.stdout.split("survived", 1)[1]
    assert out.split()[0] == "2" and "faulted on a shrunk pool file" in out and "was cut" not in out
    assert out.split()[-1] == str(1 << 20)  # the size is back


def test_a_manager_whose_pool_file_is_cut_stops_cleanly_with_a_clear_message(tmp_path):
    """A real ``serve`` process: its pool files truncated to 0, then a worker call that
    writes its ``req_to_token`` rows. It must exit 1 naming the cut file, not die by SIGBUS."""
    from radixkv.service.client import connect

    from radixkv.engine.protocol import ExtendItem

    srv = popen_serve(["--shm-dir", str(tmp_path), "--kv-tokens", "2048", "--sweep-interval-s", "0.1",
                       "--log-level", "WARNING"])
    try:
        with connect(srv.address, token=srv.token, wait_s=START_TIMEOUT_S, timeout_s=30) as c:
            s = c.attach("w").session
            for path in glob.glob(os.path.join(str(tmp_path), "radixkv-*.buf")):
                os.truncate(path, 0)
            try:
                c.alloc_extend(s, [ExtendItem("r1", np.arange(1, 65, dtype=np.int32))])
            except Exception:  # noqa: BLE001 - the manager may be stopping: either is fine
                pass
        srv.process.wait(STOP_TIMEOUT_S)  # it stops by itself (a hang is a failure)
        err = srv.log()
    finally:
        code = end_serve(srv, wait_s=1)
    assert code == 1, f"exit {code} (SIGBUS is {-signal.SIGBUS}); stderr: {err[-2000:]}"
    assert "shrunk under the running manager" in err and str(tmp_path) in err, err[-2000:]
    assert not glob.glob(os.path.join(str(tmp_path), "radixkv-*")), "pool files left behind"
