"""The batched engine against the golden batched-recycle scenario, token for token (fp32, greedy)."""

from __future__ import annotations

import pytest
import torch

from personaplex_demo.engine.core import LockstepCore
from personaplex_demo.engine.pcm import SamplingParams
from tests.support.stepwise import StepwiseCore

from .conftest import golden
from .lm_fixtures import golden_voice, tiny_lm

GREEDY = SamplingParams(greedy=True)
G = golden("batched-recycle.json")
SESSIONS = {s["id"]: s for s in G["sessions"]}


def start(core: LockstepCore, slot: int, sid: str) -> None:
    s = SESSIONS[sid]
    core.start(slot, golden_voice(s["voice"]), s["persona"], GREEDY, seed=0)


def test_timeline_stepwise_prompts():
    """Replays the timeline tick by tick: every frame matches, prefill frames included."""
    core = StepwiseCore(tiny_lm(), G["B"])
    start(core, 0, "s0")
    start(core, 1, "s1")
    checked = 0
    for row in G["timeline"]:
        for slot, entry in enumerate(row["slots"]):
            if entry["step"] == "dead" and row["g"] > 0:
                start(core, slot, entry["s"])
        codes = torch.tensor([e.get("user", [0] * 8) for e in row["slots"]], dtype=torch.long)
        res = core.step(codes)
        for slot, entry in enumerate(row["slots"]):
            if entry["out"] is not None:
                assert bool(res.emitted[slot])
                assert bool(res.live[slot]) == (entry["step"] == "live"), (row["g"], slot)
                assert res.frame[slot].tolist() == entry["out"], f"g={row['g']} slot={slot} {entry['s']}"
                checked += 1
    assert checked > 200


@pytest.mark.parametrize("s1_ticks", [13, 14, 15, 16])
def test_recycle_with_fast_prefill_at_every_phase(s1_ticks):
    """Sessions installed from the parallel prefill; slot 1 is recycled after a varying number
    of ticks (every staging-ring phase). Each session equals its fresh reference session."""
    core = LockstepCore(tiny_lm(), 2)
    plan = {0: ["s0"], 1: ["s1", "s2"]}
    n = {0: 0, 1: 0}
    current = {0: "s0", 1: "s1"}
    start(core, 0, "s0")
    start(core, 1, "s1")
    checked = {"s0": 0, "s1": 0, "s2": 0}
    for _ in range(60):
        if current[1] == "s1" and n[1] == s1_ticks:
            current[1], n[1] = "s2", 0
            start(core, 1, "s2")
        codes = torch.tensor([SESSIONS[current[s]]["user_codes"][n[s]] for s in (0, 1)], dtype=torch.long)
        res = core.step(codes)
        for slot in (0, 1):
            sid = current[slot]
            first = SESSIONS[sid]["first_live_tick"] - SESSIONS[sid]["start_tick"]
            o = first + n[slot]
            expected = G["session_ticks"][sid][o - 1]
            assert expected["o"] == o
            assert bool(res.live[slot]) and bool(res.emitted[slot])
            assert res.frame[slot].tolist() == expected["out"], f"{sid} o={o}"
            checked[sid] += 1
            n[slot] += 1
    assert plan and checked["s1"] == s1_ticks and checked["s2"] == 60 - s1_ticks and checked["s0"] == 60
