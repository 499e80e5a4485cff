"""The native LM and lockstep against the NVIDIA reference, token for token (fp32, greedy)."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
import torch

from personaplex_demo.engine.core import LockstepCore
from personaplex_demo.engine.pcm import SamplingParams
from tests.support.stepwise import StepwiseCore

from .conftest import golden
from .lm_fixtures import LM_SEED, golden_voice, tiny_lm
from .support.signals import make_tensor

GREEDY = SamplingParams(greedy=True)


def test_hash_v1_reproduces_every_lm_tensor():
    manifest = golden("lm-tiny.weights.json")
    tensors = manifest["tensors"] if "tensors" in manifest else manifest
    assert len(tensors) == 151
    for key, spec in tensors.items():
        t = make_tensor("lm", key, spec["shape"], LM_SEED)
        assert hashlib.sha256(np.ascontiguousarray(t, dtype="<f4").tobytes()).hexdigest() == spec["sha256"], key


def test_hash_v1_reproduces_golden_voices():
    for name, spec in golden("lm-tiny.voices.json")["voices"].items():
        emb = golden_voice(name).embeddings.numpy()
        assert hashlib.sha256(np.ascontiguousarray(emb, dtype="<f4").tobytes()).hexdigest() == spec["embeddings"]["sha256"]


def run_session(fixture: str, stepwise: bool = True, weights: str = "dense") -> tuple[list, list]:
    """Play a golden lm-session scenario; returns (expected, actual) frames per emitted tick."""
    g = golden(fixture)
    lm = tiny_lm(g["model"]["config_overrides"], weights=weights)
    core = (StepwiseCore if stepwise else LockstepCore)(lm, 1, context=lm.cfg.context)
    core.start(0, golden_voice(g["inputs"]["voice"]), g["inputs"]["persona"], GREEDY, seed=0)
    user = g["inputs"]["user_codes"]
    first = g["summary"]["first_conversation_o"]
    expected, actual = [], []
    ticks = {t["o"]: t for t in g["ticks"]}
    for o in range(0 if stepwise else first, g["ticks"][-1]["o"] + 1):
        codes = torch.tensor([user[o - first] if o >= first else [0] * 8], dtype=torch.long)
        res = core.step(codes)
        rec = ticks.get(o)
        if rec is not None and rec["emitted"]:
            assert bool(res.emitted[0]) and bool(res.live[0]) == (o >= first)
            expected.append((o, rec["out"]))
            actual.append((o, res.frame[0].tolist()))
    return expected, actual


@pytest.mark.parametrize("fixture", ["lm-greedy.json", "lm-wrap.json"])
def test_golden_session_stepwise(fixture):
    expected, actual = run_session(fixture)
    assert len(expected) > 100
    for (o, e), (_, a) in zip(expected, actual):
        assert a == e, f"{fixture}: first difference at o={o}"


@pytest.mark.parametrize("fixture", ["lm-greedy.json", "lm-wrap.json"])
def test_golden_session_fast_prefill(fixture):
    expected, actual = run_session(fixture, stepwise=False)
    assert len(expected) == 80
    for (o, e), (_, a) in zip(expected, actual):
        assert a == e, f"{fixture}: first difference at o={o}"


def test_bf16_session_diagnostic():
    """bf16 has exact logit ties, so the strict fixture is a diagnostic (tests/golden/README.md, "Tolerances and advice"):
    the prompt and the first 40 conversation ticks must still agree with the reference."""
    g = golden("lm-greedy-bf16.json")
    lm = tiny_lm(None, torch.bfloat16)
    core = StepwiseCore(lm, 1, dtype=torch.bfloat16, skip_user_steps=False)
    core.start(0, golden_voice(g["inputs"]["voice"], torch.bfloat16), g["inputs"]["persona"], GREEDY, 0)
    first = g["summary"]["first_conversation_o"]
    user = g["inputs"]["user_codes"]
    ticks = {t["o"]: t for t in g["ticks"]}
    first_diff = None
    for o in range(0, g["ticks"][-1]["o"] + 1):
        res = core.step(torch.tensor([user[o - first] if o >= first else [0] * 8]))
        rec = ticks.get(o)
        if rec and rec["emitted"] and res.frame[0].tolist() != rec["out"]:
            first_diff = o
            break
    assert first_diff is None or first_diff >= first + 40, f"bf16 leaves the reference at o={first_diff}"
