"""Server start-up and shutdown: config file + flags, socket-directory rules, graceful
SIGTERM, TCP/TLS, health, reflection, metrics, the event stream."""
import os
import shutil
import signal
import socket
import subprocess
import threading
import time
import urllib.request

import grpc
import numpy as np
import pytest
from radixkv.service.client import connect
from radixkv.service.server.listen import prepare_unix_socket
from radixkv.service.server.manager import ServeOptions
from radixkv.service.wire.errors import ServiceUnavailableError
from radixkv.service.wire.transport import unix_socket_path
from service_util import STOP_TIMEOUT_S, start_server, stop_server
from tooling.testing import ThreadedServer

from radixkv.engine.protocol import ExtendItem
from radixkv.errors import InvalidArgumentError, PermissionDeniedError, StaleSessionError


def test_unix_addresses():
    assert unix_socket_path("unix:///a/b.sock") == "/a/b.sock"
    assert unix_socket_path("unix:/a/b.sock") == "/a/b.sock"
    assert unix_socket_path("unix:rel.sock") == "rel.sock"
    assert unix_socket_path("127.0.0.1:5") is None


def test_socket_directory_rules(tmp_path):
    new = tmp_path / "made" / "here"
    path = prepare_unix_socket(str(new / "s.sock"))
    assert path == str(new / "s.sock") and (os.stat(new).st_mode & 0o777) == 0o700
    wide = tmp_path / "wide"
    wide.mkdir(mode=0o755)
    os.chmod(wide, 0o755)
    with pytest.raises(PermissionDeniedError, match="0700"):
        prepare_unix_socket(str(wide / "s.sock"))
    safe = tmp_path / "safe"
    safe.mkdir(mode=0o700)
    (safe / "file").write_text("x")
    with pytest.raises(InvalidArgumentError, match="not a socket"):
        prepare_unix_socket(str(safe / "file"))
    # a stale socket (nobody listening) is replaced; a live one refused
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(str(safe / "live.sock"))
    s.listen(1)
    with pytest.raises(InvalidArgumentError, match="already listens"):
        prepare_unix_socket(str(safe / "live.sock"))
    s.close()
    assert prepare_unix_socket(str(safe / "live.sock")) == str(safe / "live.sock")
    assert not os.path.exists(safe / "live.sock")


def test_cli_refuses_a_wide_socket_directory(tmp_path, capsys):
    from radixkv.service.server.cli import main

    wide = tmp_path / "wide"
    wide.mkdir()
    os.chmod(wide, 0o755)
    rc = main(["serve", "--address", f"unix://{wide}/s.sock", "--token", "a-long-enough-token",
               "--kv-tokens", "64", "--log-level", "ERROR"])
    assert rc == 2 and "PermissionDeniedError" in capsys.readouterr().err
    assert not [f for f in os.listdir("/dev/shm") if f.startswith(f"radixkv-{os.getpid()}-")]


def test_cli_config_file_and_flags(tmp_path):
    import argparse

    from radixkv.service.server.cli import add_serve_arguments, engine_config_from_args

    cfg = tmp_path / "engine.toml"
    cfg.write_text("[engine]\nkv_tokens = 256\npage_size = 4\nlease_ttl_s = 9.0\n")
    p = add_serve_arguments(argparse.ArgumentParser())
    c = engine_config_from_args(p.parse_args(["--config", str(cfg), "--kv-tokens", "512", "--no-checks"]))
    assert (c.kv_tokens, c.page_size, c.lease_ttl_s, c.checks) == (512, 4, 9.0, False)
    c = engine_config_from_args(p.parse_args([]))
    assert c.kv_tokens == 4096 and c.device == "cpu"
    with pytest.raises(InvalidArgumentError):
        engine_config_from_args(p.parse_args(["--config", str(cfg), "--kv-tokens", "514"]))


def test_sigterm_drains_revokes_and_cleans_up(tmp_path):
    cfg = tmp_path / "engine.json"
    cfg.write_text('{"kv_tokens": 256, "page_size": 4, "lease_ttl_s": 60.0, "enable_kv_events": true}')
    srv = start_server(["--config", str(cfg), "--kv-tokens", "512", "--grace-s", "2"])
    try:
        c = connect(srv.address, token=srv.token, wait_s=30)
        info = c.attach("held")
        assert info.layout["config"]["page_size"] == 4 and c.stats().kv_capacity == 512
        ka = c.start_keepalive(info.session, interval_s=0.2)
        c.alloc_extend(info.session, [ExtendItem("held", np.arange(1, 40, dtype=np.int32))])
        c.cache_unfinished(info.session, ["held"])  # stores blocks: the ring holds events
        events: list[object] = []
        streaming = threading.Event()

        def watch() -> None:
            for ev in c.watch_events(info.session):  # from seq 0: the events above first
                events.append(ev)
                streaming.set()

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        # the stream is open before SIGTERM, so its ending at shutdown is what is tested
        assert streaming.wait(STOP_TIMEOUT_S), "the event stream did not start"
        assert len([f for f in srv.shm_files() if f.endswith(".buf")]) == 2 and os.path.exists(srv.socket_path)
        os.kill(srv.process.pid, signal.SIGTERM)
        srv.process.join(STOP_TIMEOUT_S)
        assert srv.process.exitcode == 0
        assert not os.path.exists(srv.socket_path), "socket file left behind"
        assert not srv.shm_files(), "shared-memory files left behind"
        watcher.join(STOP_TIMEOUT_S)
        assert not watcher.is_alive(), "the event stream did not end at shutdown"
        ka.stop()
        with pytest.raises(ServiceUnavailableError):
            c.stats()
        c.close()
    finally:
        stop_server(srv)


def test_loopback_tcp_health_and_reflection():
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    opts = ServeOptions(address="127.0.0.1:0", reflection=True, sweep_interval_s=0.2, grace_s=1.0)
    srv = ThreadedServer({"kv_tokens": 64}, options=opts)
    srv.options = opts  # keep the TCP address (ThreadedServer defaults to a Unix socket)
    with srv:
        assert srv.address.startswith("127.0.0.1:") and not srv.address.endswith(":0")
        with connect(srv.address, token=srv.token) as c:
            assert c.stats().kv_capacity == 64
        with grpc.insecure_channel(srv.address) as ch:
            h = health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(service="radixkv.v1.CacheManager"), timeout=30)
            assert h.status == health_pb2.HealthCheckResponse.SERVING
            stub = reflection_pb2_grpc.ServerReflectionStub(ch)
            req = reflection_pb2.ServerReflectionRequest(list_services="")
            with pytest.raises(grpc.RpcError) as ei:  # reflection needs the token too
                list(stub.ServerReflectionInfo(iter([req]), timeout=30))
            assert ei.value.code() == grpc.StatusCode.UNAUTHENTICATED
            md = (("authorization", "Bearer " + srv.token),)
            out = list(stub.ServerReflectionInfo(iter([req]), metadata=md, timeout=30))
            names = {s.name for s in out[0].list_services_response.service}
            assert "radixkv.v1.CacheManager" in names


def test_reflection_is_off_by_default():
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    with ThreadedServer({"kv_tokens": 64}) as srv:
        with grpc.insecure_channel(f"unix:{unix_socket_path(srv.address)}") as ch:
            stub = reflection_pb2_grpc.ServerReflectionStub(ch)
            md = (("authorization", "Bearer " + srv.token),)
            with pytest.raises(grpc.RpcError) as ei:
                list(stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]),
                                               metadata=md, timeout=30))
            assert ei.value.code() == grpc.StatusCode.UNIMPLEMENTED


def test_plaintext_tcp_off_loopback_is_refused():
    srv = ThreadedServer({"kv_tokens": 64})
    srv.options = ServeOptions(address="0.0.0.0:0")
    with pytest.raises(InvalidArgumentError, match="plaintext"):
        srv.start()
    srv.stop()


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command to make a certificate")
def test_tls_with_client_certificates(tmp_path):
    def run(*args):
        subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=60)

    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=radixkv-test-ca",
        "-keyout", str(tmp_path / "ca.key"), "-out", str(tmp_path / "ca.pem"))
    ext = tmp_path / "ext.cnf"
    ext.write_text("subjectAltName=DNS:localhost,IP:127.0.0.1\n")
    for name in ("server", "client"):
        run("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={name}", "-keyout", str(tmp_path / f"{name}.key"),
            "-out", str(tmp_path / f"{name}.csr"))
        run("x509", "-req", "-in", str(tmp_path / f"{name}.csr"), "-CA", str(tmp_path / "ca.pem"), "-CAkey",
            str(tmp_path / "ca.key"), "-CAcreateserial", "-days", "1", "-extfile", str(ext),
            "-out", str(tmp_path / f"{name}.pem"))
    opts = ServeOptions(address="127.0.0.1:0", tls_cert=str(tmp_path / "server.pem"),
                        tls_key=str(tmp_path / "server.key"), tls_ca=str(tmp_path / "ca.pem"), grace_s=1.0)
    srv = ThreadedServer({"kv_tokens": 64})
    srv.options = opts
    with srv:
        with connect(srv.address, token=srv.token, tls_ca=str(tmp_path / "ca.pem"),
                     tls_cert=str(tmp_path / "client.pem"), tls_key=str(tmp_path / "client.key")) as c:
            assert c.stats().kv_capacity == 64
        # no client certificate: the handshake fails, nothing answers
        with pytest.raises(ServiceUnavailableError):
            connect(srv.address, token=srv.token, tls_ca=str(tmp_path / "ca.pem"), wait_s=2)
        # plaintext against a TLS port: nothing answers either
        with pytest.raises(ServiceUnavailableError):
            connect(srv.address, token=srv.token, wait_s=2)


def test_metrics_endpoint():
    opts = ServeOptions(metrics_port=0, sweep_interval_s=0.1, grace_s=1.0)
    with ThreadedServer({"kv_tokens": 128}, options=opts) as srv:
        c = srv.client()
        s = c.attach("m").session
        c.alloc_extend(s, [ExtendItem("m", np.arange(1, 11, dtype=np.int32))])
        c.cache_finished(s, ["m"])
        c.stats()
        port = srv.server.metrics_port
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30).read().decode()
        assert 'radixkv_rpc_latency_seconds_count{code="OK",method="AllocExtend"} 1.0' in text
        assert 'radixkv_kv_tokens{state="evictable"} 10.0' in text
        assert "radixkv_sessions 1.0" in text and "radixkv_running_requests 0.0" in text
        assert "radixkv_evicted_tokens_total" in text
        # vLLM's names: token counters of prefix lookups and hits, and the usage ratio
        assert "radixkv_prefix_cache_queries_total 9.0" in text      # the prompt but its last token
        assert "radixkv_prefix_cache_hits_total 0.0" in text         # a fresh tree
        assert "radixkv_kv_cache_usage_perc 0.0" in text             # the 10 cached tokens are evictable
        c.alloc_extend(s, [ExtendItem("n", np.arange(1, 13, dtype=np.int32))])   # 10 cached + 2 new
        c.stats()
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30).read().decode()
        assert "radixkv_prefix_cache_queries_total 20.0" in text
        assert "radixkv_prefix_cache_hits_total 10.0" in text
        assert f"radixkv_kv_cache_usage_perc {12 / 128}" in text     # 10 locked + 2 held of 128
        c.release(s, ["n"])
        assert 'radixkv_build_info{version="' in text and "process_resident_memory_bytes" in text
        types = {ln.split()[2]: ln.split()[3] for ln in text.splitlines() if ln.startswith("# TYPE")}
        assert all(name.endswith("_total") for name, kind in types.items() if kind == "counter"), types
        with connect(srv.address, token="wrong-token-here") as bad:
            with pytest.raises(Exception):  # noqa: B017
                bad.stats()
        text = srv.server.metrics.exposition().decode()
        assert 'radixkv_auth_failures_total{method="Stats"} 1.0' in text
        c.detach(s)


def test_reliability_metrics_are_counters_with_units():
    from types import SimpleNamespace

    from radixkv.service.server.metrics import ServiceMetrics

    m = ServiceMetrics()
    m.update_reliability(SimpleNamespace(held=2, released_gone=3, released_timeout=1), 4096, 7)
    text = m.exposition().decode()
    assert "radixkv_quarantined_sessions 2.0" in text
    assert 'radixkv_quarantine_released_sessions_total{why="gone"} 3.0' in text
    assert 'radixkv_quarantine_released_sessions_total{why="timeout"} 1.0' in text
    assert "radixkv_reply_cache_bytes 4096.0" in text and "radixkv_reply_cache_hits_total 7.0" in text
    assert "# TYPE radixkv_reply_cache_hits_total counter" in text


def test_tier_metrics_follow_the_engine_counters():
    from radixkv.service.server.metrics import ServiceMetrics

    from radixkv.engine.config import EngineConfig
    from radixkv.engine.embedded import CacheEngine

    m = ServiceMetrics()
    m.update_tiers(CacheEngine(EngineConfig()).tier_stats())
    assert "radixkv_host_tier_tokens" not in m.exposition().decode()  # host tier off: no families
    eng = CacheEngine(EngineConfig(kv_tokens=64, host_kv_tokens=128))
    s = eng.attach().session
    for rid, base in (("a", 1), ("b", 100), ("c", 1)):  # b demotes a; c loads it back
        eng.alloc_extend(s, [ExtendItem(rid, np.arange(base, base + 48, dtype=np.int32))])
        eng.cache_finished(s, [rid])
    m.update_tiers(eng.tier_stats())
    text = m.exposition().decode()
    assert 'radixkv_host_tier_tokens{state="capacity"} 128.0' in text
    assert 'radixkv_tier_hit_tokens_total{tier="host"} 47.0' in text
    assert 'radixkv_tier_pages_total{move="loaded"} 47.0' in text
    assert "# TYPE radixkv_tier_load_seconds_total counter" in text


def test_keepalive_stream_end_detaches_and_stale_epoch_is_refused():
    with ThreadedServer({"kv_tokens": 128, "lease_ttl_s": 60.0}) as srv:
        c = srv.client()
        s = c.attach("k").session
        c.alloc_extend(s, [ExtendItem("k", np.arange(1, 11, dtype=np.int32))])
        ka = c.start_keepalive(s, interval_s=0.05)
        deadline = time.monotonic() + 30
        while ka.lease_left_s is None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert ka.lease_left_s == pytest.approx(60.0, abs=1.0)
        ka.stop()
        deadline = time.monotonic() + 30
        while c.stats().sessions and time.monotonic() < deadline:
            time.sleep(0.02)
        st = c.stats()
        assert st.sessions == 0 and st.kv_held == 0
        with pytest.raises(StaleSessionError):
            c.heartbeat(s)
        with pytest.raises(StaleSessionError):
            c.heartbeat(s._replace(epoch=s.epoch + 1))
        c.check_invariants()


def test_watch_events_streams_what_the_tree_stores():
    with ThreadedServer({"kv_tokens": 128, "enable_kv_events": True}) as srv:
        c = srv.client()
        watcher_client = srv.client()
        s = c.attach("w").session
        got, done = [], threading.Event()

        def watch():
            for e in watcher_client.watch_events(s, poll_interval_s=0.01):
                got.append(e)
                if e["type"] == "BlockStored":
                    done.set()

        t = threading.Thread(target=watch, daemon=True)
        t.start()
        c.alloc_extend(s, [ExtendItem("w", np.arange(1, 9, dtype=np.int32))])
        c.cache_finished(s, ["w"])
        assert done.wait(30), got
        stored = [e for e in got if e["type"] == "BlockStored"]
        assert stored[0]["token_ids"] == list(range(1, 9)) and len(stored[0]["block_hashes"]) == 8
        watcher_client.close()  # ends the stream
        t.join(30)
        assert not t.is_alive()
        c.detach(s)


def test_a_restarted_manager_refuses_old_sessions():
    with ThreadedServer({"kv_tokens": 64}) as first:
        old = first.client().attach("w").session
    with ThreadedServer({"kv_tokens": 64}) as second:
        c = second.client()
        with pytest.raises(StaleSessionError, match="epoch"):
            c.heartbeat(old)
        assert c.attach("w").session.epoch != old.epoch


def test_idle_checks_report_a_broken_invariant():
    """``check_idle``: a shared pool file whose mode was widened is caught at an idle
    sweep, and CheckInvariants reports it from then on."""
    from radixkv.errors import InvariantError

    opts = ServeOptions(check_idle=True, sweep_interval_s=0.05, grace_s=1.0)
    with ThreadedServer({"kv_tokens": 64}, options=opts) as srv:
        c = srv.client()
        c.check_invariants()
        path = srv.call(lambda server: server.shared.paths()["kv"])
        os.chmod(path, 0o644)
        deadline = time.monotonic() + 30
        while not srv.call(lambda server: list(server.servicer.idle_failures)) and time.monotonic() < deadline:
            time.sleep(0.05)
        os.chmod(path, 0o600)
        with pytest.raises(InvariantError, match="kv"):
            c.check_invariants()


@pytest.mark.parametrize("bad", [dict(max_message_bytes=0), dict(sweep_interval_s=0), dict(grace_s=-1),
                                 dict(metrics_port=70000), dict(address="")])
def test_bad_options_are_refused_before_anything_is_allocated(bad, tmp_path):
    from radixkv.service.server.manager import CacheManagerServer
    from radixkv.service.wire.auth import Token

    from radixkv.engine import EngineConfig

    with pytest.raises(InvalidArgumentError):
        CacheManagerServer(EngineConfig(kv_tokens=64), Token("a-long-enough-token"),
                           ServeOptions(shm_dir=str(tmp_path), **bad))
    assert os.listdir(tmp_path) == []
