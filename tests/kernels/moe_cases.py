"""Shared by the Triton fused-MoE tests (test_triton_moe*.py): random problems
(tokens, expert weights, routing), the error measure and tolerances, and the
tile overrides that force the TMA modes or a routing with given expert loads."""

from __future__ import annotations

import torch

import tinyengine.kernels.moe.triton as triton_moe

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# Relative Frobenius. bf16: the interpreter truncates fp32->bf16 casts (the
# reference rounds to nearest), which roughly triples the rounding error.
TOL = {torch.float32: 1e-4 if DEVICE == "cuda" else 1e-5, torch.bfloat16: 4e-2}
CLASSES = range(len(triton_moe.CLASS_CONFIGS))


def make(num_tokens: int, hidden: int, inter: int, experts: int, top_k: int,
         dtype: torch.dtype, seed: int = 0, ids: torch.Tensor | None = None) -> tuple:  # fmt: skip
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, hidden, generator=g).to(dtype)
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=g) * hidden**-0.5).to(dtype)
    w2 = (torch.randn(experts, hidden, inter, generator=g) * inter**-0.5).to(dtype)
    if ids is None:
        # Distinct experts per token, as a router's top-k gives.
        ids = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(num_tokens)])
    weights = torch.rand(num_tokens, top_k, generator=g)
    return tuple(t.to(DEVICE) for t in (x, w13, w2, weights, ids.long()))


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double().cpu(), ref.double().cpu()
    assert not out.isnan().any()
    return ((out - ref).norm() / ref.norm().clamp_min(1e-12)).item()


def tma_config(mode: int) -> dict:
    return {g: dict(c, tma=mode) for g, c in triton_moe.CLASS_CONFIGS[-1].items()}


def ids_with_counts(counts: list[int]) -> torch.Tensor:
    """K=1 routing, tokens shuffled, expert e receiving counts[e] tokens."""
    ids = torch.cat([torch.full((c,), e) for e, c in enumerate(counts)])
    return ids[torch.randperm(len(ids), generator=torch.Generator().manual_seed(5))][:, None]
