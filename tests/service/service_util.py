"""Helpers of the service tests: real ``radixkv serve`` processes (multiprocessing spawn,
never fork) on a Unix socket in a fresh 0700 temp directory, always torn down; worker
processes reporting through a queue."""
from __future__ import annotations

import glob
import multiprocessing as mp
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
from typing import NamedTuple

SPAWN = mp.get_context("spawn")
START_TIMEOUT_S = 90  # a spawned child imports torch: slow on a loaded 2-core machine
STOP_TIMEOUT_S = 30


class ServerProc(NamedTuple):
    process: mp.process.BaseProcess
    address: str
    token: str
    directory: str
    socket_path: str

    def shm_files(self) -> list[str]:
        return glob.glob(f"/dev/shm/radixkv-{self.process.pid}-*")


def start_server(extra_args: list[str], target=None) -> ServerProc:
    """A server process with a token file; waits until it answers."""
    from radixkv.service.client import connect
    from radixkv.service.server.cli import main

    directory = tempfile.mkdtemp(prefix="rkv-")  # 0700
    token = secrets.token_urlsafe(24)
    token_file = os.path.join(directory, "token")
    fd = os.open(token_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    os.write(fd, token.encode())
    os.close(fd)
    sock = os.path.join(directory, "s.sock")
    address = f"unix://{sock}"
    argv = ["serve", "--address", address, "--token-file", token_file, "--log-level", "WARNING"] + extra_args
    p = SPAWN.Process(target=target or main, args=(argv,), daemon=True)
    p.start()
    try:
        with connect(address, token=token, wait_s=START_TIMEOUT_S) as c:
            c.stats()
    except BaseException:
        stop_server(ServerProc(p, address, token, directory, sock))
        raise
    return ServerProc(p, address, token, directory, sock)


def stop_server(srv: ServerProc, sig: int = signal.SIGTERM) -> int:
    """SIGTERM (graceful), then SIGKILL if it hangs; removes the temp dir. Returns the exit code."""
    p = srv.process
    if p.is_alive():
        os.kill(p.pid, sig)
        p.join(STOP_TIMEOUT_S)
    if p.is_alive():
        p.kill()
        p.join(10)
    shutil.rmtree(srv.directory, ignore_errors=True)
    return p.exitcode


def run_worker(target, *args, timeout_s: float = START_TIMEOUT_S):
    """Run ``target(*args, queue)`` in a spawned process; return what it reported."""
    q = SPAWN.Queue()
    p = SPAWN.Process(target=target, args=args + (q,), daemon=True)
    p.start()
    try:
        kind, payload = q.get(timeout=timeout_s)
        p.join(30)
    finally:
        if p.is_alive():
            p.kill()
            p.join(10)
    assert kind == "ok", payload
    return payload


class ServeCommand(NamedTuple):
    """A ``radixkv serve`` run as a command (see :func:`popen_serve`)."""

    process: subprocess.Popen
    address: str
    token: str
    directory: str

    def log(self) -> str:
        with open(os.path.join(self.directory, "serve.log")) as f:
            return f.read()


def popen_serve(extra_args: list[str], ulimit: str | None = None) -> ServeCommand:
    """``python -m radixkv serve`` (its exact exit code; stdout and stderr in ``log()``) on a
    socket in a fresh 0700 directory; ``ulimit``: flags of sh's ``ulimit`` applied first.
    Does not wait for it to answer (``connect(..., wait_s=START_TIMEOUT_S)`` does)."""
    directory = tempfile.mkdtemp(prefix="rkv-")
    token = secrets.token_urlsafe(24)
    token_file = os.path.join(directory, "token")
    with open(os.open(token_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as f:
        f.write(token)
    address = f"unix://{directory}/s.sock"
    cmd = [sys.executable, "-m", "radixkv", "serve", "--address", address, "--token-file", token_file] + extra_args
    if ulimit is not None:
        cmd = ["sh", "-c", f"ulimit {ulimit}; exec " + " ".join(cmd)]
    with open(os.path.join(directory, "serve.log"), "w") as log:
        p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    return ServeCommand(p, address, token, directory)


def end_serve(srv: ServeCommand, wait_s: float = STOP_TIMEOUT_S) -> int:
    """Wait up to ``wait_s`` for it to exit by itself, then SIGTERM, then SIGKILL; removes its
    directory. Returns the exit code."""
    p = srv.process
    for stop in (None, p.terminate, p.kill):
        if stop is not None and p.poll() is None:
            stop()
        try:
            p.wait(wait_s)
            break
        except subprocess.TimeoutExpired:
            continue
    shutil.rmtree(srv.directory, ignore_errors=True)
    return p.wait()
