"""A real ``radixkv serve`` process on a Unix socket, driven by this process and by spawned
worker processes that share its KV buffers. The server runs with the default quarantine
(on, 30 s): dead workers are reclaimed at once, live silent ones are fenced and held."""
import os
import signal
import time

import grpc
import numpy as np
import pytest
import service_workers as workers
from radixkv.service.client import connect
from radixkv.service.server.manager import DEFAULT_QUARANTINE_S
from radixkv.service.wire.errors import MessageTooLargeError, SessionSecretError
from service_util import SPAWN, START_TIMEOUT_S, run_worker

from radixkv.engine.protocol import DecodeItem, ExtendItem, MatchQuery, Session
from radixkv.errors import (
    CapacityError,
    InvalidArgumentError,
    NotFoundError,
    StaleSessionError,
    UnauthenticatedError,
)

QUARANTINE_S = DEFAULT_QUARANTINE_S  # the module's server runs with the default (30 s)


def law(s):
    assert s.kv_available + s.kv_evictable + s.kv_protected + s.kv_held == s.kv_capacity, s
    if s.requests == 0:
        assert s.kv_held == 0 and s.kv_protected == 0, s


def wait_idle(c, timeout_s=30.0):
    """Poll stats until nothing is held (bounded)."""
    deadline = time.monotonic() + timeout_s
    while True:
        s = c.stats()
        if s.requests == 0 and s.kv_held == 0 and s.sessions == 0:
            return s
        if time.monotonic() > deadline:
            raise AssertionError(f"still held after {timeout_s} s: {s}")
        time.sleep(0.1)


def test_stats_attach_and_a_full_request_cycle(client):
    s0 = client.stats()
    assert s0.kv_capacity == 2048 and s0.requests == 0
    info = client.attach("main")
    s = info.session
    assert s.lease_ttl_s == 2.0 and info.layout["config"]["kv_tokens"] == 2048
    assert {p["mapping"]["mode"] for p in info.layout["pools"].values()} == {"shm"}
    prompt = np.arange(10, 74, dtype=np.int32)
    r = client.alloc_extend(s, [ExtendItem("cyc-1", prompt)])[0]
    assert (r.prefix_len, r.start, r.seq_len, len(r.out_cache_loc)) == (0, 0, 64, 64)
    d = client.alloc_decode(s, [DecodeItem("cyc-1", 99)])
    assert d.seq_lens.tolist() == [65] and d.out_cache_loc.dtype == np.int64
    assert client.cache_unfinished(s, ["cyc-1"])[0].cached_len == 65
    assert client.cache_finished(s, ["cyc-1"])[0].cached_len == 65
    m = client.match(s, [MatchQuery(np.concatenate([prompt, np.array([99, 1], np.int32)]))])[0]
    assert m.prefix_len == 65
    r2 = client.alloc_extend(s, [ExtendItem("cyc-2", np.concatenate([prompt, np.array([5], np.int32)]))])[0]
    assert r2.prefix_len == 64 and r2.start == 64 and len(r2.out_cache_loc) == 1
    client.release(s, ["cyc-2"])
    assert client.evict(s, 1000).tokens >= 65
    events = client.take_events(s)
    assert {e["type"] for e in events} >= {"BlockStored", "BlockRemoved"}
    client.check_invariants()
    client.detach(s)
    law(wait_idle(client))


def test_errors_cross_the_wire_typed_and_change_nothing(client):
    a = client.attach("a").session
    b = client.attach("b").session
    client.alloc_extend(a, [ExtendItem("err-a", np.arange(1, 9, dtype=np.int32))])
    before = client.stats()
    with pytest.raises(NotFoundError):  # request ids are per session: a's is unknown to b
        client.alloc_decode(b, [DecodeItem("err-a", 1)])
    with pytest.raises(NotFoundError):
        client.cache_finished(b, ["nope"])
    with pytest.raises(InvalidArgumentError):
        client.alloc_extend(b, [ExtendItem("x", np.arange(3, dtype=np.int64))])
    with pytest.raises(CapacityError) as ei:
        client.alloc_extend(b, [ExtendItem("big", np.arange(1, 3000, dtype=np.int32))])
    assert ei.value.requested is not None and ei.value.available is not None
    assert client.stats() == before
    client.detach(a)
    with pytest.raises(StaleSessionError):
        client.heartbeat(a)
    client.detach(b)
    law(wait_idle(client))
    client.check_invariants()


def test_auth_failures(server):
    with connect(server.address, token="definitely-wrong-token") as bad:
        with pytest.raises(UnauthenticatedError):
            bad.stats()
        with pytest.raises(UnauthenticatedError):
            bad.attach("intruder")
    # no token at all, straight through a raw channel
    from radixkv.service.wire._gen import cache_manager_pb2 as pb
    from radixkv.service.wire._gen import cache_manager_pb2_grpc as pb_grpc

    with grpc.insecure_channel(f"unix:{server.socket_path}") as ch:
        with pytest.raises(grpc.RpcError) as ei:
            pb_grpc.CacheManagerStub(ch).Stats(pb.StatsRequest(), timeout=30)
        assert ei.value.code() == grpc.StatusCode.UNAUTHENTICATED
        # health needs no token
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=30)
        assert resp.status == health_pb2.HealthCheckResponse.SERVING
    with connect(server.address, token=server.token) as good:
        assert good.stats().sessions == 0


def test_oversize_message_is_refused(client):
    s = client.attach("big").session
    before = client.stats()
    with pytest.raises(MessageTooLargeError) as ei:  # 1.2 MB of tokens > the 1 MiB limit
        client.alloc_extend(s, [ExtendItem("huge", np.ones(300_000, dtype=np.int32))])
    assert isinstance(ei.value, CapacityError) and ei.value.requested > ei.value.available == 1 << 20
    assert client.stats() == before
    client.detach(s)


def test_two_workers_share_kv_through_the_shared_buffers(server, client):
    prompt = list(range(300, 340))
    a = run_worker(workers.prefill_worker, server.address, server.token, "share-A", prompt)
    assert a["prefix_len"] == 0 and a["cached_len"] == len(prompt)
    b = run_worker(workers.reuse_worker, server.address, server.token, "share-B", prompt, [1, 2, 3])
    assert b["prefix_len"] == len(prompt) and b["start"] == len(prompt) and b["seq_len"] == len(prompt) + 3
    assert b["rows"] == a["loc"]  # B reads the very rows A wrote
    assert b["max_abs_diff"] == 0.0
    # and this process sees the same bytes through its own mapping
    info = client.attach("reader")
    wb = client.worker_buffers(info)
    import torch

    k, _ = wb.get_kv_buffer(0)
    want, _ = workers.kv_of(prompt, 0, wb.config.head_num, wb.config.head_dim)
    assert torch.equal(k[torch.tensor(a["loc"])], want)
    client.detach(info.session)
    law(wait_idle(client))
    client.check_invariants()


def _session_of(client, sid):
    """A handle on another process's session ``sid`` (the epoch and TTL from a session
    opened and closed at once: a session left to expire would itself be quarantined)."""
    probe = client.attach("probe").session
    client.detach(probe)
    return Session(sid, probe.epoch, probe.lease_ttl_s)


def test_sigkilled_workers_are_reclaimed_and_the_server_runs_on(server, client):
    """One victim relies on its lease (2 s), the other on a keep-alive stream; both hold a
    running request. The server runs with the default quarantine (30 s): once the lease
    victim, alive but silent, outlives its lease it is fenced (its calls are refused) and
    what it held stays held; the keep-alive victim is renewed by its stream. Both are then
    SIGKILLed: a dead worker's session is not held, so both are reclaimed once their process
    is gone, long before the quarantine could end, and the server runs on."""
    q = SPAWN.Queue()
    procs = [SPAWN.Process(target=workers.holding_worker, args=(server.address, server.token, ka, q), daemon=True)
             for ka in (False, True)]
    for p in procs:
        p.start()
    try:
        sids = []
        for _ in procs:
            kind, payload = q.get(timeout=START_TIMEOUT_S)
            assert kind == "holding", payload
            sids.append(payload)
        st = client.stats()
        assert st.requests == 2 and st.kv_held == 202, st
        time.sleep(4.5)  # > lease (2 s) + sweeps
        st = client.stats()
        # both still hold: the keep-alive victim renewed, the lease victim quarantined
        assert st.sessions == 2 and st.requests == 2 and st.kv_held == 202, st
        refused = []
        for sid in sids:
            try:
                client.heartbeat(_session_of(client, sid))
            except StaleSessionError as e:
                refused.append(str(e))
            except SessionSecretError:  # the live keep-alive one: its id alone is no credential
                pass
        assert len(refused) == 1 and "quarantined" in refused[0], refused
        for p in procs:
            os.kill(p.pid, signal.SIGKILL)
        t_kill = time.monotonic()
        for p in procs:
            p.join(30)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(10)
    # released because the processes are gone (pidfd), not by the 30 s quarantine timeout
    law(wait_idle(client, timeout_s=QUARANTINE_S / 2))
    print(f"RELIABILITY sigkill_default_quarantine kill_to_idle_ms={(time.monotonic() - t_kill) * 1000:.0f}")
    client.check_invariants()
    # the server runs on
    s = client.attach("after").session
    client.alloc_extend(s, [ExtendItem("after", np.arange(1, 5, dtype=np.int32))])
    client.release(s, ["after"])
    client.detach(s)


def test_default_quarantine_fences_a_live_silent_worker_until_it_dies(server, client):
    """The default server quarantines: a worker paused (SIGSTOP) past its 2 s lease is
    fenced, every call under its session is refused as stale and changes nothing, and what
    it held (a row, 101 KV slots) stays held, however many sweeps pass, while its process
    lives; once it is killed, everything is reclaimed at the next sweeps (not after the 30 s
    hold)."""
    q = SPAWN.Queue()
    p = SPAWN.Process(target=workers.holding_worker, args=(server.address, server.token, False, q), daemon=True)
    p.start()
    try:
        kind, sid = q.get(timeout=START_TIMEOUT_S)
        assert kind == "holding", sid
        t_last_call = time.monotonic()  # its last call came before it reported
        os.kill(p.pid, signal.SIGSTOP)  # alive, silent: the lease runs out
        victim = _session_of(client, sid)
        # past the lease (2 s) and several sweeps (0.1 s): it must have been fenced by now.
        # (A call under it before the end of the lease would renew it: none is made until then.)
        time.sleep(max(0.0, t_last_call + victim.lease_ttl_s + 1.0 - time.monotonic()))
        held = client.stats()
        assert held.sessions == 1 and held.requests == 1 and held.kv_held == 101, held
        with pytest.raises(StaleSessionError, match="quarantined"):
            client.heartbeat(victim)
        with pytest.raises(StaleSessionError, match="quarantined"):
            client.alloc_decode(victim, [DecodeItem("victim-lease", 8)])
        with pytest.raises(StaleSessionError):
            client.cache_finished(victim, ["victim-lease"])
        time.sleep(1.0)  # ten more sweeps: still held, the refused calls changed nothing
        st = client.stats()
        assert (st.sessions, st.requests, st.kv_held, st.rows_available) == \
            (held.sessions, held.requests, held.kv_held, held.rows_available), (st, held)
        law(st)
        client.check_invariants()
        os.kill(p.pid, signal.SIGKILL)  # SIGKILL ends a stopped process too
        t_kill = time.monotonic()
        p.join(30)
        assert not p.is_alive()
        law(wait_idle(client, timeout_s=QUARANTINE_S / 2))  # well before the hold could end
        print(f"RELIABILITY default_quarantine kill_to_idle_ms={(time.monotonic() - t_kill) * 1000:.0f}")
        client.check_invariants()
    finally:
        if p.is_alive():
            p.kill()
            p.join(10)
