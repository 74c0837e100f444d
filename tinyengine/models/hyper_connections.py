"""Manifold-constrained hyper-connections (mHC), DeepSeek-V4's residual.

The residual is `hc_mult` streams [T, hc, hidden]. Before each block,
weights computed from the RMS-normalised flattened streams collapse them into
the block's input (`pre`), expand the block's output back over the streams
(`post`) and mix the streams (`comb`, projected onto doubly stochastic
matrices by Sinkhorn-Knopp iterations); `HyperHead` collapses them once more
before the final norm. As Hugging Face's DeepseekV4HyperConnection /
DeepseekV4HyperHead; parameters (fp32, as HF keeps them) carry HF's names.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from tinyengine.models.deepseek_v4_attention import fp32_param, unweighted_rms_norm

if TYPE_CHECKING:
    from tinyengine.models.deepseek_v4 import DeepseekV4Args


def _sinkhorn(comb: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return comb


class HyperConnection(nn.Module):
    """pre / post / comb weights of one block from the streams [T, hc, D]."""

    def __init__(self, args: DeepseekV4Args) -> None:
        super().__init__()
        hc = self.hc = args.hc_mult
        self.iters, self.hc_eps, self.norm_eps = args.hc_iters, args.hc_eps, args.rms_norm_eps
        self.fn = fp32_param((2 + hc) * hc, hc * args.hidden_size)
        self.base = fp32_param((2 + hc) * hc)
        self.scale = fp32_param(3)

    def forward(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """-> post [T, hc], comb [T, hc, hc] (fp32), the collapsed input [T, D]."""
        hc = self.hc
        flat = unweighted_rms_norm(streams.flatten(1).float(), self.norm_eps)
        pre_w, post_w, comb_w = (flat @ self.fn.t()).split([hc, hc, hc * hc], dim=-1)
        pre_b, post_b, comb_b = self.base.split([hc, hc, hc * hc])
        pre_s, post_s, comb_s = self.scale.unbind(0)
        pre = torch.sigmoid(pre_w * pre_s + pre_b) + self.hc_eps
        post = 2 * torch.sigmoid(post_w * post_s + post_b)
        comb = torch.softmax(comb_w.view(-1, hc, hc) * comb_s + comb_b.view(hc, hc), dim=-1)
        comb = _sinkhorn(comb + self.hc_eps, self.iters, self.hc_eps)
        collapsed = (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)
        return post, comb, collapsed


def expand_streams(
    streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor, out: torch.Tensor
) -> torch.Tensor:
    """The block's output spread over the streams, plus the mixed streams."""
    dtype = streams.dtype
    return (
        post.to(dtype).unsqueeze(-1) * out.unsqueeze(1) + comb.to(dtype).transpose(1, 2) @ streams
    )


class HyperHead(nn.Module):
    """The final collapse of the streams, before the model's norm."""

    def __init__(self, args: DeepseekV4Args) -> None:
        super().__init__()
        hc = args.hc_mult
        self.hc_eps, self.norm_eps = args.hc_eps, args.rms_norm_eps
        self.hc_fn = fp32_param(hc, hc * args.hidden_size)
        self.hc_base = fp32_param(hc)
        self.hc_scale = fp32_param(1)

    def forward(self, streams: torch.Tensor) -> torch.Tensor:
        flat = unweighted_rms_norm(streams.flatten(1).float(), self.norm_eps)
        pre = torch.sigmoid((flat @ self.hc_fn.t()) * self.hc_scale + self.hc_base) + self.hc_eps
        return (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)
