"""Manifold-constrained hyper-connections (mHC), DeepSeek-V4's residual.

The residual is `hc_mult` streams [T, hc, hidden]. Before each block,
weights computed from the RMS-normalised flattened streams collapse them into
the block's input (`pre`), expand the block's output back over the streams
(`post`) and mix the streams (`comb`, projected onto doubly stochastic
matrices by Sinkhorn-Knopp iterations); `HyperHead` collapses them once more
before the final norm. As Hugging Face's DeepseekV4HyperConnection /
DeepseekV4HyperHead; parameters (fp32, as HF keeps them) carry HF's names.

The modules own the parameters and the fp32 projection of the flattened
streams (one matmul); everything after it -- the norm's factor, the weights,
Sinkhorn, the collapse, and the expansion after the block -- is the op set's
mhc ops (kernels/mhc), so that it is one launch instead of ~150 small ones.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from tinyengine.models.deepseek_v4_attention import fp32_param

if TYPE_CHECKING:
    from tinyengine.kernels import OpSet
    from tinyengine.models.deepseek_v4 import DeepseekV4Args


class HyperConnection(nn.Module):
    """pre / post / comb weights of one block from the streams [T, hc, D]."""

    def __init__(self, args: DeepseekV4Args) -> None:
        super().__init__()
        hc = self.hc = args.hc_mult
        self.iters, self.hc_eps, self.norm_eps = args.hc_iters, args.hc_eps, args.rms_norm_eps
        self.fn = fp32_param((2 + hc) * hc, hc * args.hidden_size)
        self.base = fp32_param((2 + hc) * hc)
        self.scale = fp32_param(3)

    def forward(
        self, streams: torch.Tensor, ops: OpSet
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """-> post [T, hc], comb [T, hc, hc] (fp32), the collapsed input [T, D].
        The projection skips HF's weightless RMS norm: the op applies its
        per-token factor to the projection instead (kernels/mhc/reference.py)."""
        mixes = ops.per_token(lambda s: s.flatten(1).float() @ self.fn.t(), streams)
        return ops.mhc_pre(
            streams, mixes, self.base, self.scale,
            iters=self.iters, hc_eps=self.hc_eps, norm_eps=self.norm_eps,
        )  # fmt: skip


class HyperHead(nn.Module):
    """The final collapse of the streams, before the model's norm."""

    def __init__(self, args: DeepseekV4Args) -> None:
        super().__init__()
        hc = args.hc_mult
        self.hc_eps, self.norm_eps = args.hc_eps, args.rms_norm_eps
        self.hc_fn = fp32_param(hc, hc * args.hidden_size)
        self.hc_base = fp32_param(hc)
        self.hc_scale = fp32_param(1)

    def forward(self, streams: torch.Tensor, ops: OpSet) -> torch.Tensor:
        mixes = ops.per_token(lambda s: s.flatten(1).float() @ self.hc_fn.t(), streams)
        return ops.mhc_head(
            streams, mixes, self.hc_base, self.hc_scale, hc_eps=self.hc_eps, norm_eps=self.norm_eps
        )
