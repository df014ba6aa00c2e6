"""benchmarks/gpu_check.py without a GPU: it says so and exits 0; its steps run in the CPU dry
mode; a skipped CUDA test fails the check."""
import json

import gpu_check
import pytest
import torch


@pytest.mark.skipif(torch.cuda.is_available(), reason="the no-CUDA path")
def test_without_cuda_it_says_so_and_exits_0(tmp_path, capsys):
    out = tmp_path / "r.json"
    assert gpu_check.main(["--out", str(out)]) == 0
    assert "NOTHING WAS CHECKED" in capsys.readouterr().out
    r = json.loads(out.read_text())
    assert r["cuda"] is False and r["ran"] is False and "steps" not in r


@pytest.mark.skipif(torch.cuda.is_available(), reason="the no-CUDA path")
def test_device_cuda_without_cuda_fails(tmp_path):
    assert gpu_check.main(["--device", "cuda", "--out", str(tmp_path / "r.json")]) == 1


def test_dry_mode_runs_the_kernel_and_tier_steps(tmp_path):
    out = tmp_path / "r.json"
    assert gpu_check.main(["--device", "cpu", "--steps", "kernels", "tier_copies", "--out", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["dry"] is True and r["status"] == "dry"
    cases = r["steps"]["kernels"]["cases"]
    assert set(cases) >= {"alloc_extend", "alloc_decode", "write_cache_indices", "copy_states",
                          "causal_conv1d_update", "kda_decode"}
    assert all(c["equal"] for c in cases.values())
    rows = r["steps"]["tier_copies"]["rows"]
    assert {x["part"] for x in rows} == {"host_to_device", "storage_to_host"} and all(x["tier_s"] > 0 for x in rows)


def _junit(path, **counts):
    attrs = " ".join(f'{k}="{v}"' for k, v in counts.items())
    path.write_text(f'<?xml version="1.0"?><testsuites><testsuite name="pytest" {attrs}></testsuite></testsuites>')
    return path


def test_a_skipped_gpu_test_fails_the_check(tmp_path):
    ok = gpu_check.junit_verdict(_junit(tmp_path / "a.xml", tests=5, failures=0, errors=0, skipped=0), 0)
    assert ok["status"] == "pass" and ok["tests"] == 5
    skipped = gpu_check.junit_verdict(_junit(tmp_path / "b.xml", tests=5, failures=0, errors=0, skipped=1), 0)
    assert skipped["status"] == "fail" and "skipped" in skipped["why"]
    failed = gpu_check.junit_verdict(_junit(tmp_path / "c.xml", tests=5, failures=1, errors=0, skipped=0), 1)
    assert failed["status"] == "fail"
    assert gpu_check.junit_verdict(tmp_path / "missing.xml", 0)["status"] == "fail"
