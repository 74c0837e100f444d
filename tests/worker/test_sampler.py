"""Sampler: greedy, banning, filters, seeded reproducibility, distributions,
logprobs; plus SamplingParams validation (the sampler's user-facing inputs).

Random draws use fixed seeds, so every statistical check is deterministic: a
tolerance here is about the maths being right, not about flakiness.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tinyengine.sampling_params import MAX_LOGPROBS, SamplingParams
from tinyengine.worker.sample_output import SamplerOutput
from tinyengine.worker.sampler import Sampler
from tinyengine.worker.sampling_filters import cutoff


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams] | SamplingParams,
    generators: list[torch.Generator | None] | None = None,
    banned: list[list[int]] | None = None,
    sampler: Sampler | None = None,
) -> SamplerOutput:
    rows = logits.shape[0]
    if isinstance(params, SamplingParams):
        params = [params] * rows
    sampler = sampler or Sampler("cpu", seed=0)
    return sampler(logits, params, generators or [None] * rows, banned)


def randn(*shape: int, seed: int = 0, scale: float = 2.0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


def draws(logits_row: torch.Tensor, params: SamplingParams, n: int = 4000) -> list[int]:
    """n independent draws from one distribution: the row replicated n times."""
    return sample(logits_row.expand(n, -1).contiguous(), params).token_ids


def allowed_tokens(logits_row: torch.Tensor, p: SamplingParams, slack: float = 1e-4) -> set[int]:
    """Reference filter chain in float64: top-k, then top-p on the renormalized
    top-k, then min-p against the max. `slack` widens top-p/min-p boundaries so
    fp32-vs-fp64 rounding at a boundary cannot fail a correct sampler."""
    scaled = logits_row.double() / (p.temperature or 1.0)
    order = torch.argsort(scaled, descending=True).tolist()
    if p.top_k > 0:
        # Ties with the k-th value are kept (the sampler does the same).
        kth = scaled[order[min(p.top_k, len(order)) - 1]]
        order = [t for t in order if scaled[t] >= kth]
    probs = torch.softmax(scaled[order], dim=0).tolist()
    kept, mass = [], 0.0
    for t, pr in zip(order, probs, strict=True):
        if mass >= p.top_p + slack:
            break
        kept.append(t)
        mass += pr
    full = torch.softmax(scaled, dim=0)
    pmax = full.max().item()
    return {t for t in kept if full[t].item() >= p.min_p * pmax * (1 - slack) - 1e-12}


# ------------------------------------------------------------------ greedy / banning


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 8), vocab=st.integers(2, 64), seed=st.integers(0, 10_000))
def test_greedy_is_argmax(rows: int, vocab: int, seed: int) -> None:
    logits = randn(rows, vocab, seed=seed)
    out = sample(logits, SamplingParams(temperature=0.0))
    assert out.token_ids == logits.argmax(dim=-1).tolist()
    assert out.logprobs == [None] * rows


def test_banned_tokens_never_chosen_greedy() -> None:
    logits = randn(3, 20)
    top2 = logits.topk(2, dim=-1).indices
    banned = [[int(top2[0, 0])], [], [int(top2[2, 0]), int(top2[2, 1])]]
    out = sample(logits, SamplingParams(temperature=0.0), banned=banned)
    assert out.token_ids[0] == int(top2[0, 1])
    assert out.token_ids[1] == int(top2[1, 0])
    assert out.token_ids[2] == int(logits[2].topk(3).indices[2])


def test_banned_tokens_never_chosen_sampled() -> None:
    n, vocab = 3000, 12
    logits = randn(1, vocab).expand(n, -1).contiguous()
    logits[:, :3] += 10.0  # the banned tokens would otherwise win nearly always
    banned = [[0, 1, 2]] * n
    for params in (
        SamplingParams(temperature=1.5),
        SamplingParams(temperature=1.0, top_k=2),
        SamplingParams(temperature=1.0, top_p=0.5, min_p=0.05),
    ):
        chosen = set(sample(logits, params, banned=banned).token_ids)
        assert chosen.isdisjoint({0, 1, 2}), params


def test_all_but_one_banned_forces_that_token() -> None:
    logits = randn(500, 10)
    banned = [[t for t in range(10) if t != 7]] * 500
    out = sample(logits, SamplingParams(temperature=2.0, top_p=0.3), banned=banned)
    assert set(out.token_ids) == {7}


def test_input_logits_not_modified() -> None:
    logits = randn(4, 30)
    before = logits.clone()
    params = [
        SamplingParams(temperature=0.5, top_k=3, logprobs=2),
        SamplingParams(temperature=0.0),
        SamplingParams(top_p=0.5, min_p=0.1),
        SamplingParams(temperature=2.0),
    ]
    sample(logits, params, banned=[[0, 1], [2], [], [5]])
    assert torch.equal(logits, before)


def test_empty_batch() -> None:
    out = sample(torch.empty(0, 10), [])
    assert out.token_ids == [] and out.logprobs == []


def test_mismatched_lengths_raise() -> None:
    sampler = Sampler("cpu")
    with pytest.raises(ValueError, match="params"):
        sampler(randn(2, 5), [SamplingParams()], [None, None])
    with pytest.raises(ValueError, match="banned_token_ids"):
        sampler(randn(2, 5), [SamplingParams()] * 2, [None, None], [[1]])


# ------------------------------------------------------------------ seeded reproducibility


def seeded_run(
    target: SamplingParams,
    seed: int,
    position: str,
    steps: int = 25,
    sampler_seed: int = 0,
    device: str = "cpu",
) -> list[int]:
    """Tokens of one seeded request over `steps` steps, placed alone / first /
    last / in the middle of batches whose other rows change every step."""
    vocab = 97
    draw = None  # the torch path on CPU; the engine's fused Triton draw on CUDA
    if device == "cuda":
        from tinyengine.kernels.sampling.triton import gumbel_argmax_triton as draw
    sampler = Sampler(device, seed=sampler_seed, draw=draw)
    gen = sampler.new_generator(seed)
    others_rng = torch.Generator().manual_seed(1234 + len(position))
    tokens = []
    for step in range(steps):
        row = randn(1, vocab, seed=10_000 + step)  # the request's own logits
        if position == "alone":
            logits, params, gens, at = row, [target], [gen], 0
        else:
            k = 1 + step % 4
            other_logits = torch.randn(k, vocab, generator=others_rng) * 3
            other_params = [
                SamplingParams(temperature=0.8, top_k=5),
                SamplingParams(temperature=0.0),
                SamplingParams(temperature=1.3, top_p=0.7, min_p=0.05, seed=7),
                SamplingParams(temperature=1.0),
            ][:k]
            other_gens = [None, None, sampler.new_generator(7 + step), None][:k]
            at = {"first": 0, "last": k, "middle": k // 2}[position]
            logits = torch.cat([other_logits[:at], row, other_logits[at:]])
            params = other_params[:at] + [target] + other_params[at:]
            gens = other_gens[:at] + [gen] + other_gens[at:]
        tokens.append(sampler(logits.to(device), params, gens).token_ids[at])
    return tokens


@pytest.mark.parametrize(
    "target",
    [
        SamplingParams(temperature=1.0, seed=42),
        SamplingParams(temperature=0.7, top_k=20, top_p=0.9, seed=42),
        SamplingParams(temperature=1.2, min_p=0.02, seed=42),
    ],
    ids=["plain", "topk-topp", "minp"],
)
def test_seeded_tokens_independent_of_batch(target: SamplingParams) -> None:
    alone = seeded_run(target, seed=42, position="alone")
    assert len(set(alone)) > 3, "sanity: the request really samples"
    for position in ("first", "last", "middle"):
        assert seeded_run(target, seed=42, position=position) == alone, position
    # The sampler's own seed only drives unseeded rows.
    assert seeded_run(target, seed=42, position="middle", sampler_seed=99) == alone
    assert seeded_run(target, seed=43, position="alone") != alone


@pytest.mark.gpu
def test_seeded_tokens_independent_of_batch_cuda() -> None:
    target = SamplingParams(temperature=0.9, top_k=30, top_p=0.95, seed=42)
    alone = seeded_run(target, seed=42, position="alone", device="cuda")
    assert len(set(alone)) > 3
    for position in ("first", "last", "middle"):
        assert seeded_run(target, seed=42, position=position, device="cuda") == alone


@pytest.mark.gpu
def test_cuda_no_host_sync_before_final_copy() -> None:
    """`sample` launches everything without one device->host sync (so the
    engine can launch the next step meanwhile); `result()` then waits on the
    copy's event, which torch's sync debug mode does not report (it is not an
    implicit sync), and the results are right."""
    vocab, rows = 32_000, 48
    from tinyengine.kernels.sampling.triton import gumbel_argmax_triton

    sampler = Sampler("cuda", draw=gumbel_argmax_triton)  # the engine's CUDA sampler
    logits = torch.randn(rows, vocab, device="cuda") * 3
    kinds = [
        SamplingParams(temperature=0.0, logprobs=2),
        SamplingParams(temperature=0.8, top_k=50),
        SamplingParams(temperature=1.0, top_p=0.9, min_p=0.05, seed=1, logprobs=5),
        SamplingParams(temperature=1.2),
    ]
    params = [kinds[i % len(kinds)] for i in range(rows)]
    gens = [sampler.new_generator(i) if p.seed is not None else None for i, p in enumerate(params)]
    banned = [[0, 1, 2] if i % 3 == 0 else [] for i in range(rows)]
    sampler(logits, params, gens, banned)  # warm up allocators and kernels
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            pending = sampler.sample(logits, params, gens, banned)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    syncs = [str(w.message) for w in caught if "synchroniz" in str(w.message)]
    assert syncs == [], syncs
    assert pending.token_ids.is_cuda and pending.token_ids.shape == (rows,)
    out = pending.result()
    assert out.token_ids == pending.token_ids.tolist()
    check_logprobs(logits.cpu(), params, out)
    assert all(out.token_ids[i] not in (0, 1, 2) for i in range(0, rows, 3))


def test_unseeded_rows_follow_sampler_seed() -> None:
    logits = randn(64, 50)
    a = sample(logits, SamplingParams(), sampler=Sampler("cpu", seed=3)).token_ids
    b = sample(logits, SamplingParams(), sampler=Sampler("cpu", seed=3)).token_ids
    c = sample(logits, SamplingParams(), sampler=Sampler("cpu", seed=4)).token_ids
    assert a == b and a != c


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


def test_seeded_rows_sample_the_right_distribution() -> None:
    """Per-request generators give draws from the same distribution (not just
    reproducible ones): one seeded request, many steps, same logits."""
    logits = torch.tensor([[1.0, 0.5, 0.0, -0.5, -1.0, 0.2]])
    sampler = Sampler("cpu")
    gen = sampler.new_generator(123)
    tokens = [sampler(logits, [SamplingParams(seed=123)], [gen]).token_ids[0] for _ in range(4000)]
    counts = torch.bincount(torch.tensor(tokens), minlength=6)
    assert chi_square(counts, torch.softmax(logits[0], dim=0)) < CHI2_LIMIT_DF5


# ------------------------------------------------------------------ logprobs


def check_logprobs(logits: torch.Tensor, params: list[SamplingParams], out: SamplerOutput) -> None:
    ref = torch.log_softmax(logits.double(), dim=-1)  # the raw distribution
    for i, p in enumerate(params):
        entries = out.logprobs[i]
        if p.logprobs is None:
            assert entries is None
            continue
        assert entries is not None and len(entries) == 1 + p.logprobs
        assert entries[0][0] == out.token_ids[i], "sampled token first"
        for tok, lp, rank in entries:
            assert lp == pytest.approx(ref[i, tok].item(), abs=1e-5)
            assert rank == 1 + int((ref[i] > ref[i, tok] + 1e-6).sum())
        top = entries[1:]
        assert [lp for _, lp, _ in top] == sorted((lp for _, lp, _ in top), reverse=True)
        expected_top = ref[i].topk(p.logprobs).values.tolist() if p.logprobs else []
        assert [lp for _, lp, _ in top] == pytest.approx(expected_top, abs=1e-5)


def test_logprobs_are_raw_log_softmax_with_ranks() -> None:
    logits = randn(6, 40, seed=21, scale=3.0)
    params = [
        SamplingParams(temperature=0.0, logprobs=3),
        SamplingParams(temperature=0.5, top_k=4, logprobs=5),
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=2.0, top_p=0.5, logprobs=0),
        SamplingParams(temperature=1.0, min_p=0.3, logprobs=MAX_LOGPROBS),
        SamplingParams(temperature=0.7, logprobs=1),
    ]
    banned = [[int(logits[0].argmax())], [], [], [1, 2, 3], [], []]
    out = sample(logits, params, banned=banned)
    check_logprobs(logits, params, out)
    # Banned and filtered tokens still report the raw model distribution.
    assert out.logprobs[0][0][2] == 2  # greedy took the runner-up after banning
    assert out.logprobs[0][1][0] == int(logits[0].argmax())


def test_logprob_ranks_with_ties() -> None:
    logits = torch.tensor([[1.0, 1.0, 0.5, 0.5, 0.0, -1.0]])
    out = sample(logits, [SamplingParams(temperature=0.0, logprobs=5)])
    assert out.token_ids == [0]
    assert [rank for _, _, rank in out.logprobs[0]] == [1, 1, 1, 3, 3, 5]


def test_logprobs_only_rows_that_ask() -> None:
    logits = randn(3, 10)
    params = [SamplingParams(), SamplingParams(logprobs=2), SamplingParams()]
    out = sample(logits, params)
    assert out.logprobs[0] is None and out.logprobs[2] is None
    assert len(out.logprobs[1]) == 3


# ------------------------------------------------------------------ property test


@st.composite
def batch(draw: st.DrawFn) -> tuple[torch.Tensor, list[SamplingParams], list[list[int]], int]:
    rows = draw(st.integers(1, 6))
    vocab = draw(st.integers(2, 40))
    logits = randn(
        rows, vocab, seed=draw(st.integers(0, 10_000)), scale=draw(st.sampled_from([0.1, 1.0, 5.0]))
    )
    params, banned = [], []
    for _ in range(rows):
        params.append(
            SamplingParams(
                temperature=draw(st.sampled_from([0.0, 0.3, 1.0, 2.5])),
                top_k=draw(st.sampled_from([-1, 0, 1, 2, 5, vocab, vocab + 3])),
                top_p=draw(st.sampled_from([1.0, 0.9, 0.5, 0.1])),
                min_p=draw(st.sampled_from([0.0, 0.05, 0.3])),
                seed=draw(st.one_of(st.none(), st.integers(0, 100))),
                logprobs=draw(st.one_of(st.none(), st.integers(0, min(vocab, MAX_LOGPROBS)))),
            )
        )
        banned.append(draw(st.lists(st.integers(0, vocab - 1), max_size=vocab - 1, unique=True)))
    return logits, params, banned, draw(st.integers(0, 1000))


@settings(max_examples=80, deadline=None)
@given(batch())
def test_random_batches_respect_every_rule(
    case: tuple[torch.Tensor, list[SamplingParams], list[list[int]], int],
) -> None:
    logits, params, banned, seed = case
    sampler = Sampler("cpu", seed=seed)
    gens = [sampler.new_generator(p.seed) if p.seed is not None else None for p in params]
    out = sampler(logits, params, gens, banned)
    assert len(out.token_ids) == len(params)
    check_logprobs(logits, params, out)
    for i, (tok, p) in enumerate(zip(out.token_ids, params, strict=True)):
        assert tok not in banned[i]
        masked = logits[i].clone()
        masked[banned[i]] = float("-inf")
        if p.temperature == 0.0:
            assert tok == int(masked.argmax())
        else:
            assert tok in allowed_tokens(masked, p)


# ------------------------------------------------------------------ SamplingParams validation


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"top_k": 2.5}, "top_k"),
        ({"min_p": -0.1}, "min_p"),
        ({"min_p": 2.0}, "min_p"),
        ({"seed": "abc"}, "seed"),
        ({"seed": 2**63}, "seed"),  # torch's generator would overflow mid-step
        ({"seed": -(2**63) - 1}, "seed"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
        ({"logprobs": -1}, "logprobs"),
        ({"logprobs": MAX_LOGPROBS + 1}, "logprobs"),
        ({"stop": ""}, "stop"),
        ({"stop": ["ok", ""]}, "stop"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ],
)
def test_sampling_params_rejects_bad_values(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=rf"SamplingParams\.{field}\b"):
        SamplingParams(**kwargs)


def test_sampling_params_accepts_edges() -> None:
    SamplingParams(temperature=0.0, top_p=1.0, top_k=-1, min_p=0.0)
    SamplingParams(top_k=0, min_p=1.0, logprobs=0, max_tokens=None, min_tokens=100)
    SamplingParams(logprobs=MAX_LOGPROBS, stop="x", min_tokens=3, max_tokens=3)
    last = SamplingParams(seed=2**63 - 1, n=3).fan_out()  # seed + i wraps within int64
    assert [p.seed for p in last] == [2**63 - 1, -(2**63), -(2**63) + 1]
    SamplingParams(seed=-(2**63))
    assert math.isclose(SamplingParams(temperature=0.5).temperature, 0.5)


def test_n_fans_out_into_one_sequence_requests():
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="SamplingParams.n"):
            SamplingParams(n=bad)
    one = SamplingParams(n=1, seed=5)
    assert one.fan_out() == [one]
    kids = SamplingParams(n=3, seed=5, temperature=0.7, max_tokens=4).fan_out()
    assert [(k.n, k.seed, k.temperature, k.max_tokens) for k in kids] == [
        (1, 5, 0.7, 4), (1, 6, 0.7, 4), (1, 7, 0.7, 4)
    ]  # fmt: skip
    assert [k.seed for k in SamplingParams(n=2).fan_out()] == [None, None]
