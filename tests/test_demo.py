"""The README's main job (``make demo``) on a few requests, embedded and through the service
(a real manager process and two spawned workers), plus the walk-through. The demo's own
checks (every logit equal to ``forward_reference``, the manager's invariants, a clean
shutdown) decide its exit code; a deliberately impossible tolerance must make it fail."""
import io
import re

import numpy as np
import pytest
import torch

from radixkv import demo_workers
from radixkv.demo import run_demo, run_walkthrough, scaled_prompts, token_hash


def _run(**kw):
    out = io.StringIO()
    code = run_demo(out=out, **kw)
    return code, out.getvalue()


def _checked(text):
    m = re.search(r"logits checked\s+(\d+)/(\d+) requests equal", text)
    assert m, text
    return int(m.group(1)), int(m.group(2))


def test_walkthrough_runs_and_verifies(capsys):
    assert run_walkthrough("cpu") == 0
    out = capsys.readouterr().out
    assert "conservation holds" in out
    assert "they hold its prompt tokens" in out


def test_scaled_trace_keeps_prefixes():
    prompts, outputs = scaled_prompts(5, 16, 512)
    assert len(prompts) == 5 and outputs.shape == (5,)
    assert all(p.dtype == np.int32 and p.min() >= 0 and p.max() < 512 for p in prompts)
    # every conversation of the trace starts with block 0 (a shared system prompt): 16 equal tokens
    assert all(np.array_equal(p[:16], prompts[0][:16]) for p in prompts)
    assert not np.array_equal(prompts[0][16:32], prompts[1][16:32])
    # 6758 tokens = 13 full blocks + 102 tokens -> 13 * 16 + ceil(102 * 16 / 512) = 212
    assert prompts[0].size == 212
    x = np.arange(1000, dtype=np.int64)
    assert np.array_equal(token_hash(x, 97), token_hash(x.copy(), 97))


def test_embedded_demo_checks_every_request():
    code, out = _run(embedded=True, requests=6)
    assert code == 0, out
    assert _checked(out) == (6, 6)
    assert "invariants         hold" in out and "demo passed" in out
    hit = float(re.search(r"token hit rate\s+([\d.]+)%", out).group(1))
    assert hit > 0  # later requests fork the state checkpointed at the shared first block


def test_a_failed_check_fails_the_demo(monkeypatch):
    monkeypatch.setitem(demo_workers.TOLERANCE, torch.float64, -1.0)  # nothing can pass
    code, out = _run(embedded=True, requests=2)
    assert code == 1
    assert _checked(out) == (0, 2) and "MISMATCH" in out and "demo FAILED" in out


def test_service_demo_with_two_worker_processes():
    code, out = _run(embedded=False, requests=6, timeout_s=240)
    assert code == 0, out
    assert _checked(out) == (6, 6)
    assert "clean (SIGTERM, exit code 0, shared memory removed)" in out
    assert re.search(r"RPC latency\s+p50 [\d.]+ ms, p99 [\d.]+ ms over \d+ calls", out)


@pytest.mark.parametrize("bad", [dict(requests=0), dict(workers=0)])
def test_bad_arguments(bad):
    from radixkv.errors import InvalidArgumentError

    with pytest.raises(InvalidArgumentError):
        run_demo(embedded=True, **bad)
