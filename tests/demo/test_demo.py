"""The README's main job (``make demo``) on a few requests, embedded and through the service
(a real manager process and two spawned workers), plus the walk-through. The demo's own
checks (every logit equal to ``forward_reference``, the manager's invariants, a clean
shutdown) decide its exit code; a deliberately impossible tolerance must make it fail."""
import io
import re

import numpy as np
import pytest
import torch

from radixkv.demo import workers as demo_workers
from radixkv.demo.job import conversation_prompts, run_demo, run_walkthrough, token_hash


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


def test_conversations_resend_their_earlier_turns():
    conv = conversation_prompts(12, 16, 512)
    assert len(conv.prompts) == 12 and conv.outputs.shape == conv.session.shape == (12,)
    assert all(p.dtype == np.int32 and p.min() >= 0 and p.max() < 512 for p in conv.prompts)
    assert conv.n_sessions == len(set(conv.session.tolist())) and conv.n_sessions < 12   # multi-turn
    follow = 0
    for s in range(conv.n_sessions):
        turns = [conv.prompts[i] for i in np.flatnonzero(conv.session == s)]
        for prev, nxt in zip(turns, turns[1:]):
            full = (prev.size - 1) // 16 * 16          # the earlier turn's full blocks come back
            assert nxt.size > full and np.array_equal(nxt[:full], prev[:full])
            follow += 1
    assert follow == 12 - conv.n_sessions
    x = np.arange(1000, dtype=np.int64)
    assert np.array_equal(token_hash(x, 97), token_hash(x.copy(), 97))


def test_embedded_demo_checks_every_request():
    code, out = _run(embedded=True, requests=6)
    assert code == 0, out
    assert _checked(out) == (6, 6)
    assert "invariants         hold" in out and "demo passed" in out
    m = re.search(r"token hit rate\s+([\d.]+)% .* bound \(an unbounded cache, same order\): ([\d.]+)%", out)
    hit, bound = float(m.group(1)), float(m.group(2))
    assert 0 < hit <= bound      # later turns fork the state checkpointed at the earlier turn's end
    assert re.search(r"prefill computed\s+\d+ of \d+ prompt tokens: [\d.]+% of the prefill computation saved", out)


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


def test_the_cli_shows_the_demo_defaults():
    """``radixkv demo --help`` states run_demo's defaults without importing torch for them."""
    import inspect

    from radixkv.cli import DEMO_DEFAULTS

    params = inspect.signature(run_demo).parameters
    assert {k: params[k].default for k in DEMO_DEFAULTS} == DEMO_DEFAULTS
