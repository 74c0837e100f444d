"""DeepSeek-V4's mixture of experts: the router (hash routing from a fixed
token-id table in the first layers, the top-k of sqrt(softplus(logits)) +
a correction bias after them), the routed experts and the shared expert,
both clamping SwiGLU's inputs at `swiglu_limit`.

Owns these modules' parameters and how they shard across tensor-parallel
ranks: the router and its tables whole on every rank (the routing must be
the same everywhere); each routed expert's intermediate features split as
models/moe.py's FusedExperts lays them out (its rows of gate and up, its
columns of down), and the shared expert's likewise (gate and up column-,
down row-parallel), so each rank's routed sum is partial and all-reduced.
The clamps act per intermediate feature, so they commute with the split.
With expert parallelism a rank holds whole routed experts instead
(FusedExperts' expert_parallel; the pairs routed to other ranks' experts
weigh 0 here, moe.py's local_routing), and the same all-reduce combines.

Must never read files or pick an implementation: fused_moe comes from the
forward context's op set.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from tinyengine.distributed.tp import tp_group
from tinyengine.kernels.opset import OpSet
from tinyengine.models.context import ForwardContext
from tinyengine.models.deepseek_v4_attention import fp32_param
from tinyengine.models.moe import FusedExperts, local_routing
from tinyengine.models.parallel_layers import ColumnParallelLinear, RowParallelLinear

if TYPE_CHECKING:
    from tinyengine.models.deepseek_v4 import DeepseekV4Args


class ClampedSwiGLU(nn.Module):
    """The shared expert: down(silu(min(gate, L)) * clamp(up, -L, L))."""

    def __init__(
        self, hidden: int, intermediate: int, limit: float, tp_rank: int = 0, tp_size: int = 1
    ) -> None:
        super().__init__()
        self.limit = limit
        tp = {"tp_rank": tp_rank, "tp_size": tp_size}
        self.gate_proj = ColumnParallelLinear(hidden, intermediate, False, **tp)
        self.up_proj = ColumnParallelLinear(hidden, intermediate, False, **tp)
        self.down_proj = RowParallelLinear(intermediate, hidden, False, **tp)

    def forward(self, x: torch.Tensor, ops: OpSet) -> torch.Tensor:
        gate = self.gate_proj(x, ops).clamp(max=self.limit)
        up = self.up_proj(x, ops).clamp(-self.limit, self.limit)
        return self.down_proj(ops.per_token(lambda g, u: F.silu(g) * u, gate, up), ops)


class V4Router(nn.Module):
    def __init__(self, args: DeepseekV4Args, hashed: bool) -> None:
        super().__init__()
        cfg = args.moe
        self.hashed, self.top_k, self.scale = hashed, cfg.top_k, cfg.routed_scaling_factor
        self.weight = nn.Parameter(
            torch.empty(cfg.num_experts, cfg.hidden_size), requires_grad=False
        )
        if hashed:  # token id -> its experts, fixed
            self.tid2eid = nn.Parameter(
                torch.zeros(args.vocab_size, cfg.top_k, dtype=torch.long), requires_grad=False
            )
            self.tid2eid.value_range = (0, cfg.num_experts)  # type: ignore[attr-defined]
        else:
            self.e_score_correction_bias = fp32_param(cfg.num_experts)

    def forward(
        self, x: torch.Tensor, input_ids: torch.Tensor, ops: OpSet
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return ops.per_token(self._route, x, input_ids)

    def _route(self, x: torch.Tensor, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = F.softplus(F.linear(x, self.weight)).sqrt()
        if self.hashed:
            ids = self.tid2eid[input_ids]
        else:
            biased = scores + self.e_score_correction_bias
            ids = torch.topk(biased, self.top_k, dim=-1, sorted=False).indices
        weights = scores.gather(1, ids).float()
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.scale, ids


class V4MoE(nn.Module):
    def __init__(
        self, args: DeepseekV4Args, hashed: bool, tp_rank: int = 0, tp_size: int = 1,
        expert_parallel: bool = False,
    ) -> None:  # fmt: skip
        super().__init__()
        cfg = args.moe
        self.limit, self.tp_size = args.swiglu_limit, tp_size
        self.gate = V4Router(args, hashed)
        self.experts = FusedExperts(cfg, tp_rank, tp_size, expert_parallel=expert_parallel)
        # One shared expert of moe_intermediate_size whatever n_shared_experts
        # says: transformers' V4 builds it so (its config maps
        # intermediate_size to moe_intermediate_size), and V4-Flash has one.
        self.shared_experts = ClampedSwiGLU(
            cfg.hidden_size, cfg.moe_intermediate_size, self.limit, tp_rank, tp_size
        )

    def forward(
        self, x: torch.Tensor, input_ids: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        weights, ids = self.gate(x, input_ids, ctx.ops)
        e = self.experts
        if e.routes_locally:
            weights, ids = local_routing(weights, ids, e.local)
        # Called here rather than through FusedExperts.forward: V4's experts
        # clamp SwiGLU's inputs (swiglu_limit), which that forward does not pass.
        routed = ctx.ops.fused_moe(
            x, e.w13_weight, e.w2_weight, weights, ids, workspace=ctx.workspace,
            swiglu_limit=self.limit,
        )  # fmt: skip
        if self.tp_size > 1:
            routed = tp_group().all_reduce(routed)
        return routed + self.shared_experts(x, ctx.ops)
