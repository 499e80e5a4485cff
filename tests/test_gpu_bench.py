"""`bash bench/gpu.sh`: its dry run passes anywhere, and without a GPU the real run stops at once;
its batches come from the free memory by `--slots auto`'s arithmetic, and its graph check fails
on CUDA when nothing was captured."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from bench.gpu import DRY_RUN_BATCHES, parse_args, plan_run, section_title
from bench.gpu_batches import MAX_BATCH, batch_sizes, largest_realtime, measure_batches, plan_batches, plan_for_card
from bench.gpu_checks import GraphInfo, judge_graphs
from personaplex_demo.model.config import LMConfig, MimiConfig
from personaplex_demo.runtime.capacity import GiB, kv_ring_bytes, plan_slots

ROOT = Path(__file__).resolve().parent.parent
CPU = torch.device("cpu")


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


# ---- batches from the free memory ---------------------------------------------------------------


def full_size_plan(free_gib: float):
    return plan_for_card(free_gib, LMConfig(), MimiConfig(), torch.bfloat16, 50, True)


@pytest.mark.parametrize("free_gib", [80, 24, 141])
def test_the_batches_are_what_the_free_memory_holds(free_gib):
    plan = full_size_plan(free_gib)
    b = plan.batches
    assert b[0] == 1 and all(x < y for x, y in zip(b, b[1:])), b
    assert all(x & (x - 1) == 0 for x in b) and b[-1] <= MAX_BATCH, b
    # The largest B fits by the project's arithmetic (that of `--slots auto`), and the list stops
    # there: twice it does not fit, or is past the cap.
    assert b[-1] * plan.cost.total + plan.reserve_bytes <= plan.free_bytes
    assert 2 * b[-1] > min(plan.fit, MAX_BATCH)
    served = plan_slots("auto", device="cuda", free_bytes=plan.free_bytes, reserve_bytes=plan.reserve_bytes,
                        cost=plan.cost, context_frames=LMConfig().context, max_slots=1 << 20)
    assert plan.search_max == plan.fit == served.fit
    assert plan.free_bytes < free_gib * GiB - 15 * GiB  # the 8.4 B bf16 weights came off first


def test_the_kv_ring_alone_bounds_the_cards():
    cfg = LMConfig()
    kv = kv_ring_bytes(cfg.num_layers, cfg.num_heads, cfg.head_dim, cfg.context, 2)
    assert 64 * kv > 80 * GiB  # so an 80 GB card cannot hold B = 64 at the whole context...
    assert MAX_BATCH not in full_size_plan(80).batches
    assert full_size_plan(141).batches[-1] == MAX_BATCH  # ...and a 141 GB one can
    assert full_size_plan(24).batches in ((1,), (1, 2))


def test_batch_sizes_start_at_one_and_stop_at_the_cap():
    assert batch_sizes(0) == (1,)  # nothing fits: B = 1 is still tried, and its out-of-memory reported
    assert batch_sizes(35) == (1, 2, 4, 8, 16, 32)
    assert batch_sizes(1000) == (1, 2, 4, 8, 16, 32, 64)


def test_no_room_after_the_weights_plans_no_slot():
    plan = plan_batches(LMConfig(), 0, free_bytes=0, total_bytes=16 * GiB, itemsize=2,
                        voice_frames=50, cuda_graphs=True, source="empty")
    assert plan.fit == 0 and plan.batches == (1,) and plan.search_max == 1


@pytest.mark.parametrize("free_gib", [80, 24, 141])
def test_free_gib_plans_by_the_function_the_real_run_uses(free_gib):
    a = parse_args(["--dry-run", "--free-gib", str(free_gib)])
    plan, batches, max_b = plan_run(SimpleNamespace(dtype=torch.bfloat16, voice_t=50, graphs=True), a)
    assert plan == full_size_plan(free_gib)
    assert f"a card with {free_gib} GiB free" in plan.describe()
    assert batches == DRY_RUN_BATCHES and max_b >= batches[-1]  # the tiny configs on this machine


def test_free_gib_must_be_positive():
    with pytest.raises(SystemExit):
        parse_args(["--dry-run", "--free-gib", "0"])


def test_the_section_names_the_device():
    assert section_title(CPU) == "GPU (dry run on cpu)"


# ---- out of memory at one B ---------------------------------------------------------------------


def fake_oom(B: int) -> torch.cuda.OutOfMemoryError:
    return torch.cuda.OutOfMemoryError(f"CUDA out of memory. Tried to allocate {B} GiB")


def test_out_of_memory_at_one_batch_is_reported_and_the_run_goes_on():
    def measure(B: int) -> dict:
        if B >= 16:
            raise fake_oom(B)
        return {"B": B}

    results, notes = measure_batches(measure, (1, 4, 16, 64), CPU)
    assert [r["B"] for r in results] == [1, 4]
    assert notes[0].startswith("out of memory at B=16") and "B = 64 not tried" in notes[1]


def test_the_search_stops_below_what_ran_out_of_memory():
    def measure_ms(B: int) -> float:
        if B >= 6:
            raise fake_oom(B)
        return 50.0

    notes: list[str] = []
    lo, hi, why = largest_realtime(measure_ms, {1: 10.0, 2: 20.0}, 60.0, 8, CPU, notes)
    assert (lo, hi) == (5, 6) and "memory bound" in why
    assert notes and all(n.startswith("out of memory at B=") and n.endswith("(search)") for n in notes)


# ---- the graph check's judgement ----------------------------------------------------------------


def wrappers(captured: int | None, failed: int | None = 0, enabled: bool = True) -> list[GraphInfo]:
    return [GraphInfo(name, enabled, captured, failed) for name in ("lockstep tick", "mimi encode", "mimi decode")]


def test_on_cuda_no_capture_fails_the_graph_check():
    check = judge_graphs(wrappers(0), on_cuda=True, tokens_equal=True, pcm_equal=True)
    assert check.ok is False and "lockstep tick: nothing captured" in check.detail
    # One wrapper that did not capture is enough: Mimi's count as much as the LM's.
    some = [*wrappers(2)[:2], GraphInfo("mimi decode", False, 0, 1)]
    check = judge_graphs(some, on_cuda=True, tokens_equal=True, pcm_equal=True)
    assert check.ok is False and "mimi decode: 1 failed capture" in check.detail
    assert judge_graphs(wrappers(None, None), True, True, True).ok is False  # it must count its captures


def test_on_cuda_captures_and_equal_outputs_pass_the_graph_check():
    check = judge_graphs(wrappers(2), on_cuda=True, tokens_equal=True, pcm_equal=True)
    assert check.ok is True and "mimi decode: 2 captured" in check.detail


def test_outputs_must_be_equal_bit_for_bit():
    assert judge_graphs(wrappers(2), True, tokens_equal=True, pcm_equal=False).ok is False
    assert judge_graphs(wrappers(2), True, tokens_equal=False, pcm_equal=True).ok is False
    assert judge_graphs(wrappers(0, enabled=False), False, True, False).ok is False  # even both eager


def test_on_a_cpu_eager_engines_pass_saying_so():
    check = judge_graphs(wrappers(0, enabled=False), on_cuda=False, tokens_equal=True, pcm_equal=True)
    assert check.ok is True and "both engines eager" in check.detail


# ---- the whole dry run --------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_dry_run_passes_every_check_and_writes_nothing(tmp_path):
    before = (ROOT / "BENCHMARKS.md").read_bytes()
    section_file = tmp_path / "out" / "gpu.md"
    done, _ = gpu_sh("--dry-run", "--free-gib", "24", "--section-file", str(section_file), timeout=880)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert (ROOT / "BENCHMARKS.md").read_bytes() == before
    assert f"to {section_file}" in done.stdout and "BENCHMARKS.md left alone" in done.stdout
    section = section_file.read_text()
    assert section.startswith("## GPU (")
    assert "Dry run on the tiny configs" in section and "**FAIL**" not in section
    for check in ("golden lm-greedy, stepwise, fp32", "golden lm-wrap, fast prefill, fp32",
                  "golden batched-recycle", "golden mimi-stream decode", "bf16 engine vs lm-greedy",
                  "CUDA graphs = eager, B = 4", "--slots auto: that many slots run"):
        assert check in section, check
    assert section.count("| pass |") == 9 and section.count("| diagnostic |") == 2
    gpus = torch.cuda.device_count()
    assert section.count("| skipped |") == (gpus < 2) and "CUDA graphs = eager on cuda:1" in section
    assert "tokens and PCM equal" in section
    assert "a card with 24 GiB free" in section and "batches 1, 2;" in section
    assert "### Memory per slot and `--slots auto`" in section
    # Last, the same engine with int8 weights, beside the bf16 figures.
    int8 = section[section.index("### Int8 weights beside bf16"):]
    assert "| 1 |" in int8 and "92 tensors quantized" in int8 and "Largest B in real time with int8 weights" in int8
