"""The per-step forward context: everything a model's forward needs besides
input_ids and positions, passed explicitly (no hidden globals).

Owns the shapes and meaning of the attention metadata. The tensors live in
buffers owned by the runner (persistent across steps, so CUDA graphs can read
them); this module only describes them and never allocates.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from tinyengine.kernels.opset import OpSet


@dataclass
class AttentionMetadata:
    """Where each sequence's tokens sit in the flat batch and in the paged cache.

    The batch is "varlen": the new tokens of all sequences are concatenated.
    Sequence i owns rows [query_start_loc[i], query_start_loc[i+1]) of q/k/v;
    those rows are its tokens at positions [seq_lens[i] - q_len_i, seq_lens[i]),
    i.e. the last q_len_i tokens of a context of seq_lens[i] tokens whose first
    seq_lens[i] - q_len_i tokens are already in the cache. A decode row has
    q_len 1; a prefill chunk has q_len > 1 and may follow a cached prefix.
    """

    num_tokens: int  # rows in q/k/v this step (incl. padding rows, if any)
    num_seqs: int
    max_query_len: int
    max_seq_len: int
    query_start_loc: torch.Tensor  # int32 [num_seqs + 1], device
    seq_lens: torch.Tensor  # int32 [num_seqs], device: context length after this step
    block_tables: torch.Tensor  # int32 [num_seqs, max_blocks_per_seq], device
    slot_mapping: torch.Tensor  # int64 [num_tokens]: block_id * block_size + offset; < 0 = skip
    # Host copies for code that must loop over sequences (the torch reference
    # path); kernels meant for CUDA graphs read only the device tensors.
    query_start_loc_cpu: list[int] = field(default_factory=list)
    seq_lens_cpu: list[int] = field(default_factory=list)
    # A model with a second cache group (DeepSeek-V4, see HybridCacheSpec):
    # block_tables / slot_mapping are its per-token sliding group, whose
    # blocks older than the kept span point at a null block, and this table
    # [num_seqs, max_blocks_per_seq] is the full-history group holding the
    # compressed entries. None: one group, block_tables holds everything.
    entry_block_tables: torch.Tensor | None = None


@dataclass(frozen=True)
class KVCacheSpec:
    """What a model stores per token in its paged cache, per attention layer.

    Standard attention keeps K [num_kv_heads, head_dim_k] and V [num_kv_heads,
    head_dim_v]. A latent cache (DeepSeek MLA) keeps one vector per token:
    num_kv_heads=1, head_dim_k = latent width, head_dim_v = 0 — then the
    layer's v_cache is the same tensor as its k_cache.
    """

    num_layers: int
    num_kv_heads: int
    head_dim_k: int
    head_dim_v: int

    @property
    def is_latent(self) -> bool:
        return self.head_dim_v == 0

    def elements_per_token(self) -> int:
        return self.num_layers * self.num_kv_heads * (self.head_dim_k + self.head_dim_v)


@dataclass(frozen=True)
class PagedTensor:
    """One paged tensor of one layer: per block, ceil(block_size /
    tokens_per_row) rows of `width` values (a row per token, or one per
    `tokens_per_row` tokens for compressed entries)."""

    name: str
    width: int
    tokens_per_row: int = 1
    dtype: torch.dtype | None = None  # None: the model's dtype

    def rows_per_block(self, block_size: int) -> int:
        return -(-block_size // self.tokens_per_row)


@dataclass(frozen=True)
class HybridCacheSpec:
    """A cache whose layers hold different things (DeepSeek-V4: raw KV in
    every layer; compressor state, compressed entries and indexer keys in
    some); the layer's cache in ForwardContext.kv_caches is a dict name ->
    tensor [num_blocks, rows_per_block, width].

    With `keep` set, the cache has two groups (scheduling/block_manager.py):
    the per-token tensors (tokens_per_row 1) form a sliding group whose
    blocks a request holds only while they reach its last `keep` positions,
    paged with AttentionMetadata.block_tables; the compressed ones the
    full-history group, paged with entry_block_tables. Without, one group."""

    layers: tuple[tuple[PagedTensor, ...], ...]
    keep: int | None = None

    def is_sliding(self, tensor: PagedTensor) -> bool:
        return self.keep is not None and tensor.tokens_per_row == 1

    def bytes_per_block(self, block_size: int, dtype: torch.dtype, sliding: bool = False) -> int:
        """One block of the full-history group (sliding=False) or of the
        sliding one, every layer."""
        return sum(
            t.rows_per_block(block_size) * t.width * (t.dtype or dtype).itemsize
            for layer in self.layers
            for t in layer
            if self.is_sliding(t) == sliding
        )


@dataclass
class ForwardContext:
    attn: AttentionMetadata
    # One entry per attention layer: (k_cache, v_cache), each
    # [num_blocks, block_size, num_kv_heads, head_dim] (see KVCacheSpec; a
    # latent cache passes the same tensor twice), or a dict of named tensors
    # (HybridCacheSpec).
    kv_caches: list[Any]
    # Every op the model calls (torch references or Triton kernels), chosen
    # once by the engine: kernels.choose_ops(backend, device).
    ops: OpSet
    workspace: Any = None  # the workspace arena (kernels/workspace/), when present
    # Set only while piecewise CUDA graphs capture or replay a step
    # (worker/piecewise_graphs.py): what splitting_op hands its call to.
    split: Callable[..., torch.Tensor] | None = None
    # Set only within `running_only` (startup's shape runs): the decoder
    # layers to run; None runs them all.
    only_layers: tuple[int, ...] | None = None

    def decoder_layers(self, layers: Sequence[Any]) -> Sequence[Any]:
        """`layers` (a model's decoder layers), or only `only_layers` of them."""
        if self.only_layers is None:
            return layers
        return [layers[i] for i in self.only_layers]

    @contextlib.contextmanager
    def running_only(self, layers: tuple[int, ...] | None) -> Iterator[None]:
        """Within it, forwards over this context run only decoder `layers`
        (None: all). Startup's shape runs pass CausalLM.layer_kinds(), one
        layer of each kind: runs that exist to compile a shape's kernels and
        size its scratch, which every layer of a kind shares (a 28-layer
        model runs 2). Their outputs are meaningless."""
        self.only_layers = layers
        try:
            yield
        finally:
            self.only_layers = None

    def splitting_op(self, fn: Callable[..., torch.Tensor], *rows: torch.Tensor) -> torch.Tensor:
        """fn(ctx, *rows): the one part of a layer that reads this step's
        attention metadata (lengths, tables, host copies) — attention and
        whatever must sit beside it. Everything else in a forward is per
        token, which is what lets piecewise CUDA graphs capture it for a
        fixed token count: they end a graph before each splitting op, run
        the op eagerly with the live step's context, and replay the next.

        The contract that makes this safe: fn reads metadata only through
        the context it is given (never through a context it closed over),
        and `rows` and its result are tensors whose first dimension is the
        step's tokens (a replay hands fn the first num_tokens rows)."""
        if self.split is None:
            return fn(self, *rows)
        return self.split(fn, *rows)
