"""Multi-head latent attention (MLA, DeepSeek-V2/V3) over a paged *latent*
cache, and the DeepSeek flavour of rotary embeddings (interleaved pairs, YaRN).

Owns the MLA projections (parameter names mirror HF's: q_a_proj, q_a_layernorm,
q_b_proj or q_proj, kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj), the
softmax scale, and the two ways of attending:

  * decode (every sequence adds one token): the *absorbed* form. kv_b_proj maps
    the latent c (width L) to per-head k_nope (dn) and v (dv):
    k_nope_h = W_UK_h c, v_h = W_UV_h c. Then q_nope_h . k_nope_h =
    (W_UK_h^T q_nope_h) . c, so the query is folded into latent space once and
    attention runs directly over the cached latents (ctx.ops.mla_decode); the
    output latent is mapped to v space with W_UV_h afterwards. Per step this
    reads L + R values per cached token instead of H * (dn + dr + dv).
  * prefill and mixed batches: the *expanded* form. Each prefill sequence's
    context latents are gathered from the cache and pushed through kv_b_proj
    into ordinary per-head K (dn + dr) and V (dv), laid out as a temporary
    paged cache with a synthesized block table, and handed to the engine's
    paged attention op (torch reference or Triton) -- compute-bound prefill
    prefers the narrow 192-wide heads. Decode rows inside a mixed batch still
    take the absorbed path, so their (possibly long) contexts are never
    expanded.

Must never read files, allocate the KV cache, or pick a backend: the
ForwardContext brings the cache and the op set. Everything on the decode path
is free of host reads (it runs inside CUDA graphs).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from tinyengine.distributed.tp import shard
from tinyengine.kernels.sparse_attention.rows import query_rows
from tinyengine.models import rotary
from tinyengine.models.context import ForwardContext
from tinyengine.models.layers import RMSNorm
from tinyengine.models.parallel_layers import (
    ColumnParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)

SUPPORTED_ROPE_TYPES = ("default", "yarn")


# ----------------------------------------------------------------------------- rotary


def rope_frequencies(
    params: dict[str, Any], rope_dim: int, max_position_embeddings: int
) -> tuple[torch.Tensor, float]:
    """(inv_freq [rope_dim // 2] fp32, attention_factor) as HF computes them
    (models/rotary.py); DeepSeek checkpoints use the default rope or YaRN."""
    if params["rope_type"] not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"rope type {params['rope_type']!r} is not supported for DeepSeek models; "
            f"supported types are {list(SUPPORTED_ROPE_TYPES)}"
        )
    return rotary.rope_frequencies(rope_dim, params, max_position_embeddings)


def mla_softmax_scale(params: dict[str, Any], qk_head_dim: int) -> float:
    """1/sqrt(qk_head_dim), times mscale(factor, mscale_all_dim)^2 under YaRN
    (DeepSeek's choice: the logits grow with the stretched context)."""
    scale = qk_head_dim**-0.5
    if params["rope_type"] != "default" and params.get("mscale_all_dim"):
        mscale = rotary.yarn_mscale(params["factor"], params["mscale_all_dim"])
        scale = scale * mscale * mscale
    return scale


class DeepseekRotaryEmbedding(rotary.RopeCache):
    """RoPE on the rope part of q and k: x [T, H, R] -> rotated [T, H, R].

    Pairs are (x[2i], x[2i+1]) when `interleaved` (DeepSeek's checkpoints;
    HF V2 always, V3 when rope_interleave) and (x[i], x[i + R/2]) otherwise.
    The output is written de-interleaved ([rotated evens | rotated odds]),
    which HF V3 does too; any fixed permutation is fine because q and k get
    the same one and only their dot product is ever used.

    The cos/sin cache (times the YaRN attention factor) is built once, fp32,
    [max_position, R]; forward only gathers rows and computes in fp32.
    """

    def __init__(
        self,
        rope_dim: int,
        max_position_embeddings: int,
        params: dict[str, Any],
        interleaved: bool,
    ) -> None:
        super().__init__()
        if rope_dim % 2:
            raise ValueError(f"qk_rope_head_dim={rope_dim} must be even")
        self.rope_dim = rope_dim
        self.interleaved = interleaved
        inv_freq, attention_factor = rope_frequencies(params, rope_dim, max_position_embeddings)
        self._init_cache(inv_freq, attention_factor, max_position_embeddings, torch.float32)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        cos, sin = self.cos_sin_cache[positions].unsqueeze(1).chunk(2, dim=-1)
        xf = x.float()
        if self.interleaved:
            a, b = xf[..., 0::2], xf[..., 1::2]
        else:
            a, b = xf.chunk(2, dim=-1)
        return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1).to(x.dtype)


# ----------------------------------------------------------------------------- attention


@dataclass(frozen=True)
class MLADims:
    hidden_size: int
    num_heads: int
    q_lora_rank: int | None  # None: a plain q_proj (DeepSeek-V2-Lite)
    kv_lora_rank: int  # L: width of the cached latent
    qk_nope_head_dim: int  # dn: per-head key/query part without position
    qk_rope_head_dim: int  # R: the roped part, shared by all heads on the key side
    v_head_dim: int  # dv
    rms_norm_eps: float
    attention_bias: bool  # on q_a_proj, kv_a_proj_with_mqa and o_proj (HF's choice)

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_width(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim


class MLAAttention(nn.Module):
    def __init__(
        self,
        dims: MLADims,
        layer_idx: int,
        rotary_emb: DeepseekRotaryEmbedding,
        scale: float,
        tp_rank: int = 0,
        tp_size: int = 1,
    ) -> None:
        super().__init__()
        d = dims
        # This rank's heads: everything after the projections sees only them.
        _, heads = shard(d.num_heads, tp_rank, tp_size, "num_attention_heads")
        self.dims = dataclasses.replace(d, num_heads=heads)
        self.layer_idx = layer_idx
        self.rotary_emb = rotary_emb
        self.scale = scale
        q_out = d.num_heads * d.qk_head_dim
        tp = {"tp_rank": tp_rank, "tp_size": tp_size}
        # Under tensor parallelism the per-head projections (q_proj / q_b_proj,
        # kv_b_proj: each head's rows are contiguous) split by heads and o_proj
        # by its input; the low-rank down-projections and the latent cache
        # stay whole on every rank.
        if d.q_lora_rank is None:
            self.q_proj = ColumnParallelLinear(d.hidden_size, q_out, bias=False, **tp)
        else:
            self.q_a_proj = ReplicatedLinear(
                d.hidden_size, d.q_lora_rank, bias=d.attention_bias, **tp
            )
            self.q_a_layernorm = RMSNorm(d.q_lora_rank, d.rms_norm_eps)
            self.q_b_proj = ColumnParallelLinear(d.q_lora_rank, q_out, bias=False, **tp)
        self.kv_a_proj_with_mqa = ReplicatedLinear(
            d.hidden_size, d.latent_width, bias=d.attention_bias, **tp
        )
        self.kv_a_layernorm = RMSNorm(d.kv_lora_rank, d.rms_norm_eps)
        self.kv_b_proj = ColumnParallelLinear(
            d.kv_lora_rank, d.num_heads * (d.qk_nope_head_dim + d.v_head_dim), bias=False, **tp
        )
        self.o_proj = RowParallelLinear(
            d.num_heads * d.v_head_dim, d.hidden_size, bias=d.attention_bias, **tp
        )

    def forward(
        self, positions: torch.Tensor, hidden_states: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        d, num_tokens, ops = self.dims, hidden_states.shape[0], ctx.ops
        if d.q_lora_rank is None:
            q = self.q_proj(hidden_states, ops)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden_states, ops), ops), ops)
        q_nope, q_pe = q.view(num_tokens, d.num_heads, d.qk_head_dim).split(
            [d.qk_nope_head_dim, d.qk_rope_head_dim], dim=-1
        )
        latent, k_pe = self.kv_a_proj_with_mqa(hidden_states, ops).split(
            [d.kv_lora_rank, d.qk_rope_head_dim], dim=-1
        )
        q_pe = self.rotary_emb(positions, q_pe)
        k_pe = self.rotary_emb(positions, k_pe.unsqueeze(1))
        # One cache row per token: [normed latent | roped shared key].
        row = torch.cat([self.kv_a_layernorm(latent, ops).unsqueeze(1), k_pe], dim=-1)
        if self.layer_idx >= len(ctx.kv_caches):
            raise RuntimeError(
                f"MLA layer {self.layer_idx} has no KV cache: ctx.kv_caches holds "
                f"{len(ctx.kv_caches)} layers (allocate one latent cache per layer)"
            )
        cache = ctx.kv_caches[self.layer_idx][0]
        # The latent cache is one tensor (KVCacheSpec.is_latent): writing it
        # as both "k" and "v" stores the same row twice, which is harmless.
        ctx.ops.write_kv_cache(row, row, cache, cache, ctx.attn.slot_mapping)

        out = ctx.splitting_op(self._attention, q_nope, q_pe)
        return self.o_proj(out.reshape(num_tokens, d.num_heads * d.v_head_dim), ops)

    def _attention(
        self, ctx: ForwardContext, q_nope: torch.Tensor, q_pe: torch.Tensor
    ) -> torch.Tensor:
        """The splitting op (ForwardContext.splitting_op): which form runs
        depends on the step's query lengths, so the choice sits inside it."""
        cache = ctx.kv_caches[self.layer_idx][0]
        if ctx.attn.max_query_len == 1:
            return self._decode_only(q_nope, q_pe, cache, ctx)
        if ctx.ops.batch_invariant:
            return self._every_token_absorbed(q_nope, q_pe, cache, ctx)
        return self._mixed(q_nope, q_pe, cache, ctx)

    # --- decode: absorbed weights over the latent cache ---

    def _absorbed_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of kv_b_proj's weight: W_UK [H, dn, L] and W_UV [H, dv, L]."""
        d = self.dims
        w = self.kv_b_proj.weight.view(d.num_heads, d.qk_nope_head_dim + d.v_head_dim, -1)
        return w[:, : d.qk_nope_head_dim], w[:, d.qk_nope_head_dim :]

    def _absorbed(
        self,
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        cache: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        max_seq_len: int,
        ctx: ForwardContext,
    ) -> torch.Tensor:
        """One query row per sequence -> attention output [B, H, dv]."""
        w_uk, w_uv = self._absorbed_weights()
        q_latent = ctx.ops.head_matmul(q_nope, w_uk).contiguous()
        out_latent = ctx.ops.mla_decode(
            q_latent,
            q_pe.contiguous(),
            cache,
            block_tables,
            seq_lens,
            self.scale,
            max_seq_len=max_seq_len,
            workspace=ctx.workspace,
        )
        return ctx.ops.head_matmul(out_latent, w_uv.transpose(1, 2))

    def _decode_only(
        self, q_nope: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        """Every sequence has exactly one new row, rows 0..num_seqs-1 (graph
        batches and eager decode steps). Reads only device metadata."""
        attn = ctx.attn
        n = attn.num_seqs
        out = self._absorbed(
            q_nope[:n], q_pe[:n], cache, attn.block_tables, attn.seq_lens, attn.max_seq_len, ctx
        )
        if n == q_nope.shape[0]:
            return out
        # Padding rows past the last sequence (eager only) attend to nothing.
        padded = out.new_zeros(q_nope.shape[0], *out.shape[1:])
        padded[:n] = out
        return padded

    def _every_token_absorbed(
        self, q_nope: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        """Batch-invariant mode: each token of a prefill chunk as the decode
        row it would be (the row model of kernels/sparse_attention/rows.py:
        its own length p + 1 over its sequence's table row; padding rows
        have length 0 and attend to nothing), so it computes exactly what
        its decode step would."""
        attn, rows = ctx.attn, query_rows(ctx.attn)
        tables = attn.block_tables if rows.seqs is None else attn.block_tables[rows.seqs.long()]
        return self._absorbed(q_nope, q_pe, cache, tables, rows.seq_lens, attn.max_seq_len, ctx)

    # --- prefill / mixed: decode rows absorbed, prefill rows expanded ---

    def _mixed(
        self, q_nope: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        attn, d = ctx.attn, self.dims
        starts, lens = attn.query_start_loc_cpu, attn.seq_lens_cpu
        if not starts or not lens:
            raise ValueError(
                "MLA prefill/mixed batches need host copies of the lengths "
                "(query_start_loc_cpu, seq_lens_cpu); only decode batches run without them"
            )
        device = q_nope.device
        out = q_nope.new_zeros(q_nope.shape[0], d.num_heads, d.v_head_dim)
        q_lens = [starts[i + 1] - starts[i] for i in range(len(lens))]
        decode = [i for i, q_len in enumerate(q_lens) if q_len == 1]
        prefill = [i for i, q_len in enumerate(q_lens) if q_len > 1]
        if decode:
            rows = torch.tensor([starts[i] for i in decode], device=device)
            seqs = torch.tensor(decode, device=device)
            out[rows] = self._absorbed(
                q_nope[rows], q_pe[rows], cache, attn.block_tables[seqs], attn.seq_lens[seqs],
                max(lens[i] for i in decode), ctx,
            )  # fmt: skip
        if prefill:
            rows = torch.tensor(
                [r for i in prefill for r in range(starts[i], starts[i + 1])], device=device
            )
            out[rows] = self._expanded(q_nope[rows], q_pe[rows], cache, prefill, q_lens, ctx)
        return out

    def _expanded(
        self,
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        cache: torch.Tensor,
        seqs: list[int],
        q_lens: list[int],
        ctx: ForwardContext,
    ) -> torch.Tensor:
        """Attention for the prefill sequences `seqs` (their query rows
        concatenated in q_nope/q_pe) through per-head K/V expanded from their
        cached context latents."""
        attn, d = ctx.attn, self.dims
        block_size = cache.shape[1]
        seq_lens = [attn.seq_lens_cpu[i] for i in seqs]
        num_blocks = [-(-n // block_size) for n in seq_lens]
        block_ids = torch.cat(
            [attn.block_tables[i, :n] for i, n in zip(seqs, num_blocks, strict=True)]
        ).long()
        # These are activations sized by this step's contexts (eager only,
        # never inside a graph), so they are ordinary allocations rather than
        # workspace scratch: a locked arena must not have to grow for a long
        # cached prefix that profile never saw.
        rows = cache[block_ids, :, 0]  # [NB, block_size, L + R]
        latent, k_pe = rows.split([d.kv_lora_rank, d.qk_rope_head_dim], dim=-1)
        kv = self.kv_b_proj(latent, ctx.ops).view(*latent.shape[:2], d.num_heads, -1)
        k_nope, v = kv.split([d.qk_nope_head_dim, d.v_head_dim], dim=-1)
        k = torch.cat([k_nope, k_pe.unsqueeze(2).expand(-1, -1, d.num_heads, -1)], dim=-1)

        # The expanded blocks of sequence j are contiguous, so its block table
        # row is just a range.
        width = max(num_blocks)
        table = torch.zeros(len(seqs), width, dtype=torch.int32)
        offset = 0
        for j, n in enumerate(num_blocks):
            table[j, :n] = torch.arange(offset, offset + n, dtype=torch.int32)
            offset += n
        seq_q_lens = [q_lens[i] for i in seqs]
        query_start_loc = [0]
        for q_len in seq_q_lens:
            query_start_loc.append(query_start_loc[-1] + q_len)
        device = q_nope.device
        return ctx.ops.paged_attention(
            torch.cat([q_nope, q_pe], dim=-1),
            k,
            v,
            table.to(device),
            torch.tensor(query_start_loc, dtype=torch.int32, device=device),
            torch.tensor(seq_lens, dtype=torch.int32, device=device),
            self.scale,
            max_query_len=max(seq_q_lens),
            max_seq_len=max(seq_lens),
            query_start_loc_cpu=query_start_loc,
            seq_lens_cpu=seq_lens,
            workspace=None,  # see above: eager-sized, must not grow a locked arena
        )
