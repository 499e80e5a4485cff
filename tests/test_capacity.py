"""`--slots auto` and `--context`: the slot arithmetic for given free memory, and what the app shows."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from personaplex_demo.model.checkpoint import meta_mimi
from personaplex_demo.model.config import LMConfig, MimiConfig
from personaplex_demo.runtime.build import RuntimeOptions, build_runtime
from personaplex_demo.runtime.capacity import (
    CPU_AUTO_SLOTS,
    GiB,
    NoSlotFitsError,
    SlotCost,
    context_frames,
    kv_ring_bytes,
    parse_slots,
    plan_slots,
    safety_margin,
)
from personaplex_demo.runtime.slot_memory import estimated_tick_bytes, graph_pools, mimi_state_bytes, prefix_cache_bytes
from personaplex_demo.serving.config import PoolConfig
from personaplex_demo.serving.pool import SlotPool
from personaplex_demo.web.page import status_payload

from .lm_fixtures import real_lm_shapes
from .support.int8 import lm_weight_bytes

FULL = LMConfig()
BF16 = 2
MIMI_BYTES = 96_000_000 * 4  # Mimi stays fp32
REAL_LM = real_lm_shapes()
CUDA_CONTEXT = 600 << 20  # what the CUDA runtime itself holds on a card


def full_size_plan(card_bytes: int, seconds: float | None = None, slots: int | str = "auto", max_slots: int = 64,
                   weights: str = "dense"):
    """The plan for PersonaPlex-7B in bf16 (its transformer weights as int8 with `weights="int8"`)
    on a card of `card_bytes`, as the loader computes it from the memory free after loading."""
    frames = context_frames(seconds, FULL.context)
    cost = SlotCost(kv=kv_ring_bytes(FULL.num_layers, FULL.num_heads, FULL.head_dim, frames, BF16),
                    mimi=mimi_state_bytes(meta_mimi(MimiConfig())),
                    activations=estimated_tick_bytes(FULL, frames, BF16) * graph_pools(True))
    reserve = prefix_cache_bytes(FULL, BF16, voice_frames=60, entries=8) + safety_margin(card_bytes)
    free = card_bytes - lm_weight_bytes(REAL_LM, weights, BF16) - MIMI_BYTES - CUDA_CONTEXT
    per_frame = kv_ring_bytes(FULL.num_layers, FULL.num_heads, FULL.head_dim, 1, BF16)
    return plan_slots(slots, device="cuda:0", free_bytes=free, reserve_bytes=reserve, cost=cost,
                      context_frames=frames, max_slots=max_slots, kv_bytes_per_frame=per_frame)


def test_one_slot_of_the_full_model_holds_1_46_gib_of_ring_kv_at_240_s():
    assert kv_ring_bytes(FULL.num_layers, FULL.num_heads, FULL.head_dim, 3000, BF16) / GiB == pytest.approx(1.4648,
                                                                                                             abs=1e-4)
    assert mimi_state_bytes(meta_mimi(MimiConfig())) / (1 << 20) == pytest.approx(15.7, abs=0.1)


def test_a_24_gb_card_does_not_hold_four_slots_at_240_s_but_more_at_a_shorter_context():
    plan = full_size_plan(24 * 10**9)
    assert 1 <= plan.slots < 4 and plan.mode == "auto" and plan.fit == plan.slots
    shorter = full_size_plan(24 * 10**9, seconds=60)
    assert shorter.slots >= 3 * plan.slots
    assert shorter.cost.kv == plan.cost.kv // 4


def test_an_80_gb_card_fills_with_slots_and_a_large_one_is_capped_by_max_slots():
    a100 = full_size_plan(80 * 10**9)
    # (free - reserve) / per slot, and the remainder is less than one more slot.
    assert a100.slots == (a100.free_bytes - a100.reserve_bytes) // a100.cost.total
    assert 30 <= a100.slots <= 40
    assert a100.free_bytes - a100.reserve_bytes - a100.slots * a100.cost.total < a100.cost.total
    h200 = full_size_plan(141 * 10**9, max_slots=64)
    assert h200.fit > 64 and h200.slots == 64
    assert "capped by --max-slots 64" in h200.describe()
    assert full_size_plan(141 * 10**9, max_slots=200).slots == h200.fit
    # What set the number, as /api/status tells it once every slot is held (web/status.py `limited_by`).
    assert (a100.bound, h200.bound, full_size_plan(80 * 10**9, slots=8).bound) == ("memory", "--max-slots", "--slots")
    assert a100.as_dict()["bound"] == "memory"


def test_a_room_of_several_engines_is_bound_by_memory_only_when_every_engine_is(tmp_path):
    from personaplex_demo.orchestration.engine_process import RemoteRuntime
    from personaplex_demo.runtime.tiny import build_tiny_tokenizer

    def facts(bound: str, tmp) -> dict:
        return {"voice_names": ["NATF2"], "tokenizer_path": str(tmp), "max_persona_tokens": 64,
                "model_name": "personaplex-7b-v1", "is_tiny": False, "banner": None, "capacity": {"bound": bound}}

    tokenizer = build_tiny_tokenizer(tmp_path / "tokenizer.model")
    memory, setting = facts("memory", tokenizer), facts("--slots", tokenizer)
    assert RemoteRuntime.from_facts(memory, [memory]).capacity_facts()["bound"] == "memory"
    assert RemoteRuntime.from_facts(memory, [setting]).capacity_facts()["bound"] == "slots"
    assert RemoteRuntime.from_facts(setting, [memory]).capacity_facts()["bound"] == "slots"
    assert RemoteRuntime.from_facts(memory).capacity_facts()["bound"] == "memory"


def test_no_room_for_one_slot_names_context_and_the_context_that_fits():
    with pytest.raises(NoSlotFitsError) as err:
        full_size_plan(20 * 10**9)  # 2.4 GB left after the weights; the reserve takes most of it
    msg = str(err.value)
    assert "--context 240" in msg and "not even one conversation slot fits on cuda:0" in msg
    assert "\n" not in msg
    # 1000 bytes left for a slot of 10 bytes per frame: 100 frames, 8 s.
    with pytest.raises(NoSlotFitsError, match=r"--context 8 or less"):
        plan_slots("auto", device="cuda:0", free_bytes=1_500, reserve_bytes=500, cost=SlotCost(2000, 0, 0),
                   context_frames=200, kv_bytes_per_frame=10)
    cost = SlotCost(kv=1000, mimi=0, activations=0)
    with pytest.raises(NoSlotFitsError, match="too small"):
        plan_slots("auto", device="cuda:0", free_bytes=100, reserve_bytes=500, cost=cost, context_frames=100,
                   kv_bytes_per_frame=10)


def test_cpu_auto_is_four_and_fixed_counts_are_kept():
    cost = SlotCost(kv=1, mimi=1, activations=1)
    auto = plan_slots("auto", device="cpu", free_bytes=None, reserve_bytes=0, cost=cost, context_frames=3000)
    assert auto.slots == CPU_AUTO_SLOTS == 4 and auto.mode == "auto-cpu"
    assert plan_slots("auto", device="cpu", free_bytes=None, reserve_bytes=0, cost=cost, context_frames=3000,
                      max_slots=2).slots == 2
    assert plan_slots(7, device="cpu", free_bytes=None, reserve_bytes=0, cost=cost, context_frames=3000).slots == 7
    fixed = full_size_plan(24 * 10**9, slots=6)
    assert fixed.slots == 6 and fixed.mode == "fixed" and fixed.fit < 6
    assert "would fit" in fixed.describe()


def test_parse_slots_and_context():
    assert parse_slots("auto") == "auto" and parse_slots(" AUTO ") == "auto" and parse_slots("12") == 12
    for bad, complaint in (("0", "must be at least 1, not 0"), ("-3", "must be at least 1, not -3"),
                           ("many", "'many' is neither auto nor a whole number"), ("2.5", "'2.5' is neither")):
        with pytest.raises(ValueError, match=complaint):
            parse_slots(bad)
    assert context_frames(None, 3000) == 3000
    assert context_frames(240, 3000) == 3000 and context_frames(60, 3000) == 750 and context_frames(1.6, 3000) == 20
    for bad in (0.5, 241, float("nan"), -10):
        with pytest.raises(ValueError, match=r"--context must be between 1 and 240 seconds"):
            context_frames(bad, 3000)


def test_app_flags(capsys):
    from personaplex_demo.cli.config import parse_config

    cfg = parse_config([], environ={})
    assert cfg.slots == "auto" and cfg.context is None and cfg.max_slots == 64
    cfg = parse_config(["--slots", "6", "--context", "90", "--max-slots", "8"], environ={})
    assert (cfg.slots, cfg.context, cfg.max_slots) == (6, 90.0, 8)
    cfg = parse_config([], environ={"PERSONAPLEX_SLOTS": "AUTO", "PERSONAPLEX_CONTEXT": "30"})
    assert cfg.slots == "auto" and cfg.context == 30.0
    for argv, complaint in ((["--slots", "0"], "argument --slots: must be at least 1, not 0"),
                            (["--slots", "some"], "argument --slots: 'some' is neither auto nor a whole number"),
                            (["--context", "500"], "argument --context: must be between 1 and 240, not 500"),
                            (["--max-slots", "0"], "argument --max-slots: must be at least 1, not 0")):
        with pytest.raises(SystemExit) as e:
            parse_config(argv, environ={})
        assert e.value.code == 2 and complaint in capsys.readouterr().err


def test_the_runtime_logs_and_reports_its_plan(tiny_cache_dir, caplog):
    with caplog.at_level(logging.INFO, logger="personaplex_demo.runtime.build"):
        runtime = build_runtime(RuntimeOptions(model="tiny", cache_dir=tiny_cache_dir, context=context_frames(8, 3000)))
    assert runtime.engine.batch_size == 4 and runtime.capacity.slots == 4
    assert runtime.engine.core.context == 100 and runtime.engine.core.state.kv.capacity == 100
    logged = [r.getMessage() for r in caplog.records if r.getMessage().startswith("slots: ")]
    assert logged and "4 slots on the CPU" in logged[0] and "at 8 s = 100 frames" in logged[0]
    pool = SlotPool(runtime.engine, PoolConfig())
    payload = json.loads(json.dumps(status_payload(runtime, pool)))
    cap = payload["capacity"]
    assert cap["slots"] == 4 and cap["mode"] == "auto-cpu" and cap["context_frames"] == 100
    lm = runtime.engine.core.lm
    assert cap["cost"]["kv"] == kv_ring_bytes(lm.cfg.num_layers, lm.cfg.num_heads, lm.cfg.head_dim, 100, 4)
    assert cap["arithmetic"] == runtime.capacity.describe()


def test_max_slots_caps_auto_on_the_cpu(tiny_cache_dir):
    runtime = build_runtime(RuntimeOptions(model="tiny", cache_dir=tiny_cache_dir, max_slots=2))
    assert runtime.engine.batch_size == 2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_auto_on_cuda_measures_and_fits(tiny_cache_dir):
    runtime = build_runtime(RuntimeOptions(model="tiny", device="cuda", cache_dir=tiny_cache_dir, max_slots=8))
    plan = runtime.capacity
    assert plan.mode == "auto" and plan.free_bytes > 0 and 1 <= plan.slots <= 8


def test_int8_weights_what_fits_on_12_16_and_24_gb_cards():
    # bf16: a 16 GB card cannot even hold the weights; int8 halves the transformer's.
    assert lm_weight_bytes(REAL_LM, "dense", BF16) / GiB == pytest.approx(15.59, abs=0.01)
    assert lm_weight_bytes(REAL_LM, "int8", BF16) / GiB == pytest.approx(8.26, abs=0.01)
    with pytest.raises(NoSlotFitsError):
        full_size_plan(16 * 10**9, seconds=60)
    assert full_size_plan(16 * 10**9, weights="int8").slots == 1
    assert full_size_plan(16 * 10**9, seconds=60, weights="int8").slots == 5
    # 24 GB: one slot in bf16 at the model's 240 s, six with int8 weights.
    assert full_size_plan(24 * 10**9).slots == 1
    assert full_size_plan(24 * 10**9, weights="int8").slots == 6
    assert full_size_plan(24 * 10**9, seconds=60, weights="int8").slots == 24
    assert full_size_plan(24 * 10**9, seconds=60).slots == 6
    assert full_size_plan(48 * 10**9).slots == 16 and full_size_plan(48 * 10**9, weights="int8").slots == 21
    assert full_size_plan(80 * 10**9).slots == 35 and full_size_plan(80 * 10**9, weights="int8").slots == 40
    # 12 GB: the int8 weights load, but the reserve (8 cached prompts and the margin) leaves no slot.
    for seconds in (None, 60, 30):
        with pytest.raises(NoSlotFitsError, match="1.97 GiB free after the weights, 3.28 GiB reserved"):
            full_size_plan(12 * 10**9, seconds=seconds, weights="int8")
    assert full_size_plan(80 * 10**9, seconds=60).slots == 64  # the --max-slots cap, either way
    assert full_size_plan(80 * 10**9, seconds=60, weights="int8").slots == 64
