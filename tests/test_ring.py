"""The ring KV cache: the position rule, the prefill mask derived from it, and the reset policy."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from personaplex_demo.engine.core import LMState, LockstepCore
from personaplex_demo.engine.pcm import SamplingParams
from personaplex_demo.model.ring import RingKV, additive, prefill_mask, ring_positions

from .lm_fixtures import golden_persona, golden_voice, tiny_lm


def test_a_wrapped_ring_hides_the_slot_after_the_newest_key():
    cap = 5
    # Not yet wrapped: every written slot holds its own position, the rest are empty.
    assert ring_positions(torch.tensor([3]), cap).tolist() == [[0, 1, 2, -1, -1]]
    # 7 keys: slots hold positions 5, 6, 2, 3, 4; slot 2 (just after the newest) reads as 7.
    assert ring_positions(torch.tensor([7]), cap).tolist() == [[5, 6, 7, 3, 4]]


def stepped_mask(length: int, capacity: int, context: int) -> torch.Tensor:
    """What stepping a ring one key at a time lets each query see, as [L, L] over positions."""
    kv = RingKV.empty(1, 1, 1, capacity, 1, "cpu", torch.float32)
    seen = torch.zeros(length, length, dtype=torch.bool)
    for q in range(length):
        attend = kv.advance(1, context)
        pos = ring_positions(kv.end, capacity)[0]
        for slot in (attend.mask[0, 0, 0] == 0).nonzero()[:, 0].tolist():  # additive: 0 where seen
            seen[q, pos[slot]] = True
    return seen


@pytest.mark.parametrize("length,capacity,context", [(7, 20, 20), (20, 20, 20), (45, 20, 20), (30, 12, 8)])
def test_prefill_mask_equals_stepping_the_ring(length, capacity, context):
    mask = prefill_mask(length, capacity, context, "cpu")[0, 0]
    assert torch.equal(mask, stepped_mask(length, capacity, context))
    d = torch.arange(length).view(-1, 1) - torch.arange(length).view(1, -1)
    assert torch.equal(mask, (d >= 0) & (d <= capacity - 2) & (d < context))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_additive_mask_attends_as_the_boolean_one_bit_for_bit(dtype):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(3, 4, 2, 8, generator=g).to(dtype)  # [B, H, T, Dh]
    k, v = (torch.randn(3, 4, 8, 8, generator=g).to(dtype) for _ in range(2))  # 8 slots
    mask = torch.rand(3, 1, 2, 8, generator=g) < 0.6
    mask[..., 0] = True  # every query sees something
    m = additive(mask, dtype)
    assert m.dtype == dtype and m.stride(-2) % 16 == 0, "rows aligned for CUDA's memory-efficient kernel"
    assert torch.equal(F.scaled_dot_product_attention(q, k, v, mask), F.scaled_dot_product_attention(q, k, v, m))


def test_lm_state_reset_rows_gives_fresh_rows_and_leaves_the_others():
    lm = tiny_lm()
    state = LMState.empty(lm, 3, torch.device("cpu"), torch.float32, 16)
    fresh = LMState.empty(lm, 3, torch.device("cpu"), torch.float32, 16)
    for t in (state.kv.kv, state.ring.cache, state.ring.local, state.text.seed, state.audio.top_k):
        t.random_(1, 100)
    state.kv.end.fill_(9)
    state.ring.provided.fill_(True)
    state.live.fill_(True)
    before = [t.clone() for t in tensors(state)]
    state.reset_rows(torch.tensor([False, True, False]))
    for got, new, old in zip(tensors(state), tensors(fresh), before):
        batch_dim = 2 if got.dim() == 6 else 0  # the KV cache is [layers, 2, B, ...]
        assert torch.equal(got.select(batch_dim, 1), new.select(batch_dim, 1))
        for row in (0, 2):
            assert torch.equal(got.select(batch_dim, row), old.select(batch_dim, row))


def tensors(state: LMState) -> list[torch.Tensor]:
    return [state.kv.kv, state.kv.end, state.ring.cache, state.ring.provided, state.ring.local,
            *vars(state.text).values(), *vars(state.audio).values(), state.live]


def test_a_recycled_row_does_not_inherit_non_finite_keys():
    """A masked slot still enters the attention as 0 x value: a NaN left in a row by an earlier
    call must be gone after the row is recycled, or it would reach every later tick."""
    lm = tiny_lm()
    greedy = SamplingParams(greedy=True)
    voice, persona = golden_voice("voice-A"), golden_persona("persona-A")
    frames = {}
    for poisoned in (False, True):
        core = LockstepCore(lm, 2, context=64)
        if poisoned:
            core.state.kv.kv[:, :, 1] = float("nan")
        core.start(1, voice, persona, greedy, seed=0)
        user = torch.zeros(2, 8, dtype=torch.long)
        frames[poisoned] = torch.stack([core.step(user).frame[1] for _ in range(6)])
    assert torch.equal(frames[True], frames[False])
