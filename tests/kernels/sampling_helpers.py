"""Shared by the fused-sampling tests (test_sampling.py, test_sampling_sampler.py):
the device, seeded random logits and seeds, and the GPU's near-tie check of the
kernel against the torch reference."""

from __future__ import annotations

import math

import torch

from tinyengine.kernels.sampling.reference import gumbel_argmax_torch, gumbel_noise_torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def randn(*shape: int, seed: int = 0, scale: float = 2.0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


def seeds_like(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(2**62, (rows,), generator=torch.Generator().manual_seed(seed))


def near_reference(logits, inv_t, seeds, tokens) -> torch.Tensor:
    """Per row: the kernel's token is the reference's, or scores within 1e-3 of
    it on the reference's own scores (a near-tie: on the GPU, FMA contraction
    and log2 move the last bits). Greedy rows must match exactly."""
    ref = gumbel_argmax_torch(logits, inv_t, seeds)
    x = logits.float()
    noise = gumbel_noise_torch(seeds, x.shape[1])
    scores = x * (inv_t.float() * math.log2(math.e))[:, None] + noise
    scores = torch.where(inv_t[:, None] > 0, scores, x)
    at_token = scores.gather(1, tokens[:, None])[:, 0]
    best = scores.gather(1, ref[:, None])[:, 0]
    assert ((tokens == ref) | (at_token >= best - 1e-3)).all()
    assert torch.equal(tokens[inv_t == 0], ref[inv_t == 0])
    return tokens == ref
