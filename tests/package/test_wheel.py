"""The wheel, as a new user gets it: built from this checkout, installed into a fresh virtualenv,
and every command ``radixkv --help`` offers run in its smallest case from a directory outside
the checkout.

The virtualenv is fresh (no system site-packages, nothing of this checkout on its path) but
takes radixkv's dependencies (torch, grpcio, ...) from the interpreter running the tests,
through a ``.pth`` file: installing torch again would take minutes and download nothing new.
Those directories' own ``.pth`` files are not processed, so the checkout's editable install
stays invisible there; the test checks that ``radixkv`` is imported from the wheel.
"""
import json
import os
import secrets
import signal
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

pytestmark = pytest.mark.wheel
ROOT = Path(__file__).resolve().parents[2]


def _run(env, *args, cwd, timeout=300, check=True):
    proc = subprocess.run([str(a) for a in args], cwd=cwd, env=env["environ"], capture_output=True, text=True,
                          timeout=timeout)
    if check:
        assert proc.returncode == 0, f"{args}\n{proc.stdout}\n{proc.stderr}"
    return proc


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    base = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                    str(base / "dist"), str(ROOT)], check=True, capture_output=True, timeout=600)
    (wheel,) = (base / "dist").glob("radixkv-*.whl")
    venv = base / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, capture_output=True, timeout=300)
    py = venv / "bin" / "python"
    site = Path(subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True).stdout.strip())
    deps = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    (site / "radixkv_test_deps.pth").write_text("\n".join(sorted(deps)) + "\n")
    subprocess.run([str(py), "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)], check=True,
                   capture_output=True, timeout=300)
    work = base / "elsewhere"          # not the checkout: nothing importable beside the cwd
    work.mkdir()
    environ = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    return {"bin": venv / "bin", "py": py, "site": site, "cwd": work, "wheel": wheel, "environ": environ}


def test_the_wheel_holds_its_data_and_imports_from_itself(env):
    code = ("import importlib.resources as r, pathlib, radixkv\n"
            "print(radixkv.__file__)\n"
            "print(r.files('radixkv.proto').joinpath('cache_manager.proto').read_text()[:2000])\n"
            "print((pathlib.Path(radixkv.__file__).parent / 'py.typed').is_file())\n"
            "from radixkv import RadixCache, TokenToKVPoolAllocator, connect\n")
    out = _run(env, env["py"], "-c", code, cwd=env["cwd"]).stdout.splitlines()
    assert out[0].startswith(str(env["site"]))
    assert any("package radixkv.v1;" in ln for ln in out) and out[-1] == "True"
    lic = list(env["site"].glob("radixkv-*.dist-info/licenses/LICENSE")) or \
        list(env["site"].glob("radixkv-*.dist-info/LICENSE"))
    assert lic and "Apache License" in lic[0].read_text()
    # py.typed promises types: the generated messages' and stub's stubs come along
    gen = env["site"] / "radixkv" / "service" / "wire" / "_gen"
    assert (gen / "cache_manager_pb2.pyi").is_file() and (gen / "cache_manager_pb2_grpc.pyi").is_file()


def test_every_command_the_help_offers_runs_from_the_wheel(env):
    rk = env["bin"] / "radixkv"
    cwd = env["cwd"]
    top = _run(env, rk, "--help", cwd=cwd).stdout
    assert "{demo,bench,serve}" in top
    assert _run(env, rk, "--version", cwd=cwd).stdout.startswith("radixkv ")
    bench = _run(env, rk, "bench", "--help", cwd=cwd).stdout
    assert "usage: radixkv bench {hitrate,cluster}" in bench
    assert "token hit rate" in _run(env, rk, "demo", "--embedded", "--requests", "3", "--decode-tokens", "1",
                                    cwd=cwd).stdout
    assert "they hold its prompt tokens" in _run(env, rk, "demo", "--walkthrough", cwd=cwd).stdout
    svc = _run(env, rk, "demo", "--requests", "3", "--decode-tokens", "1", cwd=cwd, timeout=600).stdout
    assert "demo passed" in svc and "clean (SIGTERM" in svc
    doc = json.loads(_run(env, rk, "bench", "hitrate", "--trace", "conversation", "--limit", "40",
                          "--capacity-frac", "0.5", "--json", "-", cwd=cwd).stdout)
    assert doc["requests"] == 40 and doc["results"]
    cluster = _run(env, rk, "bench", "cluster", "--limit", "40", "--managers", "2", "--routers", "kv,round_robin",
                   "--index", "python", cwd=cwd, timeout=600)
    assert "round_robin" in cluster.stdout


def test_serve_and_connect_from_the_wheel(env):
    cwd = env["cwd"]
    token = secrets.token_urlsafe(16)
    tok = cwd / "token"
    tok.write_text(token)
    os.chmod(tok, 0o600)
    address = f"unix://{cwd}/sock/s.sock"
    server = subprocess.Popen([str(env["bin"] / "radixkv"), "serve", "--address", address, "--token-file",
                               str(tok), "--kv-tokens", "256", "--log-level", "info"], cwd=cwd, env=env["environ"],
                              stderr=subprocess.PIPE, text=True)
    try:
        code = ("import radixkv, numpy as np\n"
                f"with radixkv.connect({address!r}, token_file={str(tok)!r}, wait_s=120) as c:\n"
                "    s = c.attach('w').session\n"
                "    c.alloc_extend(s, [radixkv.ExtendItem('a', np.arange(1, 9, dtype=np.int32))])\n"
                "    c.cache_finished(s, ['a'])\n"
                "    print(c.stats().kv_evictable)\n")
        assert _run(env, env["py"], "-c", code, cwd=cwd, timeout=300).stdout.strip() == "8"
    finally:
        server.send_signal(signal.SIGTERM)
        _, err = server.communicate(timeout=60)
    assert server.returncode == 0, err
    assert "cache manager listening on " + address in err
