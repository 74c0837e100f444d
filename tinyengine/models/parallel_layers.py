"""Tensor-parallel building blocks: linear layers whose parameters know how
to load themselves, and the vocab-parallel embedding and LM head.

Owns the parameter layouts (e.g. q, k and v stacked in one `qkv_proj`
weight), how each layer shards across tensor-parallel ranks, and each
parameter's `weight_loader(param, loaded, shard_id)`: the only place that
knows where a checkpoint tensor (or this rank's part of it) lands inside a
parameter. At tp_size 1 every layer holds the whole tensor and never
communicates.

Sharding, as Megatron-LM's: a column-parallel layer keeps its rank's output
rows (the fused QKV its query heads and its KV heads, or the one KV head its
query heads share when there are fewer KV heads than ranks); a row-parallel
layer keeps its rank's input columns and all-reduces the partial products
(its bias added once, by rank 0); the embedding and the LM head split the
vocabulary (an all-reduce of the embedded rows, an all-gather of the
logits). The collectives are distributed/tp.py's group. A rank's loader
reads only its part of a safetensors tensor (a lazy slice, `reads_part`).
The Llama family, DeepSeek-V2/V3 (models/mla.py splits heads,
models/moe.py each expert's intermediate features) and DeepSeek-V4
(models/deepseek_v4_attention.py splits query heads and output groups,
models/deepseek_v4_moe.py each expert's intermediate features) build
sharded.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tinyengine.distributed.tp import shard, tp_group
from tinyengine.kernels.opset import OpSet


def _new_param(*shape: int) -> nn.Parameter:
    # Uninitialised on purpose: the loader overwrites every parameter, and
    # skipping a random init keeps building a large model cheap. Built on the
    # current default device/dtype (the loader sets them).
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor, shard_id: Any = None) -> None:
    """Copy a whole checkpoint tensor into a parameter of the same shape."""
    if shard_id is not None:
        raise ValueError(f"this parameter is not packed, yet got shard {shard_id!r}")
    if tuple(param.shape) != tuple(loaded.shape):
        raise ValueError(
            f"shape mismatch: checkpoint has {tuple(loaded.shape)}, model expects "
            f"{tuple(param.shape)} (does config.json match the weights?)"
        )
    param.data.copy_(loaded)  # copy_ also casts dtype and moves device


def checkpoint_shape(loaded: Any) -> tuple[int, ...]:
    """The shape of a checkpoint tensor: a torch.Tensor, or a safetensors
    slice not read yet (what models/loader.py hands a slicing loader)."""
    return tuple(loaded.shape) if isinstance(loaded, torch.Tensor) else tuple(loaded.get_shape())


def read_part(loaded: Any, dim: int, start: int, length: int) -> torch.Tensor:
    """[start, start + length) along `dim` of a checkpoint tensor: narrowed
    from a tensor, or read from a safetensors slice (only those bytes)."""
    if isinstance(loaded, torch.Tensor):
        return loaded.narrow(dim, start, length)
    index = [slice(None)] * len(loaded.get_shape())
    index[dim] = slice(start, start + length)
    return loaded[tuple(index)]


def mark_reads_part(param: nn.Parameter, part: bool) -> None:
    """Mark a parameter that keeps only part of its checkpoint tensor (a
    tensor-parallel rank's): models/loader.py then hands its loader a lazy
    safetensors slice, so only that part is read from the file."""
    param.reads_part = part  # type: ignore[attr-defined]


def sliced_weight_loader(dim: int, start: int, full: int) -> Any:
    """A loader for this rank's slice of a whole checkpoint tensor: `full`
    along `dim` in the checkpoint, [start, start + param's size) kept; it
    reads only that part of a safetensors file (given a lazy slice)."""

    def load(param: nn.Parameter, loaded: Any, shard_id: Any = None) -> None:
        if shard_id is not None:
            raise ValueError(f"this parameter is not packed, yet got shard {shard_id!r}")
        want = list(param.shape)
        want[dim] = full
        if list(checkpoint_shape(loaded)) != want:
            raise ValueError(
                f"shape mismatch: checkpoint has {checkpoint_shape(loaded)}, model expects "
                f"{tuple(want)} (does config.json match the weights?)"
            )
        param.data.copy_(read_part(loaded, dim, start, param.shape[dim]))

    return load


@dataclass(frozen=True)
class PackedShard:
    """Where one checkpoint tensor of a fused parameter goes: rows [start,
    start + size) of the parameter take rows [src_start, src_start + size)
    of the checkpoint tensor, which has `full` rows (size < full: this
    rank's slice)."""

    start: int
    size: int
    src_start: int
    full: int


def packed_weight_loader(param: nn.Parameter, loaded: Any, shard_id: Any) -> None:
    """Copy one checkpoint tensor (e.g. k_proj), or this rank's rows of it,
    into its rows of a fused parameter (e.g. qkv_proj), using the offsets the
    layer recorded; from a safetensors slice it reads only those rows."""
    offsets: dict[Any, PackedShard] = param.shard_offsets  # type: ignore[attr-defined]
    if shard_id not in offsets:
        raise ValueError(f"unknown shard {shard_id!r}; this parameter packs {list(offsets)}")
    where = offsets[shard_id]
    shape = checkpoint_shape(loaded)
    if shape[0] != where.full or shape[1:] != tuple(param.shape[1:]):
        raise ValueError(
            f"shape mismatch for shard {shard_id!r}: checkpoint has {shape}, "
            f"model expects ({where.full}, *{tuple(param.shape[1:])})"
        )
    param.data.narrow(0, where.start, where.size).copy_(
        read_part(loaded, 0, where.src_start, where.size)
    )


class LinearBase(nn.Module):
    """y = x W^T + b with W [output_size, input_size], this rank's sizes;
    parameters carry a weight_loader. Parallel variants differ only in how
    they shard (their loaders) and whether they reduce (RowParallelLinear)."""

    def __init__(self, input_size: int, output_size: int, bias: bool) -> None:
        super().__init__()
        self.input_size = input_size
        self.output_size = output_size
        self.weight = _new_param(output_size, input_size)
        self.weight.weight_loader = default_weight_loader  # type: ignore[attr-defined]
        if bias:
            self.bias: nn.Parameter | None = _new_param(output_size)
            self.bias.weight_loader = default_weight_loader  # type: ignore[attr-defined]
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor, ops: OpSet) -> torch.Tensor:
        return ops.linear(x, self.weight, self.bias)

    def _pack(self, shards: dict[Any, tuple[int, int, int]]) -> None:
        """Declare that the output rows are several checkpoint tensors stacked:
        shard id -> (rows here, first row kept, rows in the checkpoint)."""
        offsets: dict[Any, PackedShard] = {}
        start = 0
        for shard_id, (size, src_start, full) in shards.items():
            offsets[shard_id] = PackedShard(start, size, src_start, full)
            start += size
        assert start == self.output_size, "packed shards must cover the output exactly"
        for param in (self.weight, self.bias):
            if param is not None:
                param.shard_offsets = offsets  # type: ignore[attr-defined]
                param.weight_loader = packed_weight_loader  # type: ignore[attr-defined]
                mark_reads_part(param, any(o.size < o.full for o in offsets.values()))


class ReplicatedLinear(LinearBase):
    """Every rank holds the whole weight."""

    def __init__(
        self, input_size: int, output_size: int, bias: bool, tp_rank: int = 0, tp_size: int = 1
    ) -> None:
        super().__init__(input_size, output_size, bias)


class ColumnParallelLinear(LinearBase):
    """Output features split across ranks: rank r holds rows [r * O / tp,
    (r + 1) * O / tp) of W (and of b); its output is that slice, no
    communication."""

    def __init__(
        self, input_size: int, output_size: int, bias: bool, tp_rank: int = 0, tp_size: int = 1
    ) -> None:
        start, size = shard(output_size, tp_rank, tp_size, "output features")
        super().__init__(input_size, size, bias)
        for param in (self.weight, self.bias):
            if param is not None:
                param.weight_loader = sliced_weight_loader(0, start, output_size)  # type: ignore[attr-defined]
                mark_reads_part(param, tp_size > 1)


class RowParallelLinear(LinearBase):
    """Input features split across ranks: rank r holds columns [r * I / tp,
    (r + 1) * I / tp) of W and takes that slice of x (a column-parallel
    layer's output); the partial products are all-reduced. The bias is added
    once, by rank 0, before the sum."""

    def __init__(
        self, input_size: int, output_size: int, bias: bool, tp_rank: int = 0, tp_size: int = 1
    ) -> None:
        start, size = shard(input_size, tp_rank, tp_size, "input features")
        super().__init__(size, output_size, bias)
        self.weight.weight_loader = sliced_weight_loader(1, start, input_size)  # type: ignore[attr-defined]
        mark_reads_part(self.weight, tp_size > 1)
        self.tp_rank, self.tp_size = tp_rank, tp_size

    def forward(self, x: torch.Tensor, ops: OpSet) -> torch.Tensor:
        if self.tp_size == 1:
            return ops.linear(x, self.weight, self.bias)
        partial = ops.linear(x, self.weight, self.bias if self.tp_rank == 0 else None)
        return tp_group().all_reduce(partial)


class MergedColumnParallelLinear(LinearBase):
    """Several column-parallel projections of the same input fused into one
    matmul (gate_proj and up_proj -> gate_up_proj); shard ids 0, 1, ...
    Each is split across ranks on its own, so rank r holds [gate_r | up_r]."""

    def __init__(
        self,
        input_size: int,
        output_sizes: Sequence[int],
        bias: bool,
        tp_rank: int = 0,
        tp_size: int = 1,
    ) -> None:
        shards = {}
        for i, full in enumerate(output_sizes):
            start, size = shard(full, tp_rank, tp_size, f"projection {i}'s output features")
            shards[i] = (size, start, full)
        super().__init__(input_size, sum(size for size, _, _ in shards.values()), bias)
        self.output_sizes = [size for size, _, _ in shards.values()]
        self._pack(shards)


def kv_heads_per_rank(num_kv_heads: int, tp_size: int) -> int:
    """KV heads a rank holds: an equal share, or one (replicated) when there
    are fewer KV heads than ranks (tp_size must then be a multiple)."""
    if num_kv_heads >= tp_size:
        return shard(num_kv_heads, 0, tp_size, "num_key_value_heads")[1]
    if tp_size % num_kv_heads:
        raise ValueError(
            f"tensor_parallel_size={tp_size} must divide or be a multiple of "
            f"num_key_value_heads={num_kv_heads}"
        )
    return 1


def first_kv_head(num_kv_heads: int, tp_rank: int, tp_size: int) -> int:
    """The first KV head rank tp_rank holds (kv_heads_per_rank of them)."""
    if num_kv_heads >= tp_size:
        return tp_rank * kv_heads_per_rank(num_kv_heads, tp_size)
    return tp_rank // (tp_size // num_kv_heads)


class QKVParallelLinear(LinearBase):
    """q, k and v projections fused into one matmul; shard ids "q", "k", "v".
    Output rows: [q (Hq*D) | k (Hkv*D) | v (Hkv*D)] of this rank's heads: an
    equal share of the query heads, and of the KV heads (or the one KV head
    its query heads use, when there are fewer KV heads than ranks)."""

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        num_heads: int,
        num_kv_heads: int,
        bias: bool,
        tp_rank: int = 0,
        tp_size: int = 1,
    ) -> None:
        q_start, q_heads = shard(num_heads, tp_rank, tp_size, "num_attention_heads")
        kv_heads = kv_heads_per_rank(num_kv_heads, tp_size)
        kv_start = first_kv_head(num_kv_heads, tp_rank, tp_size)
        self.q_size = q_heads * head_dim
        self.kv_size = kv_heads * head_dim
        super().__init__(hidden_size, self.q_size + 2 * self.kv_size, bias)
        kv = (self.kv_size, kv_start * head_dim, num_kv_heads * head_dim)
        self._pack({"q": (self.q_size, q_start * head_dim, num_heads * head_dim), "k": kv,
                    "v": kv})  # fmt: skip


class VocabParallelEmbedding(nn.Module):
    """Token embeddings, the vocabulary split across ranks: rank r holds rows
    [r * V_r, (r + 1) * V_r) with V_r = ceil(V / tp) (the last slice padded
    with zero rows). A rank embeds the ids in its slice, zeros for the rest,
    and the all-reduce adds the ranks' rows."""

    def __init__(
        self, num_embeddings: int, embedding_dim: int, tp_rank: int = 0, tp_size: int = 1
    ) -> None:
        super().__init__()
        self.num_embeddings = num_embeddings
        self.tp_size = tp_size
        per_rank = -(-num_embeddings // tp_size)
        self.vocab_start = tp_rank * per_rank
        self.weight = _new_param(per_rank, embedding_dim)
        if tp_size == 1:
            self.weight.weight_loader = default_weight_loader  # type: ignore[attr-defined]
        else:
            self.weight.weight_loader = self._load_slice  # type: ignore[attr-defined]
            mark_reads_part(self.weight, True)

    def _load_slice(self, param: nn.Parameter, loaded: Any, shard_id: Any = None) -> None:
        shape = checkpoint_shape(loaded)
        if shard_id is not None or shape != (self.num_embeddings, param.shape[1]):
            raise ValueError(
                f"shape mismatch: checkpoint has {shape}, model expects "
                f"{(self.num_embeddings, param.shape[1])} (does config.json match the weights?)"
            )
        rows = max(0, min(param.shape[0], self.num_embeddings - self.vocab_start))
        param.data.zero_()
        param.data[:rows].copy_(read_part(loaded, 0, self.vocab_start, rows))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start
        inside = (local >= 0) & (local < self.weight.shape[0])
        rows = F.embedding(local.clamp(0, self.weight.shape[0] - 1), self.weight)
        return tp_group().all_reduce(rows * inside.unsqueeze(-1).to(rows.dtype))


class ParallelLMHead(VocabParallelEmbedding):
    """The output projection hidden -> vocab; may share its weight with the
    input embedding (tie_word_embeddings). Each rank computes its vocab
    slice's logits; the all-gather joins them (padding rows dropped)."""

    def forward(self, hidden_states: torch.Tensor, ops: OpSet) -> torch.Tensor:
        logits = ops.linear(hidden_states, self.weight)
        if self.tp_size == 1:
            return logits
        return tp_group().all_gather(logits, dim=-1)[..., : self.num_embeddings]
