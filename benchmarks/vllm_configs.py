"""The configurations of ``benchmarks/bench_vllm.py``: what each instance's ``kv_transfer_config`` is
and which shared process (if any) runs beside the instances.

* ``local``: vLLM's own prefix caching only (no connector, nothing shared);
* ``radixkv``: one ``radixkv serve`` manager shaped by ``--model-config`` (page size = vLLM's
  block size) on a Unix socket with a token file, every instance attached through
  ``radixkv.integrations.vllm.RadixKVConnector``;
* ``lmcache``: one LMCache multi-process server, every instance attached through vLLM's
  ``LMCacheMPConnector`` (only where ``lmcache`` imports and runs);
* ``radixkv-storage``: one manager *per instance* (its own device pool and host tier), all on
  one shared storage tier (``--storage URL``, e.g. a Mooncake Store: an empty place of this
  run's own, :func:`radixkv.bench.cluster_procs.storage_for_run`); each instance's connector
  asks its manager on every request (``defer_miss_saves`` off: the first-block index knows the
  manager's own tree, not the store).

:func:`shared_side` is a context manager: it starts the side processes, waits until they
listen, yields the ``kv_transfer_config`` dict (``None`` for ``local``; a list of one per
instance for ``radixkv-storage``), and stops them on exit.
"""
from __future__ import annotations

import contextlib
import os
import secrets
import shlex
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from typing import Any

from radixkv.errors import InvalidArgumentError

__all__ = ["CONFIGS", "shared_side"]

CONFIGS = ("local", "radixkv", "lmcache", "radixkv-storage")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _listening(where: str) -> bool:
    """``where``: a socket file's path, or ``tcp:PORT`` on localhost."""
    if not where.startswith("tcp:"):
        return os.path.exists(where)
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", int(where[4:]))) == 0


def _wait_for(where: str, proc: subprocess.Popen[bytes], timeout_s: float, what: str, log: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not _listening(where):
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode} before listening; log:\n{_tail(log)}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} not listening after {timeout_s:.0f} s; log:\n{_tail(log)}")
        time.sleep(0.2)


def _tail(path: str, n: int = 4000) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read()[-n:]
    except OSError:
        return "(no log)"


def _stop(proc: subprocess.Popen[bytes], grace_s: float = 10.0) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _manager_cmd(d: str, spec: dict[str, Any], extra: list[str]) -> list[str]:
    state: list[str] = []
    if spec.get("hybrid"):  # 3 state slots per request in flight (own + 2 track), the rest the tree's
        from vllm_instance import engine_state_dtypes

        state = ["--state-slots", "256", "--temporal-state-dtype", engine_state_dtypes(spec)[1]]
    return [sys.executable, "-m", "radixkv", "serve", "--address", f"unix://{d}/s.sock",
            "--token-file", os.path.join(d, "token"), "--model-config", spec["model"],
            "--page-size", str(spec["block_size"]), "--kv-tokens", str(spec["manager_kv_tokens"]),
            "--max-context-len", str(spec["max_model_len"]),
            "--enable-kv-events", *state, *extra]  # the events feed the connector's first-block index


def _manager(d: str, spec: dict[str, Any], extra: list[str]) -> tuple[list[str], str, dict[str, Any]]:
    """A manager in directory ``d`` (its token file written): command, socket, connector config."""
    tok = os.path.join(d, "token")
    with open(tok, "w", encoding="utf-8") as f:
        f.write(secrets.token_hex(16))
    os.chmod(tok, 0o600)
    cfg = {"kv_connector": "RadixKVConnector", "kv_connector_module_path": "radixkv.integrations.vllm",
           "kv_role": "kv_both", "kv_connector_extra_config": {"address": f"unix://{d}/s.sock", "token_file": tok}}
    return _manager_cmd(d, spec, extra), os.path.join(d, "s.sock"), cfg


@contextlib.contextmanager
def _managers_on_storage(spec: dict[str, Any], storage: str, n: int, manager_args: str,
                         log_dir: str | None) -> Iterator[list[dict[str, Any]]]:
    """``n`` managers, each with a host tier as large as its device pool and ``storage``
    narrowed to a place of this run's own; one connector config each (no first-block index)."""
    from radixkv.bench.cluster_procs import storage_for_run

    url = storage_for_run(storage, f"bench-vllm-{os.getpid()}-{time.time_ns()}")
    tier = ["--host-kv-tokens", str(spec["manager_kv_tokens"]), "--storage", url, "--storage-timeout-ms", "1000"]
    with contextlib.ExitStack() as stack:
        cfgs, procs = [], []
        for k in range(n):
            d = stack.enter_context(tempfile.TemporaryDirectory(prefix=f"bench-vllm-storage{k}-"))
            cmd, ready, cfg = _manager(d, spec, [*tier, *shlex.split(manager_args)])
            cfg["kv_connector_extra_config"]["defer_miss_saves"] = False
            log = os.path.join(log_dir or d, f"radixkv-storage-manager{k}.log")
            with open(log, "wb") as out:
                proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=d)
            stack.callback(_stop, proc)
            procs.append((proc, ready, log))
            cfgs.append(cfg)
        for k, (proc, ready, log) in enumerate(procs):
            _wait_for(ready, proc, 180.0, f"radixkv-storage manager {k}", log)
        yield cfgs


@contextlib.contextmanager
def shared_side(name: str, spec: dict[str, Any], *, manager_args: str = "", lmcache_args: str = "",
                log_dir: str | None = None, storage: str | None = None,
                instances: int = 1) -> Iterator[dict[str, Any] | list[dict[str, Any]] | None]:
    """Start configuration ``name``'s shared process; yield its ``kv_transfer_config``
    (``radixkv-storage``: ``instances`` managers on ``storage``, one config per instance).

    Raises:
        InvalidArgumentError: an unknown configuration, or ``radixkv-storage`` without ``storage``.
        RuntimeError: the side process exits or does not listen in time (its log is quoted).
    """
    if name not in CONFIGS:
        raise InvalidArgumentError(f"unknown configuration {name!r}; choose from {', '.join(CONFIGS)}")
    if name == "local":
        yield None
        return
    if name == "radixkv-storage":
        if not storage:
            raise InvalidArgumentError("the radixkv-storage configuration needs --storage URL")
        with _managers_on_storage(spec, storage, instances, manager_args, log_dir) as cfgs:
            yield cfgs
        return
    with tempfile.TemporaryDirectory(prefix=f"bench-vllm-{name}-") as d:
        log = os.path.join(log_dir or d, f"{name}-side.log")
        if name == "radixkv":
            cmd, ready, cfg = _manager(d, spec, shlex.split(manager_args))
        else:
            port = _free_port()
            cmd = [sys.executable, "-m", "lmcache.v1.multiprocess.server", "--host", "localhost",
                   "--port", str(port), "--chunk-size", str(spec["block_size"]), "--l1-size-gb",
                   f"{spec['manager_kv_bytes'] / 2**30:.3f}", "--eviction-policy", "LRU",
                   "--supported-transfer-mode", "engine_driven",     # what the CPU client asks for
                   "--disable-observability", *shlex.split(lmcache_args)]
            ready = f"tcp:{port}"
            cfg = {"kv_connector": "LMCacheMPConnector", "kv_role": "kv_both",
                   "kv_connector_extra_config": {"lmcache.mp.host": "tcp://localhost", "lmcache.mp.port": port,
                                                 "lmcache.mp.mq_timeout": 60.0}}
        env = dict(os.environ, LMCACHE_TRACK_USAGE="false")   # LMCache's usage telemetry off
        if spec.get("sys_path"):
            env["PYTHONPATH"] = os.pathsep.join([*spec["sys_path"], env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        with open(log, "wb") as out:
            # cwd: the temp dir, so `-m radixkv` is the installed package, not a checkout in cwd
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=d)
        try:
            _wait_for(ready, proc, 180.0, f"{name} side process", log)
            yield cfg
        finally:
            _stop(proc)
