"""``radixkv serve`` as a user starts it: the default socket directory, log level in any case,
JSON logs, the start-up line, a missing CUDA in one line; the client's ``close()`` detaching
what it attached."""
import json
import os
import secrets
import signal
import subprocess
import sys
import tempfile

import numpy as np
import pytest
import torch
from radixkv.service.client import connect
from radixkv.service.server import listen
from radixkv.service.server.manager import ServeOptions
from tooling.testing import ThreadedServer

from radixkv import __version__
from radixkv.cli import main
from radixkv.engine.protocol import ExtendItem


def test_default_socket_directory_is_per_user_and_not_importable(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    assert listen.default_socket_dir() == str(tmp_path / "radixkv-manager")
    assert listen.default_address() == f"unix://{tmp_path}/radixkv-manager/manager.sock"
    monkeypatch.delenv("XDG_RUNTIME_DIR")
    d = listen.default_socket_dir()
    assert d == os.path.join(tempfile.gettempdir(), f"radixkv-manager-{os.getuid()}")
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path / "missing"))   # a runtime dir that is not there
    assert listen.default_socket_dir() == d
    for name in (os.path.basename(d), "radixkv-manager"):
        assert not name.isidentifier()          # `import radixkv` can never resolve to it
    assert ServeOptions().address.startswith("unix://") and "radixkv-manager" in ServeOptions().address


def test_import_from_the_temp_dir_is_not_shadowed_by_the_socket_directory(tmp_path):
    """The trap of issue 19: a socket directory named ``radixkv`` in the working directory
    shadowed the package. The default names cannot; and a run from such a directory imports
    the real package."""
    sock_dir = tmp_path / "radixkv-manager-0"
    sock_dir.mkdir(mode=0o700)
    proc = subprocess.run([sys.executable, "-c", "import radixkv; print(radixkv.__version__, radixkv.CacheEngine)"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(__version__)


def test_version_flag(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out.strip() == f"radixkv {__version__}"


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available here")
def test_device_cuda_without_cuda_is_one_line(tmp_path, capsys):
    rc = main(["serve", "--device", "cuda", "--address", f"unix://{tmp_path}/s.sock", "--token", "x" * 16,
               "--log-level", "error"])
    assert rc == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "CUDA is not available" in err[0] and "--device cuda" in err[0]


def test_startup_line_names_version_page_size_policies_metrics_and_outlets():
    opts = ServeOptions(metrics_port=0, sweep_interval_s=0.2, grace_s=1.0)
    with ThreadedServer({"kv_tokens": 128, "page_size": 4, "enable_kv_events": True}, options=opts) as srv:
        line = srv.server.startup_line()
    assert line.startswith(f"radixkv {__version__} cache manager listening on unix://")
    for part in ("page size 4", "eviction lru", "admission every", "128 KV tokens",
                 f"metrics http://127.0.0.1:{srv.server.metrics_port}/metrics", "KV events gRPC WatchEvents"):
        assert part in line, (part, line)
    with ThreadedServer({"kv_tokens": 64}) as srv:
        line = srv.server.startup_line()
    assert "metrics off (--metrics-port)" in line and "KV events off (--enable-kv-events)" in line


def test_close_detaches_the_sessions_the_client_attached():
    with ThreadedServer({"kv_tokens": 128, "lease_ttl_s": 600.0}) as srv:
        with srv.client() as c:
            a = c.attach("a").session
            b = c.attach("b").session
            c.alloc_extend(a, [ExtendItem("r", np.arange(1, 9, dtype=np.int32))])
            c.detach(b)                                          # detached already: not again
        with srv.client() as other:
            st = other.stats()
            assert st.sessions == 0 and st.requests == 0       # a's lease (600 s) did not have to run out
            assert st.kv_held == 0
        c.close()                                                # idempotent


def test_serve_lowercase_log_level_json_logs_and_the_startup_line(tmp_path):
    token = secrets.token_urlsafe(16)
    tok = tmp_path / "token"
    tok.write_text(token)
    os.chmod(tok, 0o600)
    address = f"unix://{tmp_path}/sock/s.sock"
    proc = subprocess.Popen([sys.executable, "-m", "radixkv", "serve", "--address", address, "--token-file",
                             str(tok), "--kv-tokens", "256", "--log-level", "debug", "--log-format", "json"],
                            stderr=subprocess.PIPE, text=True)
    try:
        with connect(address, token=token, wait_s=120) as c:
            s = c.attach("w").session
            c.alloc_extend(s, [ExtendItem("r", np.arange(1, 9, dtype=np.int32))])
            c.release(s, ["r"])
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    records = [json.loads(ln) for ln in err.splitlines() if ln.startswith("{")]
    assert records and all({"time", "level", "logger", "message"} <= set(r) for r in records)
    messages = [r["message"] for r in records]
    assert any(m.startswith(f"radixkv {__version__} cache manager listening on {address}") for m in messages)
    # DEBUG shows radixkv's own decisions, not only gRPC's
    engine = [r for r in records if r["logger"] == "radixkv.engine.embedded"]
    assert any("attached" in r["message"] for r in engine), messages
    assert any("tokens reused" in r["message"] for r in engine), messages
    assert any("was detached" in r["message"] for r in engine), messages   # close() detached the session


def test_serve_flags_give_a_hybrid_host_kv_tier_write_through_and_kv_events(tmp_path):
    """``--write-policy`` and ``--enable-kv-events`` reach a hybrid model's host KV tier
    (``TieredMambaRadixCache``), and ``--storage`` its storage tier, with
    ``--enable-kv-events`` too (storage reads are announced on ``CPU``)."""
    import argparse

    from radixkv.service.server.cli import add_serve_arguments, engine_config_from_args

    from radixkv.cache.hybrid.tiered_mamba_cache import TieredMambaRadixCache
    from radixkv.engine.embedded import CacheEngine

    p = add_serve_arguments(argparse.ArgumentParser())
    flags = ["--layer-types", "FK", "--kv-tokens", "256", "--host-kv-tokens", "512", "--host-state-slots", "4"]
    for policy in ("write_back", "write_through"):
        c = engine_config_from_args(p.parse_args(flags + ["--write-policy", policy, "--enable-kv-events"]))
        assert (c.write_policy, c.enable_kv_events, c.host_kv_tokens, c.host_state_slots) == (policy, True, 512, 4)
        tree = CacheEngine(c).tree
        assert isinstance(tree, TieredMambaRadixCache) and tree.write_policy == policy
        assert tree.kv_events is not None
    for events in ([], ["--enable-kv-events"]):
        eng = CacheEngine(engine_config_from_args(p.parse_args(flags + ["--storage", f"file://{tmp_path}"] + events)))
        assert isinstance(eng.tree, TieredMambaRadixCache) and eng.tree.storage is not None
        assert (eng.tree.kv_events is not None) == bool(events)
        eng.close()
