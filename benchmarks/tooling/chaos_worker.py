"""The worker side of fault injection: one standby worker process per victim, never forked.

Run as ``python -m tooling.chaos_worker`` (by :class:`tooling.chaos.StandbyPool`,
with ``subprocess.Popen``: a fresh interpreter each time, never ``fork``, since the processes
share gRPC). A standby imports only what a worker needs (grpc, numpy and the generated
messages: no torch, no engine), reports ``standby {pid}``, then blocks on stdin until the
driver hands it its spec. The driver keeps a few standbys started ahead of need, so handing a
victim its spec never waits for an interpreter start.

Protocol (JSON lines): stdin one line ``{"spec": {...}}`` (EOF before it: exit quietly; EOF
after it: the driver is gone, the worker kills itself). stdout is a pipe shared by every
worker of the driver: each event is one ``os.write`` of a line shorter than ``PIPE_BUF``
(atomic): ``standby {pid}``, ``attached {wid, sid, epoch}``, ``alloc {wid, rid, locs,
row}``, ``point {wid, name}`` (just before a planned self-kill), ``refused {wid, code}``,
``stale_write {wid, n}``, ``holding {wid}``, ``done {wid}``, ``error {wid, msg}``.

A worker (:func:`run_worker`) attaches (reporting its pid), maps the KV pool file, and runs
a random mix of extend / decode / cache_unfinished / cache_finished / release / match calls
over prompts that share prefixes with other workers (so tree nodes are locked and shared).
It writes a marker into the K rows of every slot it was given. ``spec["kill_at"]`` names a
point where it SIGKILLs itself (the ``kill_nth`` time it gets there):

* ``after_alloc``: between ``AllocExtend`` and inserting into the tree;
* ``after_cache_unfinished``: holding locks on tree nodes;
* ``mid_call``: right after sending an ``AllocExtend`` / ``AllocDecode`` (the manager may
  or may not run it; the reply goes nowhere);
* ``mid_batch``: half-way through writing a batch's KV;
* ``after_decode``.

The driver may also kill it from outside at any time. With ``spec["hold"]`` it then
heartbeats every ``hb_interval_s`` until killed; when a heartbeat is refused as stale (it
was paused past its lease) it reports ``refused`` and writes into the KV slots it held (what
a resumed worker that has not yet noticed would do), reporting ``stale_write``.

A worker dies by ``alarm(max_life_s)`` at the latest, and as soon as its stdin reaches EOF
(the driver closed it or died): no orphan outlives the driver.
"""
from __future__ import annotations

import json
import mmap
import os
import signal
import sys
import threading
import time
import traceback
from typing import Any

#: Set by the driver: the niceness increment of a standby while it starts and waits, so that
#: starting interpreters in the background does not take CPU from the manager and the running
#: workers; the worker returns to its parent's priority when its spec arrives.
STANDBY_NICE_ENV = "RADIXKV_CHAOS_STANDBY_NICE"
_BASE_NICE = os.getpriority(os.PRIO_PROCESS, 0)
if __name__ == "__main__" and os.environ.get(STANDBY_NICE_ENV):
    os.nice(int(os.environ[STANDBY_NICE_ENV]))  # before the heavy imports below

import grpc  # noqa: E402
import numpy as np  # noqa: E402
from radixkv.service.wire import codec as wire  # noqa: E402
from radixkv.service.wire._gen import cache_manager_pb2 as pb  # noqa: E402
from radixkv.service.wire._gen import cache_manager_pb2_grpc as pb_grpc  # noqa: E402

from radixkv.engine.protocol import ExtendItem  # noqa: E402

KILL_POINTS = ("after_alloc", "after_cache_unfinished", "mid_call", "mid_batch", "after_decode")
_MAX_LINE = 4000  # < PIPE_BUF: one atomic write


def emit(event: dict[str, Any]) -> None:
    """Write ``event`` as one JSON line in one atomic ``os.write`` (long lists are dropped)."""
    line = json.dumps(event, separators=(",", ":"))
    if len(line) > _MAX_LINE:  # keep writes atomic: drop the long list, say so
        event = {k: v for k, v in event.items() if not isinstance(v, list)}
        event["truncated"] = True
        line = json.dumps(event, separators=(",", ":"))
    os.write(1, (line + "\n").encode())


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(60)  # pragma: no cover - never reached


class _KV:
    """Layer 0's K buffer of the manager's KV pool file, as a writable numpy view."""

    def __init__(self, attach: Any):
        layout = json.loads(attach.layout_json)
        path = nbytes = None
        for m in attach.mappings:
            if m.pool == "kv" and m.WhichOneof("source") == "shm":
                path, nbytes = m.shm.path, int(m.shm.nbytes)
        self.k = None
        if path is None or nbytes is None:
            return
        t = next(t for t in layout["pools"]["kv"]["arena"]["tensors"] if t["name"].startswith("k."))
        fd = os.open(path, os.O_RDWR)
        try:
            self._mm = mmap.mmap(fd, nbytes)
        finally:
            os.close(fd)
        self.k = np.ndarray(tuple(t["shape"]), dtype=np.dtype(t["dtype"]), buffer=self._mm, offset=t["offset"])

    def write(self, locs: np.ndarray, marker: float) -> None:
        if self.k is not None and len(locs):
            self.k[locs] = marker


class _Worker:
    def __init__(self, spec: dict[str, Any]):
        self.spec = spec
        self.wid = spec["wid"]
        self.rng = np.random.default_rng(spec.get("seed", 0))
        target = spec["address"]
        if target.startswith("unix://"):
            target = "unix:" + target[len("unix://"):]
        self.channel = grpc.insecure_channel(target, options=[("grpc.enable_retries", 0)])
        self.stub = pb_grpc.CacheManagerStub(self.channel)
        self.md = (("authorization", "Bearer " + spec["token"]),)
        self.timeout = float(spec.get("timeout_s", 10.0))
        self.kill_at = spec.get("kill_at")
        self.kill_nth = int(spec.get("kill_nth", 1))
        self.seen: dict[str, int] = {}
        vocab_rng = np.random.default_rng(spec.get("bases_seed", 12345))
        self.bases = vocab_rng.integers(1, 1000, size=(int(spec.get("n_bases", 4)), 64)).astype(np.int32)
        self.marker = float(spec.get("marker", -1.0))
        self.live: dict[str, int] = {}  # rid -> seq_len
        self.held: dict[str, list[int]] = {}  # rid -> the slots it was given (running requests)
        self.n = 0

    def point(self, name: str) -> None:
        if name != self.kill_at:
            return
        self.seen[name] = self.seen.get(name, 0) + 1
        if self.seen[name] >= self.kill_nth:
            emit({"ev": "point", "wid": self.wid, "name": name})
            _die()

    def call(self, method: Any, request: Any) -> Any:
        return method(request, metadata=self.md, timeout=self.timeout)

    def attach(self) -> None:
        a = self.call(self.stub.Attach, pb.AttachRequest(worker_name=f"chaos-{self.wid}", pid=os.getpid()))
        self.session = a.session
        self.kv = _KV(a)
        emit({"ev": "attached", "wid": self.wid, "sid": a.session.session_id, "epoch": a.session.epoch})
        if self.spec.get("keepalive"):
            interval = float(self.spec.get("ka_interval_s", 0.1))

            def beats():
                while True:
                    yield pb.HeartbeatRequest(session=self.session)
                    time.sleep(interval)

            stream = self.stub.KeepAlive(beats(), metadata=self.md)
            threading.Thread(target=lambda: [None for _ in stream], daemon=True).start()

    def prompt(self) -> np.ndarray:
        base = self.bases[int(self.rng.integers(len(self.bases)))]
        shared = int(self.rng.integers(0, 33))
        tail = self.rng.integers(1000, 2000, size=int(self.rng.integers(1, 9))).astype(np.int32)
        return np.concatenate([base[:shared], tail])

    def extend(self) -> None:
        k = int(self.rng.integers(1, 3))
        items, toks = [], []
        for _ in range(k):
            self.n += 1
            rid = f"{self.session.session_id}-{self.n}"
            t = self.prompt()
            items.append(ExtendItem(rid, t.astype(np.int32)))
            toks.append(t)
        req = wire.extend_request_to_msg(self.session, items)
        if self.kill_at == "mid_call" and self.rng.random() < 0.5:
            self.stub.AllocExtend.future(req, metadata=self.md, timeout=self.timeout)
            time.sleep(float(self.rng.random()) * 0.002)
            self.point("mid_call")
        resp = self.call(self.stub.AllocExtend, req)
        for r in wire.extend_results_from_msg(resp, [it.rid for it in items]):
            locs = r.out_cache_loc
            half = len(locs) // 2
            self.kv.write(locs[:half], self.marker)
            self.point("mid_batch")
            self.kv.write(locs[half:], self.marker)
            self.held.setdefault(r.rid, []).extend(locs.tolist())
            self.live[r.rid] = r.seq_len
            emit({"ev": "alloc", "wid": self.wid, "rid": r.rid, "row": r.req_pool_idx, "locs": locs.tolist()})
        self.point("after_alloc")

    def decode(self) -> None:
        rids = list(self.live)[: int(self.rng.integers(1, 4))]
        tok = self.rng.integers(1, 2000, size=len(rids)).astype("<i4").tobytes()
        req = pb.AllocDecodeRequest(session=self.session, rids=rids, token_ids_i32=tok)
        if self.kill_at == "mid_call" and self.rng.random() < 0.5:
            self.stub.AllocDecode.future(req, metadata=self.md, timeout=self.timeout)
            self.point("mid_call")
        resp = self.call(self.stub.AllocDecode, req)
        locs = np.frombuffer(resp.out_cache_loc_i64, dtype="<i8")
        self.kv.write(locs, self.marker)
        for rid, loc in zip(rids, locs.tolist()):
            self.live[rid] += 1
            self.held[rid].append(loc)
        emit({"ev": "alloc", "wid": self.wid, "rid": ",".join(rids), "row": -1, "locs": locs.tolist()})
        self.point("after_decode")

    def step(self) -> None:
        ops = ["extend", "decode", "cache_unfinished", "cache_finished", "release",
               "match"] if self.live else ["extend"]
        op = ops[int(self.rng.integers(len(ops)))]
        if op == "extend":
            self.extend()
        elif op == "decode":
            self.decode()
        elif op == "match":
            q = pb.MatchQuery(token_ids_i32=self.prompt().astype("<i4").tobytes())
            self.call(self.stub.Match, pb.MatchRequest(session=self.session, queries=[q]))
        else:
            rid = list(self.live)[int(self.rng.integers(len(self.live)))]
            if op == "cache_unfinished":
                self.call(self.stub.CacheUnfinished, pb.CacheRequest(session=self.session, rids=[rid]))
                self.point("after_cache_unfinished")
            elif op == "cache_finished":
                self.call(self.stub.CacheFinished, pb.CacheRequest(session=self.session, rids=[rid]))
                del self.live[rid], self.held[rid]
            else:
                self.call(self.stub.Release, pb.ReleaseRequest(session=self.session, rids=[rid]))
                del self.live[rid], self.held[rid]

    def hold(self) -> None:
        if not self.live:  # hold something
            self.extend()
        held = sorted(x for v in self.held.values() for x in v)
        emit({"ev": "holding", "wid": self.wid, "t": time.monotonic(), "held": held})
        interval = float(self.spec.get("hb_interval_s", 0.1))
        while True:
            time.sleep(interval)
            try:
                self.call(self.stub.Heartbeat, pb.HeartbeatRequest(session=self.session))
            except grpc.RpcError as e:
                emit({"ev": "refused", "wid": self.wid, "code": e.code().name, "t": time.monotonic()})
                locs = np.asarray(held, dtype=np.int64)
                self.kv.write(locs, self.marker)  # the stale write a resumed worker may still do
                emit({"ev": "stale_write", "wid": self.wid, "n": int(len(locs))})
                time.sleep(600)

    def run(self) -> None:
        self.attach()
        for _ in range(int(self.spec.get("steps", 8))):
            try:
                self.step()
            except grpc.RpcError as e:
                code = e.code()
                if code in (grpc.StatusCode.RESOURCE_EXHAUSTED,):
                    continue  # full: the driver's other victims hold the pool
                raise
        if self.spec.get("hold"):
            self.hold()
        if self.spec.get("detach"):
            self.call(self.stub.Detach, pb.DetachRequest(session=self.session))
        emit({"ev": "done", "wid": self.wid})


def _exit_when_driver_goes(stdin: Any) -> None:
    """Daemon thread: block on stdin until EOF (the driver closed it or died), then die."""
    try:
        while stdin.read(4096):
            pass
    except (OSError, ValueError):
        pass
    _die()


def run_worker(spec: dict[str, Any]) -> None:
    """Run one worker from ``spec`` in this process; never returns (``os._exit``)."""
    code = 0
    try:
        signal.alarm(int(spec.get("max_life_s", 60)))
        _Worker(spec).run()
        if spec.get("linger"):
            time.sleep(float(spec["linger"]))
    except grpc.RpcError as e:
        emit({"ev": "error", "wid": spec.get("wid"), "msg": f"{e.code().name}: {e.details()}"[:500]})
        code = 1
    except BaseException:
        emit({"ev": "error", "wid": spec.get("wid"), "msg": traceback.format_exc()[-1500:]})
        code = 1
    os._exit(code)


def _restore_priority() -> bool:
    """Give every thread of this process its parent's niceness back (a standby was started
    nicer). False when not allowed (raising priority needs ``CAP_SYS_NICE`` or a
    ``RLIMIT_NICE``): the worker then runs at the standby's priority."""
    ok = True
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        tids = [0]
    for tid in tids:
        try:
            if os.getpriority(os.PRIO_PROCESS, tid) != _BASE_NICE:
                os.setpriority(os.PRIO_PROCESS, tid, _BASE_NICE)
        except OSError:  # EPERM (not allowed), ESRCH (the thread ended)
            ok = False
    return ok


def standby_main() -> int:
    """Announce readiness, wait for the spec on stdin, run it. Returns 0 when stdin closes
    before a spec came (an unused standby being retired)."""
    emit({"ev": "standby", "pid": os.getpid()})
    stdin = sys.stdin.buffer
    line = stdin.readline()
    if not line:
        return 0
    try:
        spec = json.loads(line)["spec"]
    except (ValueError, KeyError, TypeError):
        emit({"ev": "error", "wid": None, "msg": f"bad spec line: {line[:200]!r}"})
        return 2
    _restore_priority()
    threading.Thread(target=_exit_when_driver_goes, args=(stdin,), name="driver-watch", daemon=True).start()
    run_worker(spec)
    return 0  # pragma: no cover - run_worker never returns


if __name__ == "__main__":
    sys.exit(standby_main())
