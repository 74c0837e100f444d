"""DeepSeek mixture-of-experts: the routers (V2 softmax, V3 sigmoid with a
correction bias and group-limited top-k), the stacked routed experts, shared
experts, and the SwiGLU MLP that dense layers use too.

Owns the expert parameter layout -- per layer w13 [E, 2I, D] (each expert's
gate rows then up rows) and w2 [E, D, I] -- and the weight loaders that stack
the checkpoint's per-expert tensors (`mlp.experts.E.{gate,up,down}_proj.weight`)
into it, addressed by shard ids (E, 0 | 1) and E. Routing lives here, not in
the kernel: ctx.ops.fused_moe only applies a routing.

Two ways to spread the routed experts over a tensor-parallel group of N
ranks: inside each expert (a rank holds I / N of every expert's features) or,
with expert_parallel, whole experts (a rank holds E / N of them; vLLM's
enable_expert_parallel, EP size = TP size). Shared experts are split inside,
either way.

Must never read files or pick an implementation: the ForwardContext's op set
brings fused_moe. Routing is made of device ops
only (top-k, scatter, masks), so it is safe inside CUDA graphs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tinyengine.distributed.tp import shard, tp_group
from tinyengine.kernels.moe.tiles import moe_token_classes
from tinyengine.kernels.opset import OpSet
from tinyengine.models.context import ForwardContext
from tinyengine.models.layers import SwiGLUMLP
from tinyengine.models.parallel_layers import (
    checkpoint_shape,
    default_weight_loader,
    mark_reads_part,
    read_part,
)

ROUTINGS = ("noaux_tc", "greedy", "group_limited_greedy")


# ----------------------------------------------------------------------------- routing


def _group_mask(
    group_scores: torch.Tensor, topk_group: int, experts_per_group: int
) -> torch.Tensor:
    """[T, G] group scores -> [T, E] bool: experts in the top `topk_group` groups."""
    chosen = torch.topk(group_scores, k=topk_group, dim=-1, sorted=False).indices
    mask = torch.zeros_like(group_scores).scatter_(1, chosen, 1.0)
    return mask.bool().repeat_interleave(experts_per_group, dim=1)


def route_v3(
    router_logits: torch.Tensor,
    correction_bias: torch.Tensor,
    *,
    top_k: int,
    n_group: int,
    topk_group: int,
    norm_topk_prob: bool,
    routed_scaling_factor: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3 ("noaux_tc"): fp32 logits [T, E] -> (weights [T, K] fp32, ids [T, K]).

    Scores are sigmoids. The *choice* uses scores + correction bias: groups
    ranked by the sum of their two best biased scores, only the best
    `topk_group` groups stay eligible, then the top_k biased scores among
    them. The *weights* are the un-biased scores of the chosen experts
    (renormalised if norm_topk_prob), times routed_scaling_factor.
    """
    num_tokens, num_experts = router_logits.shape
    scores = router_logits.sigmoid()
    biased = scores + correction_bias
    per_group = num_experts // n_group
    group_scores = biased.view(num_tokens, n_group, per_group).topk(2, dim=-1).values.sum(-1)
    eligible = _group_mask(group_scores, topk_group, per_group)
    biased = biased.masked_fill(~eligible, float("-inf"))
    ids = torch.topk(biased, k=top_k, dim=-1, sorted=False).indices
    weights = scores.gather(1, ids)
    if norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * routed_scaling_factor, ids


def route_v2(
    router_logits: torch.Tensor,
    *,
    top_k: int,
    topk_method: str,
    n_group: int | None,
    topk_group: int | None,
    routed_scaling_factor: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V2: softmax scores; "greedy" takes the global top_k,
    "group_limited_greedy" first keeps the `topk_group` groups with the best
    single score. Weights are the scores times routed_scaling_factor (HF's V2
    never renormalises, whatever norm_topk_prob says)."""
    scores = router_logits.softmax(dim=-1, dtype=torch.float32)
    if topk_method == "group_limited_greedy":
        num_tokens, num_experts = scores.shape
        per_group = num_experts // n_group
        group_scores = scores.view(num_tokens, n_group, per_group).max(dim=-1).values
        eligible = _group_mask(group_scores, topk_group, per_group)
        scores = scores.masked_fill(~eligible, 0.0)
    weights, ids = torch.topk(scores, k=top_k, dim=-1, sorted=False)
    return weights * routed_scaling_factor, ids


# ----------------------------------------------------------------------------- modules


@dataclass(frozen=True)
class MoEConfig:
    hidden_size: int
    moe_intermediate_size: int
    num_experts: int
    top_k: int
    n_shared_experts: int
    topk_method: str  # one of ROUTINGS; "noaux_tc" is V3's sigmoid routing
    n_group: int | None
    topk_group: int | None
    norm_topk_prob: bool
    routed_scaling_factor: float
    mlp_bias: bool  # dense and shared-expert MLPs only (routed experts never have bias)

    def validate(self) -> None:
        if self.topk_method not in ROUTINGS:
            raise ValueError(f"topk_method={self.topk_method!r} is not one of {list(ROUTINGS)}")
        grouped = self.topk_method != "greedy"
        if grouped and (not self.n_group or not self.topk_group):
            raise ValueError(f"topk_method={self.topk_method!r} needs n_group and topk_group")
        if grouped:
            if self.num_experts % self.n_group or not 1 <= self.topk_group <= self.n_group:
                raise ValueError(
                    f"n_routed_experts={self.num_experts} must split into n_group="
                    f"{self.n_group} equal groups with 1 <= topk_group={self.topk_group} <= n_group"
                )
            eligible = self.topk_group * (self.num_experts // self.n_group)
            if self.top_k > eligible:
                raise ValueError(
                    f"num_experts_per_tok={self.top_k} exceeds the {eligible} experts that "
                    f"topk_group={self.topk_group} groups hold"
                )
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"num_experts_per_tok={self.top_k} must be in [1, {self.num_experts}]")


class TopkRouter(nn.Module):
    """The gate: weight [E, D] (and V3's e_score_correction_bias [E]), both
    kept in fp32 whatever the model dtype -- HF keeps them fp32 too, and the
    routing decision is sensitive to rounding."""

    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.weight = _fp32_param(cfg.num_experts, cfg.hidden_size)
        if cfg.topk_method == "noaux_tc":
            self.e_score_correction_bias = _fp32_param(cfg.num_experts)

    def forward(self, x: torch.Tensor, ops: OpSet) -> tuple[torch.Tensor, torch.Tensor]:
        # In batch-invariant mode the whole routing runs on fixed-size row
        # blocks: a token's scores then come from calls of one shape (torch's
        # sigmoid/softmax take a scalar path for a tensor's tail elements,
        # whose rounding differs from the vector path's).
        return ops.per_token(self._route, x)

    def _route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        c = self.cfg
        logits = F.linear(x.float(), self.weight)
        if c.topk_method == "noaux_tc":
            return route_v3(
                logits, self.e_score_correction_bias, top_k=c.top_k, n_group=c.n_group,
                topk_group=c.topk_group, norm_topk_prob=c.norm_topk_prob,
                routed_scaling_factor=c.routed_scaling_factor,
            )  # fmt: skip
        return route_v2(
            logits, top_k=c.top_k, topk_method=c.topk_method, n_group=c.n_group,
            topk_group=c.topk_group, routed_scaling_factor=c.routed_scaling_factor,
        )  # fmt: skip


@dataclass(frozen=True)
class ExpertShard:
    """Where one expert's checkpoint tensor goes in a stacked parameter: into
    expert `expert`, rows [start, start + rows); of the checkpoint tensor
    (shape `full`) the part [src_start, src_start + length) along `dim` (the
    whole tensor at tp_size 1)."""

    expert: int
    start: int
    rows: int
    dim: int
    src_start: int
    length: int
    full: tuple[int, int]


def expert_range(num_experts: int, rank: int, size: int) -> range:
    """The global ids of the routed experts that expert-parallel rank `rank`
    of `size` holds: an equal, contiguous share."""
    if num_experts % size:
        raise ValueError(
            f"expert parallelism: n_routed_experts={num_experts} is not divisible by the "
            f"expert-parallel size {size} (= tensor_parallel_size); pick a "
            "tensor_parallel_size that divides it, or turn expert_parallel off"
        )
    per_rank = num_experts // size
    return range(rank * per_rank, (rank + 1) * per_rank)


def local_routing(
    weights: torch.Tensor, ids: torch.Tensor, local: range
) -> tuple[torch.Tensor, torch.Tensor]:
    """A routing over all experts -> the same routing over this rank's
    experts `local` (global ids -> local ids 0..len(local)-1).

    fused_moe has no "skip this pair" id (both op sets require every id in
    [0, E): the torch reference refuses others, the Triton kernel would leave
    the pair's output rows unwritten and still sum them), so a (token, expert)
    pair whose expert lives on another rank keeps its slot with weight 0 and
    local id 0: it reads only this rank's expert 0, and adds exactly 0.
    Shapes stay fixed and nothing is read on the host, so this is graph-safe.
    The cost: every rank still computes all T*K pairs, (N-1)/N of them
    wasted (at whole-expert width, where tensor parallelism inside experts
    computes T*K pairs at I/N), and 0 * an inf expert output would be NaN
    (within reach of fp16's range only). Sending them all to one expert,
    rather than spreading them, keeps the weights a decode step streams to
    the experts it uses plus one. A kernel that skipped a sentinel id (vLLM's
    expert_map -1) would remove the waste."""
    shifted = ids - local.start
    mine = (shifted >= 0) & (shifted < len(local))
    return weights.masked_fill(~mine, 0.0), shifted.masked_fill(~mine, 0)


class FusedExperts(nn.Module):
    """This rank's routed experts of one layer, stacked: w13_weight
    [E_local, 2I_local, D], w2_weight [E_local, D, I_local]. Checkpoint tensor
    `experts.E.gate_proj.weight` loads as shard (E, 0) of w13, `up_proj` as
    (E, 1), `down_proj` as shard E of w2, E the global id (models/deepseek.py
    routes the names); only this rank's shards exist.

    By default (tensor parallelism inside each expert) a rank holds all E
    experts, I / tp of each one's intermediate features (its rows of gate and
    up, its columns of down), so its output is a partial sum.

    expert_parallel: a rank holds E / tp whole experts (`local`, expert_range)
    and reads only theirs. Expert parallelism's dispatch (send each token to
    its experts' ranks) and combine (send the results back and sum them) are
    an all-gather and a reduce-scatter over the tokens; here every rank
    already has every token (activations are replicated across the group) and
    routes them all with the replicated router, so dispatch is free, and a
    rank computes the pairs whose experts it holds (local_routing); the
    combine that leaves the sum on every rank is then one all-reduce of the
    ranks' partial sums -- the same collective as the default's."""

    def __init__(
        self, cfg: MoEConfig, tp_rank: int, tp_size: int, *, expert_parallel: bool = False
    ) -> None:
        super().__init__()
        d, full_i = cfg.hidden_size, cfg.moe_intermediate_size
        if expert_parallel:
            self.local = expert_range(cfg.num_experts, tp_rank, tp_size)
            first, i = 0, full_i
        else:
            self.local = range(cfg.num_experts)
            first, i = shard(full_i, tp_rank, tp_size, "moe_intermediate_size")
        e = len(self.local)
        self.num_experts, self.intermediate_size, self.tp_size = e, i, tp_size
        # At one rank expert parallelism holds every expert: nothing to remap.
        self.routes_locally = e < cfg.num_experts
        self.w13_weight = nn.Parameter(torch.empty(e, 2 * i, d), requires_grad=False)
        self.w2_weight = nn.Parameter(torch.empty(e, d, i), requires_grad=False)
        # shard id (global expert ids) -> ExpertShard (local index); the loader
        # checks that every listed shard is filled exactly once.
        self.w13_weight.shard_offsets = {  # type: ignore[attr-defined]
            (x, half): ExpertShard(x - self.local.start, half * i, i, 0, first, i, (full_i, d))
            for x in self.local for half in (0, 1)
        }  # fmt: skip
        self.w13_weight.weight_loader = _expert_weight_loader  # type: ignore[attr-defined]
        self.w2_weight.shard_offsets = {  # type: ignore[attr-defined]
            x: ExpertShard(x - self.local.start, 0, d, 1, first, i, (d, full_i)) for x in self.local
        }
        self.w2_weight.weight_loader = _expert_weight_loader  # type: ignore[attr-defined]
        for param in (self.w13_weight, self.w2_weight):
            param.expert_ids = self.local  # type: ignore[attr-defined]
            # A lazy slice only when experts are split by features: an
            # expert-parallel rank keeps its experts' tensors whole.
            mark_reads_part(param, i < full_i)

    def forward(
        self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        if self.routes_locally:
            weights, ids = local_routing(weights, ids, self.local)
        out = ctx.ops.fused_moe(
            x, self.w13_weight, self.w2_weight, weights, ids, workspace=ctx.workspace
        )
        return out if self.tp_size == 1 else tp_group().all_reduce(out)


def _expert_weight_loader(param: nn.Parameter, loaded: Any, shard_id: Any) -> None:
    """Copy one expert's [rows, cols] checkpoint tensor (or this rank's part
    of it, read from a lazy safetensors slice) into its slice of a stacked
    [E, rows_total, cols] parameter."""
    offsets: dict[Any, ExpertShard] = param.shard_offsets  # type: ignore[attr-defined]
    if shard_id not in offsets:
        held: range = param.expert_ids  # type: ignore[attr-defined]
        raise ValueError(
            f"expert shard {shard_id!r} does not exist: this layer holds experts "
            f"{held.start}..{held.stop - 1} (does n_routed_experts in config.json match?)"
        )
    where = offsets[shard_id]
    if checkpoint_shape(loaded) != where.full:
        raise ValueError(
            f"shape mismatch for expert shard {shard_id!r}: checkpoint has "
            f"{checkpoint_shape(loaded)}, model expects {where.full}"
        )
    part = read_part(loaded, where.dim, where.src_start, where.length)
    param.data[where.expert, where.start : where.start + where.rows].copy_(part)


class DeepseekMoE(nn.Module):
    """Routed experts (weighted by the gate) plus always-on shared experts.
    expert_parallel: the routed experts split whole across the ranks
    (FusedExperts); the router and the shared experts are the same either way."""

    def __init__(
        self, cfg: MoEConfig, tp_rank: int = 0, tp_size: int = 1, *, expert_parallel: bool = False
    ) -> None:
        super().__init__()
        cfg.validate()
        self.gate = TopkRouter(cfg)
        self.experts = FusedExperts(cfg, tp_rank, tp_size, expert_parallel=expert_parallel)
        if cfg.n_shared_experts:
            self.shared_experts: SwiGLUMLP | None = SwiGLUMLP(
                cfg.hidden_size, cfg.moe_intermediate_size * cfg.n_shared_experts,
                cfg.mlp_bias, tp_rank, tp_size, "moe_intermediate_size x n_shared_experts",
            )  # fmt: skip
        else:
            self.shared_experts = None

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        weights, ids = self.gate(x, ctx.ops)
        out = self.experts(x, weights, ids, ctx)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x, ctx.ops)
        return out

    def warmup_token_counts(self, max_num_batched_tokens: int) -> list[int]:
        """One token count per size class of the fused-MoE kernel's tile table
        (kernels/moe/tiles.py) for this layer's routing shape: all T*K pairs
        over the experts this rank holds (every pair is computed, local_routing)."""
        c = self.gate.cfg
        return moe_token_classes(max_num_batched_tokens, c.top_k, self.experts.num_experts)


def _fp32_param(*shape: int) -> nn.Parameter:
    param = nn.Parameter(torch.empty(*shape, dtype=torch.float32), requires_grad=False)
    param.weight_loader = default_weight_loader  # type: ignore[attr-defined]
    return param
