"""Rows and batch buckets: which row holds which slot, and every per-row streaming state's
`head` (the first rows as a batch of their own) and `move_row` (a conversation moved down)."""

from __future__ import annotations

import pytest
import torch

from personaplex_demo.engine.core import LMState
from personaplex_demo.engine.rows import RowPlaces, batch_bucket, batch_buckets
from personaplex_demo.engine.sampling import SamplingState
from personaplex_demo.engine.staging import StagingRing
from personaplex_demo.model.config import MimiConfig
from personaplex_demo.model.mimi import Mimi
from personaplex_demo.model.ring import RingKV

from .lm_fixtures import tiny_lm


def test_buckets_are_powers_of_two_and_the_slot_count():
    assert batch_buckets(1) == [1]
    assert batch_buckets(12) == [1, 2, 4, 8, 12]
    assert batch_buckets(16) == [1, 2, 4, 8, 16]
    assert [batch_bucket(n, batch_buckets(12)) for n in (0, 1, 2, 3, 5, 9, 12)] == [1, 1, 2, 4, 8, 12, 12]


def test_new_calls_take_the_lowest_free_row_and_the_highest_move_down_when_it_shrinks_the_batch():
    places, buckets = RowPlaces(8), batch_buckets(8)
    assert [places.take(s) for s in (5, 2, 7, 0)] == [0, 1, 2, 3]
    assert places.take(2) == 1  # a slot keeps its row
    assert places.compaction(buckets) == []
    places.free(5)
    places.free(2)
    assert places.top == 4 and places.held == 2
    # Two calls fit a batch of 2: the highest row moves to the lowest free one, twice.
    assert places.compaction(buckets) == [(3, 0), (2, 1)]
    assert places.row_of[0] == 0 and places.row_of[7] == 1 and places.slot_at[2:] == [None] * 6
    assert places.compaction(buckets) == [] and places.top == 2
    assert list(places.slots_in(4)) == [0, 7, -1, -1]


def test_no_move_while_the_bucket_would_stay_the_same():
    places, buckets = RowPlaces(8), batch_buckets(8)
    for s in range(6):
        places.take(s)
    places.free(1)
    assert places.compaction(buckets) == []  # 5 calls need a batch of 8, as rows 0 and 2..5 do
    places.free(2)
    assert places.compaction(buckets) == [(5, 1), (4, 2)]  # 4 calls fit a batch of 4: rows 0..3


def _states():
    lm = tiny_lm()
    mimi = Mimi(MimiConfig.tiny())
    return {
        "RingKV": lambda: RingKV.empty(2, 4, 2, 6, 3, "cpu", torch.float32),
        "StagingRing": lambda: StagingRing(4, lm.cfg.delays, "cpu"),
        "SamplingState": lambda: SamplingState.empty(4, "cpu"),
        "LMState": lambda: LMState.empty(lm, 4, torch.device("cpu"), torch.float32, 8),
        "MimiState": lambda: mimi.init_state(4, torch.device("cpu")),
    }


def _tensors(state) -> list[torch.Tensor]:
    """Every tensor of a state, walking its attributes in a fixed order."""
    if isinstance(state, torch.Tensor):
        return [state]
    if isinstance(state, (list, tuple)):
        return [t for s in state for t in _tensors(s)]
    if hasattr(state, "__dict__"):
        # Not per row: the layers' views of the cache, and the staging ring's constants.
        skip = {"layers", "delays", "initial"}
        return [t for k in sorted(vars(state)) if k not in skip for t in _tensors(vars(state)[k])]
    return []


def _batch_dim(t: torch.Tensor) -> int:
    return 2 if t.dim() == 6 else 0  # a RingKV's caches are [L, 2, B, ...]; everything else leads with B


@pytest.mark.parametrize("name", ["RingKV", "StagingRing", "SamplingState", "LMState", "MimiState"])
def test_every_row_state_has_a_head_that_shares_storage_and_moves_rows_exactly(name):
    state = _states()[name]()
    g = torch.Generator().manual_seed(0)
    for t in _tensors(state):
        if t.dtype == torch.bool:
            t.copy_(torch.rand(t.shape, generator=g) > 0.5)
        elif t.dtype.is_floating_point:
            t.copy_(torch.randn(t.shape, generator=g))
        else:
            t.copy_(torch.randint(0, 100, t.shape, generator=g))
    before = [t.clone() for t in _tensors(state)]
    head = state.head(2)
    for whole, part in zip(_tensors(state), _tensors(head), strict=True):
        dim = _batch_dim(whole)
        assert part.shape[dim] == 2 and part.untyped_storage().data_ptr() == whole.untyped_storage().data_ptr()
        assert torch.equal(part, whole.narrow(dim, 0, 2))
    state.move_row(3, 1)
    for old, new in zip(before, _tensors(state), strict=True):
        dim = _batch_dim(new)
        assert torch.equal(new.select(dim, 1), old.select(dim, 3))
        for row in (0, 2):
            assert torch.equal(new.select(dim, row), old.select(dim, row))
    if name == "LMState":
        assert not bool(state.live[3])  # the row it left is no longer in conversation
