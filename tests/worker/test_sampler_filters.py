"""Sampler filters (top-k, top-p, min-p, alone and combined, and disabled
ones as exact no-ops) and the distributions the sampler draws from
(temperature, renormalization after filtering, seeded rows).

Random draws use fixed seeds, so every statistical check is deterministic: a
tolerance here is about the maths being right, not about flakiness.
"""

from __future__ import annotations

import math

import pytest
import torch

from tests.worker.sampler_helpers import allowed_tokens, draws, randn, sample
from tinyengine.sampling_params import SamplingParams
from tinyengine.worker.sampler import Sampler
from tinyengine.worker.sampling_filters import cutoff

# ------------------------------------------------------------------ filters


@pytest.mark.parametrize("k", [1, 3, 10])
def test_top_k_only_k_largest(k: int) -> None:
    row = randn(1, 60, seed=k)
    chosen = set(draws(row, SamplingParams(temperature=2.0, top_k=k)))
    top = set(row[0].topk(k).indices.tolist())
    assert chosen <= top
    assert len(chosen) == k, "with T=2 and 4000 draws every kept token shows up"


def test_top_k_per_row_in_mixed_batch() -> None:
    ks = [1, 3, 10, -1, 0, 60]
    logits = randn(len(ks) * 300, 60, seed=5)
    params = [SamplingParams(temperature=1.5, top_k=ks[i % len(ks)]) for i in range(len(logits))]
    out = sample(logits, params)
    for i, tok in enumerate(out.token_ids):
        k = params[i].top_k
        if k > 0:
            assert tok in logits[i].topk(k).indices.tolist()


@pytest.mark.parametrize("top_p", [0.05, 0.3, 0.8, 0.95])
def test_top_p_in_nucleus(top_p: float) -> None:
    row = randn(1, 80, seed=11)
    params = SamplingParams(temperature=1.0, top_p=top_p)
    chosen = set(draws(row, params))
    assert chosen <= allowed_tokens(row[0], params)
    if top_p == 0.05:
        assert chosen == {int(row.argmax())}, "top token is always kept"


@pytest.mark.parametrize("min_p", [0.01, 0.1, 0.5, 1.0])
def test_min_p_above_threshold(min_p: float) -> None:
    row = randn(1, 80, seed=12)
    chosen = draws(row, SamplingParams(temperature=0.9, min_p=min_p))
    probs = torch.softmax(row[0] / 0.9, dim=0)
    floor = min_p * probs.max() * (1 - 1e-5)
    assert all(probs[t] >= floor for t in chosen)
    if min_p == 1.0:
        assert set(chosen) == {int(row.argmax())}


def test_combined_filters() -> None:
    row = randn(1, 100, seed=13, scale=1.5)
    for params in (
        SamplingParams(temperature=0.8, top_k=15, top_p=0.7),
        SamplingParams(temperature=1.3, top_k=30, min_p=0.1),
        SamplingParams(temperature=1.0, top_p=0.6, min_p=0.2),
        SamplingParams(temperature=1.7, top_k=8, top_p=0.9, min_p=0.05),
    ):
        chosen = set(draws(row, params))
        assert chosen <= allowed_tokens(row[0], params), params


def test_disabled_filters_are_exact_no_ops() -> None:
    """A row with filters off draws the very same tokens whether the batch takes
    the fast path (no filters anywhere) or the filter path (another row filters)."""
    vocab, steps = 64, 30
    target_variants = [
        SamplingParams(temperature=1.0, seed=5),
        SamplingParams(temperature=1.0, top_k=-1, top_p=1.0, min_p=0.0, seed=5),
        SamplingParams(temperature=1.0, top_k=0, seed=5),
        SamplingParams(temperature=1.0, top_k=vocab, seed=5),  # k >= vocab keeps all
    ]
    filtering = SamplingParams(temperature=1.0, top_k=3, top_p=0.5, min_p=0.2)
    reference = None
    for target in target_variants:
        for with_filter_row in (False, True):
            sampler = Sampler("cpu")
            gen = sampler.new_generator(5)
            tokens = []
            for step in range(steps):
                row = randn(1, vocab, seed=step)
                if with_filter_row:
                    logits = torch.cat([randn(1, vocab, seed=500 + step), row])
                    out = sampler(logits, [filtering, target], [None, gen])
                    tokens.append(out.token_ids[1])
                else:
                    tokens.append(sampler(row, [target], [gen]).token_ids[0])
            reference = reference or tokens
            assert tokens == reference, (target, with_filter_row)


# ------------------------------------------------------------------ distributions


def chi_square(counts: torch.Tensor, expected_probs: torch.Tensor) -> float:
    n = counts.sum().item()
    expected = expected_probs.double() * n
    mask = expected > 0
    assert counts[~mask].sum() == 0, "a zero-probability token was drawn"
    return (((counts.double() - expected) ** 2)[mask] / expected[mask]).sum().item()


# df = 5 (6 tokens): P(chi2 > 25) ~ 1.4e-4, so only a wrong distribution fails.
CHI2_LIMIT_DF5 = 25.0


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_temperature_matches_softmax(temperature: float) -> None:
    logits = torch.tensor([[1.0, 0.5, 0.0, -0.5, -1.0, 0.2]])
    n = 20_000
    tokens = draws(logits, SamplingParams(temperature=temperature), n=n)
    counts = torch.bincount(torch.tensor(tokens), minlength=6)
    expected = torch.softmax(logits[0] / temperature, dim=0)
    assert chi_square(counts, expected) < CHI2_LIMIT_DF5


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0, top_k=3),
        SamplingParams(temperature=1.0, top_p=0.65),
        SamplingParams(temperature=1.0, min_p=0.4),
        SamplingParams(temperature=1.0, top_k=4, top_p=0.8, min_p=0.3),
    ],
    ids=["top_k", "top_p", "min_p", "combined"],
)
def test_filtered_distribution_is_renormalized(params: SamplingParams) -> None:
    """Each filter keeps {0, 1, 5} of these logits (probs .36 .22 .13 .08 .05 .16,
    every boundary well clear of rounding), and the survivors keep their relative
    odds: a filter that is too strict or too loose fails here."""
    logits = torch.tensor([[1.0, 0.5, 0.0, -0.5, -1.0, 0.2]])
    assert allowed_tokens(logits[0], params, slack=0.0) == {0, 1, 5}
    tokens = draws(logits, params, n=20_000)
    counts = torch.bincount(torch.tensor(tokens), minlength=6)
    expected = torch.softmax(logits[0], dim=0)
    expected[[2, 3, 4]] = 0.0
    expected /= expected.sum()
    # df = 2: P(chi2 > 18) ~ 1.2e-4.
    assert chi_square(counts, expected) < 18.0


def test_top_p_one_keeps_tail_despite_rounding() -> None:
    """White-box: the top token's fp32 probability rounds to exactly 1.0 here, so
    the cumulative mass before every other token is >= 1.0; top_p == 1 must still
    keep them (no sampling test can see a 1e-9 token go missing)."""
    logits = torch.tensor([[0.0, -25.0, -25.0, -30.0], [0.0, 1.0, 2.0, 3.0]])
    params = [SamplingParams(top_p=1.0), SamplingParams(top_p=0.5)]
    table = torch.tensor([[1.0, 4, p.top_p, -math.inf] for p in params])
    assert torch.softmax(logits[0], dim=0)[0].item() == 1.0
    threshold = cutoff(logits, table, max_k=0, need_top_p=True, full_sort=True, need_min_p=False)
    assert threshold[0].item() == -30.0  # keeps everything
    assert threshold[1].item() == 3.0  # the other row's nucleus is its top token


@pytest.mark.parametrize("top_k", [-1, 5])
def test_top_p_below_float32_keeps_the_top_token(top_k: int) -> None:
    """top_p = 1e-46 is a valid request (> 0) but 0 in the float32 parameter
    table: the nucleus is then the top token, not empty (an empty one once
    failed the whole engine step, every request in it)."""
    row = randn(1, 80, seed=13)
    params = SamplingParams(temperature=1.0, top_p=1e-46, top_k=top_k)
    assert float(torch.tensor(params.top_p, dtype=torch.float32)) == 0.0
    assert set(draws(row, params)) == {int(row.argmax())}


def test_seeded_rows_sample_the_right_distribution() -> None:
    """Per-request generators give draws from the same distribution (not just
    reproducible ones): one seeded request, many steps, same logits."""
    logits = torch.tensor([[1.0, 0.5, 0.0, -0.5, -1.0, 0.2]])
    sampler = Sampler("cpu")
    gen = sampler.new_generator(123)
    tokens = [sampler(logits, [SamplingParams(seed=123)], [gen]).token_ids[0] for _ in range(4000)]
    counts = torch.bincount(torch.tensor(tokens), minlength=6)
    assert chi_square(counts, torch.softmax(logits[0], dim=0)) < CHI2_LIMIT_DF5
