"""Shared by the Sampler tests (test_sampler.py, test_sampler_filters.py, and
tests/kernels/test_sampling_sampler.py): running a batch through a CPU
Sampler, seeded random logits, many draws from one distribution, a float64
reference of the filter chain, the check of returned logprobs against the raw
log-softmax, and a CUDA step that must launch without a host sync."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch

from tinyengine.sampling_params import SamplingParams
from tinyengine.worker.sample_output import SamplerOutput
from tinyengine.worker.sampler import Sampler


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


def sample_without_host_sync(
    sampler: Any, logits: torch.Tensor, kinds: list[SamplingParams]
) -> tuple[list[SamplingParams], Any]:
    """A CUDA step under torch's sync debug mode (the engine launches the next
    step while one samples, so `sample` must never wait for the device):
    `sampler.sample` over logits' rows (params cycling through `kinds`,
    every third row banning ids 0-2) after one warm-up call; asserts that no
    device->host sync was reported and returns (params, the pending result)."""
    rows = logits.shape[0]
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
    return params, pending
