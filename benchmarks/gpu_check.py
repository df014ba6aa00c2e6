"""The prepared GPU check (``make gpu-check``, issue 31 item 8): one run, one JSON file.

Steps, each recorded as ``{"status": "pass"|"fail"|"dry", "seconds", ...}``:

1. ``cuda_tests``: every CUDA test (those marked ``cuda`` and the ``[cuda]`` cases of the
   ``device`` fixture: :data:`CUDA_TESTS`) under a JUnit report; it fails if any is skipped.
2. ``kernels``: each Triton kernel against its torch reference on the same inputs: equal
   results (exact for index kernels, ``allclose`` for float ones) and median times.
3. ``tier_copies``: ``bench_tiers``' host -> device page loads and file -> host reads beside
   plain copies of the same bytes.
4. ``cuda_ipc``: a manager's pools mapped by a second (spawned) process; what it writes is read
   back in the manager.

Without CUDA it says so, writes ``{"cuda": false, "ran": false}`` and exits 0. ``--device cpu``
is the dry mode: steps 2-4 run on CPU with tiny sizes (Triton in its interpreter) and step 1 only
collects the tests; nothing in it counts as a GPU result. Exit status 1 when a step fails.

    python benchmarks/gpu_check.py [--device cuda|cpu] [--out build/gpu_check.json]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import xml.etree.ElementTree as ET
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / "build" / "gpu_check.json"
# The whole check's budget on one GPU (issue 31: under 8 minutes); pytest gets most of it.
PYTEST_TIMEOUT_S = 330
# The CUDA tests: those marked ``cuda`` and the ``[cuda]`` cases of the ``device`` fixture (both
# carry the keyword), less the tests of what happens *without* CUDA (skipped where it exists):
# such a test has ``without_cuda`` in its name, and no other test has ``cuda`` in its name.
CUDA_TESTS = "cuda and not without_cuda"


def _want_device(arg: str | None) -> str:
    import torch

    if arg:
        return arg
    return "cuda" if torch.cuda.is_available() else "none"


def _timed_median(fn: Callable[[], Any], reps: int, sync: Callable[[], None]) -> float:
    fn()
    sync()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


# ------------------------------------------------------------------ step 1: the CUDA tests


def step_cuda_tests(device: str, out_dir: Path) -> dict[str, Any]:
    """Run (CUDA) or collect (dry) every CUDA test; on CUDA fail on any skip."""
    report = out_dir / "gpu_check_junit.xml"
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs", "-k", CUDA_TESTS, "tests"]
    if device != "cuda":
        cmd += ["--collect-only"]
    else:
        cmd += [f"--junitxml={report}"]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=PYTEST_TIMEOUT_S)
    except subprocess.TimeoutExpired as e:
        return {"status": "fail", "why": f"pytest ran past {PYTEST_TIMEOUT_S} s", "command": " ".join(cmd),
                "output_tail": str(e.stdout or "")[-3000:]}
    res: dict[str, Any] = {"command": " ".join(cmd[1:]), "returncode": proc.returncode,
                           "seconds": time.perf_counter() - t0,
                           "output_tail": proc.stdout[-3000:] + proc.stderr[-1000:]}
    if device != "cuda":
        collected = [ln for ln in proc.stdout.splitlines() if "::" in ln]
        res.update(status="dry" if proc.returncode == 0 and collected else "fail", collected=len(collected),
                   note="collected only: without CUDA these tests are skipped, so none ran")
        return res
    res.update(junit_verdict(report, proc.returncode))
    return res


def junit_verdict(report: Path, returncode: int) -> dict[str, Any]:
    """Counts of a pytest JUnit report and the verdict: ``pass`` only when pytest exited 0 and
    at least one test ran with no failure, error or skip."""
    counts = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    if report.exists():
        for suite in ET.parse(report).getroot().iter("testsuite"):
            for k in counts:
                counts[k] += int(suite.get(k, 0))
    bad = counts["failures"] or counts["errors"] or counts["skipped"]
    out: dict[str, Any] = {**counts, "status": "pass" if returncode == 0 and counts["tests"] and not bad else "fail"}
    if counts["skipped"]:
        out["why"] = f"{counts['skipped']} CUDA test(s) skipped on a CUDA machine (see output_tail, -rs)"
    elif not counts["tests"]:
        out["why"] = "no test ran"
    return out


# ------------------------------------------------------------------ step 2: Triton vs torch


def _kernel_cases(dev: Any, small: bool) -> dict[str, tuple[Callable[[], Any], Callable[[], Any], bool]]:
    """name -> (torch fn, triton fn, exact): each fn returns what is compared."""
    import numpy as np
    import torch

    from radixkv.kernels.paged_alloc import (
        alloc_decode_torch,
        alloc_decode_triton,
        alloc_extend_torch,
        alloc_extend_triton,
    )
    from radixkv.kernels.state_copy import copy_states
    from radixkv.kernels.write_cache_indices import write_cache_indices
    from radixkv.reference.causal_conv1d import causal_conv1d_update_torch, causal_conv1d_update_triton
    from radixkv.reference.kda_decode import kda_decode_torch, kda_decode_triton

    rng = np.random.default_rng(8)
    gen = torch.Generator().manual_seed(8)
    bs, ps, pages = (8, 16, 256) if small else (256, 16, 1 << 16)

    def t(a: Any, dtype: Any = torch.int64) -> Any:
        return torch.as_tensor(np.asarray(a), dtype=dtype, device=dev)

    pre = rng.integers(0, 40 if small else 2000, bs)
    seq = pre + rng.integers(1, 40 if small else 500, bs)
    last = np.where(pre > 0, rng.integers(1, pages // 2, bs) * ps + (pre - 1) % ps, -1)
    new = int((-(-seq // ps) - (-(-pre // ps))).sum())
    free = rng.permutation(np.arange(1, pages + 1))[:new]
    ext_args = (t(pre), t(seq), t(last), t(free, torch.int32), ps, int((seq - pre).sum()))
    dseq = pre + 1
    dec_args = (t(dseq), t(last), t(rng.permutation(np.arange(1, pages + 1))[:bs], torch.int32), ps)

    rows = rng.choice(np.arange(1, 4 * bs), size=bs, replace=False).tolist()
    width = 2048 if not small else 128
    w_pre = rng.integers(0, width // 2, bs)
    w_ext = rng.integers(0, width // 2, bs)
    prefixes = [t(rng.integers(1, 10_000, int(p))) for p in w_pre]
    loc = t(rng.integers(1, 10_000, int(w_ext.sum())))
    w_args = (rows, w_pre.tolist(), (w_pre + w_ext).tolist(), w_ext.tolist(), loc, prefixes)

    def write(impl: str) -> Any:
        table = torch.full((4 * bs, width), -1, dtype=torch.int32, device=dev)
        write_cache_indices(table, *w_args, impl=impl)
        return table

    slots = 64 if small else 1024
    conv = torch.randn(2 if small else 8, slots + 1, 4, 256, generator=gen).to(dev)
    temporal = torch.randn(2 if small else 8, slots + 1, 4, 64, 64, generator=gen).to(dev)
    src = t(rng.choice(np.arange(1, slots // 2 + 1), bs // 2))
    dst = t(rng.choice(np.arange(slots // 2 + 1, slots + 1), bs // 2, replace=False))

    def fork(backend: str) -> Any:
        c, m = conv.clone(), temporal.clone()
        copy_states(c, m, src, dst, backend=backend)
        return torch.cat([c.flatten(), m.flatten()])

    ch, kw = (64, 4) if small else (4096, 4)
    x = torch.randn(bs, ch, generator=gen).to(dev)
    state = torch.randn(slots + 1, kw - 1, ch, generator=gen).to(dev)
    weight, bias = torch.randn(ch, kw, generator=gen).to(dev), torch.randn(ch, generator=gen).to(dev)
    idx = t(rng.choice(np.arange(1, slots + 1), bs, replace=False))

    def conv_step(fn: Callable[..., Any]) -> Any:
        s = state.clone()
        return torch.cat([fn(x, s, weight, bias, "silu", idx).flatten(), s.flatten()])

    h, dk, dv = (2, 16, 16) if small else (16, 128, 128)
    q, k = torch.randn(bs, h, dk, generator=gen).to(dev), torch.randn(bs, h, dk, generator=gen).to(dev)
    k = torch.nn.functional.normalize(k, dim=-1)
    v = torch.randn(bs, h, dv, generator=gen).to(dev)
    g = -torch.rand(bs, h, dk, generator=gen).to(dev)
    beta = torch.rand(bs, h, generator=gen).to(dev)
    ssm = torch.randn(slots + 1, h, dk, dv, generator=gen).to(dev)

    def kda(fn: Callable[..., Any]) -> Any:
        s = ssm.clone()
        return torch.cat([fn(q, k, v, g, beta, s, idx).flatten(), s.flatten()])

    return {
        "alloc_extend": (lambda: alloc_extend_torch(*ext_args), lambda: alloc_extend_triton(*ext_args), True),
        "alloc_decode": (lambda: alloc_decode_torch(*dec_args), lambda: alloc_decode_triton(*dec_args), True),
        "write_cache_indices": (lambda: write("torch"), lambda: write("triton"), True),
        "copy_states": (lambda: fork("torch"), lambda: fork("triton"), True),
        "causal_conv1d_update": (lambda: conv_step(causal_conv1d_update_torch),
                                 lambda: conv_step(causal_conv1d_update_triton), False),
        "kda_decode": (lambda: kda(kda_decode_torch), lambda: kda(kda_decode_triton), False),
    }


def step_kernels(device: str) -> dict[str, Any]:
    import torch

    dev = torch.device(device)
    sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)
    small = dev.type != "cuda"
    reps = 3 if small else 20
    out: dict[str, Any] = {"status": "pass", "reps": reps, "cases": {}}
    for name, (ref, tri, exact) in _kernel_cases(dev, small).items():
        try:
            a, b = ref(), tri()
            same = torch.equal(a, b) if exact else torch.allclose(a, b, rtol=1e-4, atol=1e-4)
            diff = float((a.double() - b.double()).abs().max()) if a.numel() else 0.0
            case: dict[str, Any] = {"equal": bool(same), "max_abs_diff": diff,
                                    "torch_us": _timed_median(ref, reps, sync) * 1e6,
                                    "triton_us": _timed_median(tri, reps, sync) * 1e6}
        except Exception:
            case = {"equal": False, "error": traceback.format_exc()[-2000:]}
        out["cases"][name] = case
        if not case["equal"]:
            out["status"] = "fail"
    if small and out["status"] == "pass":
        out["status"] = "dry"
    return out


# ------------------------------------------------------------------ step 3: tier copies


def step_tier_copies(device: str) -> dict[str, Any]:
    import torch
    from bench_tiers import bench_host_to_device, bench_storage_to_host

    dev = torch.device(device)
    small = dev.type != "cuda"
    layers, batches, reps = (1, (1, 8), 2) if small else (8, (1, 8, 64, 256), 7)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="radixkv-gpu-check-") as d:
        for ps in (16, 64):
            rows += bench_host_to_device(dev, layers, 8, 128, ps, batches, reps)
            rows += bench_storage_to_host(Path(d), 2 * layers * ps * 8 * 128 * 2, ps, batches, reps)
    return {"status": "dry" if small else "pass", "layout": {"layers": layers, "heads": 8, "head_dim": 128},
            "rows": rows}


# ------------------------------------------------------------------ step 4: a second process maps the pools


def _mapping_worker(address: str, token: str, q: Any) -> None:
    """Attach, map the manager's pools, write K of layer 0 at rows 1..8, report the timings."""
    try:
        import torch
        from radixkv.service.client import connect

        with connect(address, token=token, wait_s=60) as c:
            info = c.attach("gpu-check")
            t0 = time.perf_counter()
            wb = c.worker_buffers(info)
            map_s = time.perf_counter() - t0
            k, _ = wb.get_kv_buffer(0)
            rows = torch.arange(1, 9, device=k.device)
            k[rows] = 7
            if k.device.type == "cuda":
                torch.cuda.synchronize(k.device)
            modes = sorted({p["mapping"]["mode"] for p in info.layout["pools"].values()})
            c.detach(info.session)
        q.put(("ok", {"map_seconds": map_s, "modes": modes, "device": str(k.device)}))
    except BaseException:
        q.put(("error", traceback.format_exc()[-3000:]))


def step_cuda_ipc(device: str) -> dict[str, Any]:
    import multiprocessing as mp

    import torch

    sys.path.insert(0, str(ROOT / "tests"))
    from tooling.testing import ThreadedServer

    ctx = mp.get_context("spawn")
    with ThreadedServer({"device": device, "kv_tokens": 4096}) as srv:
        q = ctx.Queue()
        t0 = time.perf_counter()
        p = ctx.Process(target=_mapping_worker, args=(srv.address, srv.token, q), daemon=True)
        p.start()
        try:
            kind, payload = q.get(timeout=120)
            p.join(30)
        finally:
            if p.is_alive():
                p.kill()
        if kind != "ok":
            return {"status": "fail", "error": payload}
        seen = srv.call(lambda server: server.engine.pools.kv_pool.get_key_buffer(0)[1:9].float().cpu())
        wanted = "cuda_ipc" if device == "cuda" else "shm"
        ok = bool(torch.all(seen == 7)) and payload["modes"] == [wanted]
        status = ("pass" if device == "cuda" else "dry") if ok else "fail"
        return {"status": status, "worker_total_seconds": time.perf_counter() - t0, **payload,
                "manager_sees_worker_writes": bool(torch.all(seen == 7))}


# ------------------------------------------------------------------ main


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="radixkv's GPU check: CUDA tests, kernels, tier copies, CUDA IPC")
    ap.add_argument("--device", choices=["cuda", "cpu"], default=None,
                    help="cuda (default where present) or cpu: the dry mode, no GPU result")
    ap.add_argument("--out", default=str(DEFAULT_OUT))
    ap.add_argument("--steps", nargs="+", default=["cuda_tests", "kernels", "tier_copies", "cuda_ipc"])
    a = ap.parse_args(argv)
    if a.device != "cuda" and "TRITON_INTERPRET" not in os.environ:
        os.environ["TRITON_INTERPRET"] = "1"  # before anything imports Triton
    import torch

    torch.set_num_threads(1 if a.device == "cpu" else torch.get_num_threads())
    device = _want_device(a.device)
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {"cuda": torch.cuda.is_available(), "device": device, "torch": torch.__version__,
                              "python": platform.python_version(), "started": time.strftime("%Y-%m-%dT%H:%M:%SZ",
                                                                                             time.gmtime())}
    if device == "none":
        print("gpu-check: no CUDA device here: NOTHING WAS CHECKED (run it on a CUDA machine; "
              "`--device cpu` runs the dry mode)")
        result.update(ran=False, why="no CUDA device")
        out.write_text(json.dumps(result, indent=1))
        return 0
    if device == "cuda" and not torch.cuda.is_available():
        print("gpu-check: --device cuda but torch sees no CUDA device")
        result.update(ran=False, why="--device cuda without a CUDA device")
        out.write_text(json.dumps(result, indent=1))
        return 1
    if device == "cuda":
        result["gpu"] = torch.cuda.get_device_name(0)
    result["ran"] = True
    result["dry"] = device != "cuda"
    steps: dict[str, Callable[[], dict[str, Any]]] = {
        "cuda_tests": lambda: step_cuda_tests(device, out.parent),
        "kernels": lambda: step_kernels(device),
        "tier_copies": lambda: step_tier_copies(device),
        "cuda_ipc": lambda: step_cuda_ipc(device),
    }
    t_all = time.perf_counter()
    result["steps"] = {}
    for name in a.steps:
        t0 = time.perf_counter()
        try:
            r = steps[name]()
        except Exception:
            r = {"status": "fail", "error": traceback.format_exc()[-3000:]}
        r["seconds"] = time.perf_counter() - t0
        result["steps"][name] = r
        print(f"gpu-check {name}: {r['status']} ({r['seconds']:.1f} s)", flush=True)
        out.write_text(json.dumps(result, indent=1))  # what ran so far survives a timeout
    result["seconds"] = time.perf_counter() - t_all
    failed = [n for n, r in result["steps"].items() if r["status"] == "fail"]
    result["status"] = "fail" if failed else ("dry" if result["dry"] else "pass")
    out.write_text(json.dumps(result, indent=1))
    print(f"gpu-check: {result['status']}{' (dry: CPU, not a GPU result)' if result['dry'] else ''}"
          f"{'; failed: ' + ', '.join(failed) if failed else ''}; results in {out}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
