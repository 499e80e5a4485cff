"""The batched sampler: noise that belongs to the token, top-k buckets that change nothing, and
draws that follow the distribution."""

from __future__ import annotations

import torch

from personaplex_demo.engine.sampling import SamplingState, TopK, sample, stream_keys, top_k_bucket


def knobs(batch: int, top_k: int, k: int, temperature: float = 1.0, greedy: bool = False) -> TopK:
    state = SamplingState.empty(batch, "cpu")
    for row in range(batch):
        state.set_row(row, temperature, top_k, greedy, seed=row)
    return TopK.prepare(state, k)


def keys(batch: int, tick: int = 7, stream: int = 0) -> torch.Tensor:
    seeds = torch.arange(batch).view(-1, 1) * 7919
    return stream_keys(seeds, torch.full((batch,), tick), torch.tensor([stream]))


def test_tied_tokens_are_chosen_alike_whatever_order_topk_lists_them(monkeypatch):
    """Groups of equal logits: the chosen token must not depend on the order of the ties."""
    B, V = 64, 40
    logits = torch.randint(0, 5, (B, V)).float()
    n = knobs(B, top_k=V, k=V)
    first = sample(logits, n, keys(B))
    real_topk = torch.Tensor.topk

    def ties_reversed(self, k, dim=-1, largest=True, sorted=True):
        # Descending probability, ties in descending token id: another valid topk answer.
        values, order = torch.sort(self.flip(-1), dim=-1, descending=True, stable=True)
        assert torch.equal(values[..., :k], real_topk(self, k, dim)[0])
        return values[..., :k], self.shape[-1] - 1 - order[..., :k]

    monkeypatch.setattr(torch.Tensor, "topk", ties_reversed)
    assert torch.equal(sample(logits, n, keys(B)), first)


def test_a_wider_bucket_than_the_top_k_changes_no_token():
    B, V = 32, 3000
    logits = torch.randn(B, V) * 3
    narrow = sample(logits, knobs(B, top_k=25, k=top_k_bucket(25, V)), keys(B))
    wide = sample(logits, knobs(B, top_k=25, k=2048), keys(B))
    assert top_k_bucket(25, V) == 32 and torch.equal(narrow, wide)


def test_ties_at_a_rows_kth_place_are_kept_together_whatever_the_bucket(monkeypatch):
    """Ranks 3..8 tie; a top-k of 5 cuts through them. The kept set (and so the token) must not
    depend on how many candidates the batch ranks or on the order of the tied ones."""
    B, V = 256, 64
    logits = torch.full((B, V), -5.0)
    logits[:, :3] = torch.tensor([3.0, 2.5, 2.0])
    logits[:, 10:16] = 1.0
    draws = [sample(logits, knobs(B, top_k=5, k=k), keys(B)) for k in (16, 32, 64)]
    real_topk = torch.Tensor.topk

    def ties_reversed(self, k, dim=-1, largest=True, sorted=True):
        values, order = torch.sort(self.flip(-1), dim=-1, descending=True, stable=True)
        return values[..., :k], self.shape[-1] - 1 - order[..., :k]

    monkeypatch.setattr(torch.Tensor, "topk", ties_reversed)
    draws.append(sample(logits, knobs(B, top_k=5, k=16), keys(B)))
    monkeypatch.setattr(torch.Tensor, "topk", real_topk)
    assert all(torch.equal(d, draws[0]) for d in draws)
    assert set(draws[0].tolist()) >= {0, 1, 2} and set(draws[0].tolist()) & set(range(10, 16))
    assert set(draws[0].tolist()) <= {0, 1, 2, *range(10, 16)}, "nothing less probable than the 5th"


def test_draws_follow_the_softmax_and_respect_top_k():
    B = 20000
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, 3.0]]).expand(B, -1)
    got = sample(logits, knobs(B, top_k=3, k=5), keys(B))
    kept = torch.softmax(logits[0], -1)[[0, 1, 4]]
    expected = kept / kept.sum()
    counts = torch.bincount(got, minlength=5).float() / B
    assert counts[2] == 0 and counts[3] == 0, "tokens past the row's top-k are never drawn"
    assert torch.allclose(counts[[0, 1, 4]], expected, atol=0.015), (counts, expected)


def test_greedy_rows_take_the_first_maximum_and_keys_separate_streams():
    B = 8
    logits = torch.zeros(B, 10)
    logits[:, 3] = logits[:, 6] = 1.0
    assert sample(logits, knobs(B, top_k=10, k=10, greedy=True), keys(B)).tolist() == [3] * B
    seeds = torch.zeros(1, 9, dtype=torch.long)
    k = stream_keys(seeds, torch.tensor([5]), torch.arange(9))
    assert len(set(k[0].tolist())) == 9, "each of a tick's nine draws has its own key"
