"""`bash bench/gpu.sh`: its dry run passes anywhere, and without a GPU the real run stops at once."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent


def gpu_sh(*args: str, timeout: float) -> tuple[subprocess.CompletedProcess, float]:
    env = dict(os.environ, PYTHON=sys.executable)
    t0 = time.monotonic()
    done = subprocess.run(["bash", "bench/gpu.sh", *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)
    return done, time.monotonic() - t0


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_without_a_gpu_it_stops_at_once_saying_why():
    done, took = gpu_sh(timeout=60)
    assert done.returncode == 2, done.stderr
    assert "GPU" in done.stderr and "--dry-run" in done.stderr
    assert took < 15, f"took {took:.1f} s"
    assert not done.stdout


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_dry_run_passes_every_check_and_writes_nothing(tmp_path):
    before = (ROOT / "BENCHMARKS.md").read_bytes()
    done, _ = gpu_sh("--dry-run", "--section-file", str(tmp_path / "gpu.md"), timeout=880)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert (ROOT / "BENCHMARKS.md").read_bytes() == before
    section = (tmp_path / "gpu.md").read_text()
    assert "Dry run on the tiny configs" in section and "**FAIL**" not in section
    for check in ("golden lm-greedy, stepwise, fp32", "golden lm-wrap, fast prefill, fp32",
                  "golden batched-recycle", "golden mimi-stream decode", "bf16 engine vs lm-greedy",
                  "CUDA graphs = eager, B = 4", "--slots auto: that many slots run"):
        assert check in section, check
    assert section.count("| pass |") == 9 and section.count("| diagnostic |") == 2
    assert "### Memory per slot and `--slots auto`" in section
