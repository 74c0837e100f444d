"""Sampler: greedy, banning, seeded reproducibility, logprobs, and random
batches against every rule. Filters and the distributions drawn from are in
test_sampler_filters.py, SamplingParams validation (the sampler's user-facing
inputs) in test_sampling_params.py; shared helpers in sampler_helpers.py.

Random draws use fixed seeds, so every statistical check is deterministic: a
tolerance here is about the maths being right, not about flakiness.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.worker.sampler_helpers import (
    allowed_tokens,
    check_logprobs,
    randn,
    sample,
    sample_without_host_sync,
)
from tinyengine.sampling_params import MAX_LOGPROBS, SamplingParams
from tinyengine.worker.sampler import Sampler

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
    params, pending = sample_without_host_sync(sampler, logits, kinds)
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


# ------------------------------------------------------------------ logprobs


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
