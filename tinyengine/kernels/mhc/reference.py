"""The torch references of the mHC ops, Hugging Face's DeepseekV4HyperConnection
and DeepseekV4HyperHead math after their projection, formula for formula.

Owns the numbers the Triton kernels (triton.py) must reproduce. The caller
hands in the raw projection `mixes = streams.flatten(1).float() @ fn.t()`
WITHOUT HF's RMS normalisation of the flattened streams: the norm has no
weight, so rms_norm(x) @ W^T = rsqrt(mean(x^2) + eps) * (x @ W^T), and the
ops apply that per-token factor themselves (the kernels read the streams
for the collapse anyway, so the norm costs no extra launch). Weights, norm
and collapse are fp32 as in HF; only the collapsed input and the expanded
streams come back in the streams' dtype.

Shapes: streams [T, hc, D]; mixes [T, (2+hc)*hc] fp32 ordered pre | post |
comb (comb row-major [hc, hc]); base the same width, fp32; scale [3] fp32
(pre, post, comb). The head's mixes, base are [T, hc], [hc] and scale [1].
"""

from __future__ import annotations

import torch


def sinkhorn(comb: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """Sinkhorn-Knopp towards a doubly stochastic matrix, as HF writes it: a
    column normalisation first, then `iters - 1` rounds of rows then columns."""
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return comb


def _rstd(streams: torch.Tensor, norm_eps: float) -> torch.Tensor:
    """[T, 1]: the unweighted RMS norm's factor of each token's flattened streams."""
    flat = streams.flatten(1).float()
    return torch.rsqrt(flat.square().mean(-1, keepdim=True) + norm_eps)


def _collapse(streams: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """sum_j pre_j * streams[:, j] in fp32, in the streams' dtype."""
    return (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)


def mhc_pre(
    streams: torch.Tensor,
    mixes: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    *,
    iters: int,
    hc_eps: float,
    norm_eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> post [T, hc] fp32, comb [T, hc, hc] fp32 (doubly stochastic), and
    the block's input collapsed from the streams [T, D] (streams' dtype)."""
    hc = streams.shape[1]
    mixes = mixes * _rstd(streams, norm_eps)
    pre_w, post_w, comb_w = mixes.split([hc, hc, hc * hc], dim=-1)
    pre_b, post_b, comb_b = base.split([hc, hc, hc * hc])
    pre_s, post_s, comb_s = scale.unbind(0)
    pre = torch.sigmoid(pre_w * pre_s + pre_b) + hc_eps
    post = 2 * torch.sigmoid(post_w * post_s + post_b)
    comb = torch.softmax(comb_w.view(-1, hc, hc) * comb_s + comb_b.view(hc, hc), dim=-1)
    comb = sinkhorn(comb + hc_eps, iters, hc_eps)
    return post, comb, _collapse(streams, pre)


def mhc_head(
    streams: torch.Tensor,
    mixes: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    *,
    hc_eps: float,
    norm_eps: float,
) -> torch.Tensor:
    """The final collapse [T, D] (streams' dtype): `pre` weights only, from
    the head's own mixes [T, hc], base [hc] and scale [1]."""
    pre = torch.sigmoid(mixes * _rstd(streams, norm_eps) * scale + base) + hc_eps
    return _collapse(streams, pre)


def mhc_post(
    streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor, out: torch.Tensor
) -> torch.Tensor:
    """The new streams [T, hc, D]: the block's output `out` [T, D] spread over
    the streams by `post`, plus the streams mixed by comb^T; HF casts the
    weights to the streams' dtype first and computes in it."""
    dtype = streams.dtype
    return (
        post.to(dtype).unsqueeze(-1) * out.unsqueeze(1) + comb.to(dtype).transpose(1, 2) @ streams
    )
