"""Acceptance rules on hand-built logits, and the sampling path's distribution."""

from __future__ import annotations

import pytest
import torch

from viasd.decoding.acceptance import SamplingParams, greedy_accept, logits_to_probs, speculative_sampling

V = 6


def peaked(tokens: list[int], vocab: int = V) -> torch.Tensor:
    """Logits [len(tokens), vocab]: 100 at the wanted token, -100 elsewhere (as vLLM's tests)."""
    logits = torch.full((len(tokens), vocab), -100.0)
    logits[torch.arange(len(tokens)), torch.tensor(tokens)] = 100.0
    return logits


@pytest.mark.parametrize(
    "draft, target, expected",
    [
        ([1, 2, 3], [1, 2, 3, 4], (3, 4)),  # all accepted + bonus
        ([1, 2, 3], [5, 2, 3, 4], (0, 5)),  # first rejected: recovered token from the target
        ([1, 2, 3], [1, 2, 0, 4], (2, 0)),
        ([], [4], (0, 4)),  # no drafts: one plain step
    ],
)
def test_greedy_accept(draft, target, expected):
    assert greedy_accept(torch.tensor(draft, dtype=torch.long), peaked(target)) == expected


def test_speculative_sampling_with_peaked_distributions():
    g = torch.Generator().manual_seed(0)
    draft = torch.tensor([1, 2, 3])
    q = torch.softmax(peaked([1, 2, 3]), -1)
    assert speculative_sampling(draft, q, torch.softmax(peaked([1, 2, 3, 4]), -1), g) == (3, 4)
    # p puts no mass on the draft at position 1: rejected there, residual = p
    assert speculative_sampling(draft, q, torch.softmax(peaked([1, 5, 3, 4]), -1), g) == (1, 5)
    # deterministic drafter (q = None): same rule with q one-hot at the draft
    assert speculative_sampling(draft, None, torch.softmax(peaked([1, 2, 0, 4]), -1), g) == (2, 0)


def tv(counts: torch.Tensor, p: torch.Tensor) -> float:
    return 0.5 * (counts / counts.sum() - p).abs().sum().item()


@pytest.mark.parametrize("deterministic", [False, True])
def test_first_committed_token_follows_p(deterministic):
    """Empirical distribution over N = 20000 rounds of the first committed token is p.
    Bound: TV < 0.02; with V = 6 the sampling noise alone gives TV ~ 0.006."""
    g = torch.Generator().manual_seed(1)
    p = torch.softmax(torch.randn(2, V, generator=g) * 1.5, -1)  # target for position 0 (and bonus)
    q = torch.softmax(torch.randn(1, V, generator=g) * 1.5, -1)  # draft distribution
    counts = torch.zeros(V)
    n = 20_000
    for _ in range(n):
        x = torch.multinomial(q[0], 1, generator=g) if not deterministic else torch.tensor([2])
        n_acc, nxt = speculative_sampling(x, None if deterministic else q, p, g)
        counts[int(x[0]) if n_acc else nxt] += 1
    assert tv(counts, p[0]) < 0.02


def test_logits_to_probs_temperature_and_top_p():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    assert torch.equal(logits_to_probs(logits, SamplingParams(0.0)), torch.tensor([[1.0, 0, 0, 0]]))
    p = logits_to_probs(logits, SamplingParams(1.0))
    assert torch.allclose(p, torch.softmax(logits, -1))
    # top_p = 0.7 keeps the two most likely tokens (0.64 + 0.24 >= 0.7), renormalised
    nucleus = logits_to_probs(logits, SamplingParams(1.0, top_p=0.7))
    assert (nucleus[0, 2:] == 0).all() and torch.allclose(nucleus[0, :2], p[0, :2] / p[0, :2].sum())
    sharp = logits_to_probs(logits, SamplingParams(0.5))
    assert sharp[0, 0] > p[0, 0]


def test_argmax_is_torchs_first_maximum_for_every_layout():
    from viasd.decoding.acceptance import argmax

    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 300, generator=g)
    x[0, 7] = x[0, 200] = x[0].max() + 1  # a tie: the first index wins
    x[1, :] = float("-inf")
    x[1, 5] = 0.0  # a reduced head's row
    x[2, 150:] = float("-inf")
    cases = [x, x[3], x.t().contiguous().t(), x[:, ::2], x.to(torch.bfloat16), x.to(torch.float64), torch.randn(2, 3, 50, generator=g)]
    for t in cases:
        got = argmax(t)
        assert got.dtype == torch.int64 and got.shape == t.shape[:-1] and torch.equal(got, t.argmax(-1))
    assert int(argmax(x[0])) == 7


def test_first_among_is_the_masked_rows_first_maximum():
    """`first_among(x, ids)`: x's argmax with every entry outside `ids` set to -inf, for ids in any
    order, ties (the lowest id wins, inside `ids` or across it), NaN, and x's own maximum in or out."""
    from viasd.decoding.acceptance import first_among

    g = torch.Generator().manual_seed(1)
    for trial in range(200):
        x = torch.randn(400, generator=g).round(decimals=1)  # (rounded: ties are common)
        if trial % 7 == 0:
            x[torch.randint(400, (2,), generator=g)] = float("nan")
        ids = torch.randperm(400, generator=g)[: int(torch.randint(1, 160, (1,), generator=g))]  # (both sides of SCAN)
        if trial % 3 == 0:
            ids = torch.cat([ids, x.argmax(-1, keepdim=True)])  # x's own maximum among them
        masked = torch.full_like(x, float("-inf")).index_copy_(0, ids, x[ids])
        assert first_among(x, ids.tolist()) == first_among(x, tuple(ids.tolist())) == int(masked.argmax()), trial
    x = torch.zeros(10)
    assert first_among(x, [9, 4, 6]) == 4 and first_among(x, [9, 0]) == 0
    x = torch.tensor([3.0, 1.0, 2.0, 2.0], dtype=torch.bfloat16)  # (a model of half-precision logits)
    assert first_among(x, [3, 2]) == 2 and first_among(x, [1, 0]) == 0
    rows = torch.tensor([[0.0, 5.0, 1.0, 1.0], [4.0, 0.0, 2.0, 2.0]])  # (a pass' second row: a strided view)
    assert first_among(rows[1], [3, 2, 1]) == 2 and first_among(rows.t()[2], [0, 1]) == 1
    with pytest.raises(IndexError, match="out of range"):
        first_among(torch.zeros(10), [3, 10])
    with pytest.raises(ValueError, match="at least one"):
        first_among(torch.zeros(10), [])
