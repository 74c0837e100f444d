"""Torch reference for DeepSeek-V4's paged state and its compressor.

Owns where V4's per-layer state lives in the paged cache and the numbers of
the compression. Every tensor is paged with the engine's one block table, so
a block's contents are a function of the tokens up to its end (what the
prefix cache needs), whatever the chunking:

    state_cache  [num_blocks, block_size, 2 * C]  per token: [kv_proj(x) | gate_proj(x)]
                 (fp32), C = D for HCA, 2 * D for CSA and the indexer, whose
                 windows overlap (halves Ca | Cb, see below)
    entry_cache  [num_blocks, rows, D]  one compressed entry per window of `ratio`
                 tokens; rows = ceil(block_size / ratio). Entry w (tokens
                 [w * ratio, (w + 1) * ratio)) sits in the block of its LAST
                 token, row (last % block_size) // ratio: it is written in the
                 step that computes that token, which is when that block is
                 still private to the request (a block is shared through the
                 prefix cache only once full and computed). A decode step
                 under a CUDA graph computes an entry for every row, since a
                 graph cannot choose on the host which rows to write; those
                 that complete no window go to the cache's last block, the
                 engine's reserved dummy block, which only padding rows read.

Entry w = kv_norm( sum_j softmax_j(gate_j + position_bias_j) * kv_j ), rotated
at position w * ratio. Without overlap (HCA, ratio 128) j runs over the
window's tokens. With overlap (CSA and its indexer, ratio 4) j runs over 2 *
ratio slots: the previous window's tokens through their Ca half ([..., :D])
then this window's through their Cb half ([..., D:]); window 0 has no
previous window, its Ca slots weigh nothing. As Hugging Face's
DeepseekV4CSACompressor / DeepseekV4HCACompressor (which carry the same
state between calls in a cache object instead of pages).

Requires ratio | block_size or block_size | ratio. Pure tensor code: never
imports `models/` or `tinyengine/`. Two paths (`split_rows`): the
sequences with one new token (every row of a graph-shaped decode step,
whose host lengths are None; the decode rows of an eager step) go through
device ops only, together and safe to capture; a sequence with a longer
chunk goes alone through a loop with host lengths (compress_longer, which
the Triton op calls too). write_and_compress is a compressor's whole step,
write_rows then compress_windows (one launch in the Triton op set).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


def write_rows(cache: torch.Tensor, rows: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """cache [num_blocks, block_size, W] <- rows [T, W] at slot_mapping [T]
    (block * block_size + offset); negative slots are padding, skipped. A
    graph-shaped decode step has none (the runner pads into its dummy block),
    and under capture every row is written."""
    flat = cache.view(-1, cache.shape[-1])
    if rows.is_cuda and torch.cuda.is_current_stream_capturing():
        flat.index_copy_(0, slot_mapping, rows.to(cache.dtype))
        return
    keep = slot_mapping >= 0
    flat.index_copy_(0, slot_mapping[keep], rows[keep].to(cache.dtype))


def rope_tail(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Interleaved RoPE on the last 2 * cos.shape[-1] channels of x (pairs
    (2i, 2i + 1) of that slice), the rest untouched, in fp32. cos/sin
    broadcast against x[..., :half] (a head axis gets a 1 from the caller)."""
    rope_dim = 2 * cos.shape[-1]
    nope, rope = x[..., :-rope_dim], x[..., -rope_dim:].float()
    even, odd = rope[..., 0::2], rope[..., 1::2]
    rotated = torch.stack([even * cos - odd * sin, odd * cos + even * sin], dim=-1)
    return torch.cat([nope, rotated.flatten(-2).to(x.dtype)], dim=-1)


def token_slots(table: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """Flat per-token slots of `positions` through block table rows: `table`
    [width] with positions of any shape, or [B, width] with positions [B, n]."""
    blocks = positions // block_size
    ids = table[blocks] if table.dim() == 1 else table.gather(1, blocks)
    return ids.long() * block_size + positions % block_size


def entry_slots(
    table: torch.Tensor, entries: torch.Tensor, ratio: int, block_size: int, rows: int
) -> torch.Tensor:
    """Flat rows of compressed entries `entries` (see the module docstring);
    `table` as token_slots', `rows` the entry cache's rows per block."""
    last = (entries + 1) * ratio - 1
    blocks = last // block_size
    ids = table[blocks] if table.dim() == 1 else table.gather(1, blocks)
    return ids.long() * rows + (last % block_size) // ratio


@dataclass
class RowSplit:
    """A step's sequences, split between the ops' two paths: the one-token
    sequences (decode rows), done together with device ops only, and those
    with a longer chunk, done one by one with host lengths."""

    seq_lens: torch.Tensor  # [n] of the one-token sequences
    tables: torch.Tensor  # [n, width] their block table rows (per-token tensors)
    entry_tables: torch.Tensor  # [n, width] the same for the compressed entries
    rows: torch.Tensor | None  # [n] their rows in q (None: rows 0..n-1, the whole batch)
    longer: list[int]  # indices of the sequences with a longer chunk

    @property
    def num_decode(self) -> int:
        return self.seq_lens.shape[0]

    def take(self, x: torch.Tensor) -> torch.Tensor:
        """The decode rows of a per-row tensor."""
        return x if self.rows is None else x.index_select(0, self.rows)


def split_rows(attn: Any) -> RowSplit:
    """A graph-shaped step (no host lengths; padding rows are one-token
    sequences) is all decode rows; an eager step is split by its host lengths."""
    entries = entry_tables(attn)
    if attn.seq_lens_cpu is None:
        return RowSplit(attn.seq_lens, attn.block_tables, entries, None, [])
    starts = attn.query_start_loc_cpu
    ones = [i for i in range(attn.num_seqs) if starts[i + 1] - starts[i] == 1]
    longer = [i for i in range(attn.num_seqs) if starts[i + 1] - starts[i] > 1]
    if len(ones) == attn.num_seqs == attn.num_tokens:
        return RowSplit(attn.seq_lens, attn.block_tables, entries, None, [])
    device = attn.seq_lens.device
    seqs = torch.tensor(ones, dtype=torch.long, device=device)
    rows = torch.tensor([starts[i] for i in ones], dtype=torch.long, device=device)
    return RowSplit(attn.seq_lens[seqs], attn.block_tables[seqs], entries[seqs], rows, longer)


def entry_tables(attn: Any) -> torch.Tensor:
    """The block table of the compressed entries: the full-history cache
    group's when the model has two (AttentionMetadata.entry_block_tables)."""
    return attn.block_tables if attn.entry_block_tables is None else attn.entry_block_tables


def check_ratio(ratio: int, block_size: int) -> None:
    if ratio % block_size and block_size % ratio:
        raise ValueError(
            f"block_size={block_size} and the compression ratio {ratio} must divide one "
            "another (compressed entries are paged per block)"
        )


def compress_windows(
    state_cache: torch.Tensor,
    entry_cache: torch.Tensor,
    attn: Any,
    *,
    ratio: int,
    overlap: bool,
    position_bias: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    cos_sin: torch.Tensor,
) -> None:
    """Write every entry whose window this step completes. The step's
    per-token state must already be in state_cache. `attn` is the step's
    AttentionMetadata; cos_sin [positions, rope_dim] is the [cos | sin] table
    of the compressed branch's rotary."""
    block_size = state_cache.shape[1]
    check_ratio(ratio, block_size)
    pool = _Pool(state_cache, entry_cache, ratio, overlap, position_bias, norm_weight, eps, cos_sin)
    split = split_rows(attn)
    if split.num_decode:
        # One token per row: row b completes window w = (p + 1) / ratio - 1
        # when (p + 1) % ratio == 0; every row computes one, the others go to
        # the reserved dummy block (the cache's last).
        tables, at = split.tables, split.entry_tables
        pos = split.seq_lens.long() - 1
        done = (pos + 1) % ratio == 0
        windows = ((pos + 1) // ratio - 1).clamp(min=0)
        scratch = (entry_cache.shape[0] - 1) * pool.rows
        rows = torch.where(done, entry_slots(at, windows[:, None], ratio, block_size,
                                             pool.rows)[:, 0], scratch)  # fmt: skip
        pool.write(rows, pool.entries(tables, windows))
    _compress_seqs(pool, attn, split.longer)


def compress_longer(
    state_cache: torch.Tensor,
    entry_cache: torch.Tensor,
    attn: Any,
    seqs: list[int],
    *,
    ratio: int,
    overlap: bool,
    position_bias: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    cos_sin: torch.Tensor,
) -> None:
    """compress_windows for the sequences `seqs` only (each with a longer
    chunk, split_rows' `longer`), one by one with host lengths. The Triton
    op sends its longer chunks here."""
    pool = _Pool(state_cache, entry_cache, ratio, overlap, position_bias, norm_weight, eps, cos_sin)
    _compress_seqs(pool, attn, seqs)


def write_and_compress(
    state_cache: torch.Tensor,
    entry_cache: torch.Tensor,
    kv: torch.Tensor,
    gate: torch.Tensor,
    attn: Any,
    *,
    ratio: int,
    overlap: bool,
    position_bias: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    cos_sin: torch.Tensor,
) -> None:
    """A compressor's whole step: the state rows [kv | gate] ([T, C] each)
    written at attn.slot_mapping (write_rows), then compress_windows."""
    write_rows(state_cache, torch.cat([kv, gate], dim=-1), attn.slot_mapping)
    compress_windows(
        state_cache, entry_cache, attn, ratio=ratio, overlap=overlap,
        position_bias=position_bias, norm_weight=norm_weight, eps=eps, cos_sin=cos_sin,
    )  # fmt: skip


def _compress_seqs(pool: _Pool, attn: Any, seqs: list[int]) -> None:
    ratio = pool.ratio
    starts = attn.query_start_loc_cpu
    for i in seqs:
        end = attn.seq_lens_cpu[i]
        start = end - (starts[i + 1] - starts[i])
        if end // ratio <= start // ratio:
            continue  # no window ends in this step's tokens
        windows = torch.arange(start // ratio, end // ratio, device=pool.flat_state.device)
        rows = entry_slots(entry_tables(attn)[i], windows, ratio, pool.block_size, pool.rows)
        table = attn.block_tables[i].expand(len(windows), -1)
        pool.write(rows, pool.entries(table, windows))


class _Pool:
    """The numbers of compress_windows, for windows given as [n] ids with
    their sequences' block table rows [n, width]."""

    def __init__(
        self,
        state_cache: torch.Tensor,
        entry_cache: torch.Tensor,
        ratio: int,
        overlap: bool,
        position_bias: torch.Tensor,
        norm_weight: torch.Tensor,
        eps: float,
        cos_sin: torch.Tensor,
    ) -> None:
        self.flat_state = state_cache.view(-1, state_cache.shape[-1])
        self.flat_entries = entry_cache.view(-1, entry_cache.shape[-1])
        self.block_size = state_cache.shape[1]
        self.rows, self.dim = entry_cache.shape[1], entry_cache.shape[-1]
        self.ratio, self.overlap, self.eps = ratio, overlap, eps
        self.bias, self.norm_weight = position_bias.float(), norm_weight.float()
        self.cos_sin = cos_sin

    def write(self, rows: torch.Tensor, entries: torch.Tensor) -> None:
        self.flat_entries.index_copy_(0, rows, entries.to(self.flat_entries.dtype))

    def entries(self, tables: torch.Tensor, windows: torch.Tensor) -> torch.Tensor:
        """fp32 [n, D]: entry w of each window's sequence."""
        ratio, dim = self.ratio, self.dim
        span = 2 * ratio if self.overlap else ratio
        first = (windows - 1) * ratio if self.overlap else windows * ratio
        positions = first[:, None] + torch.arange(span, device=windows.device)  # [n, span]
        slots = token_slots(tables, positions.clamp(min=0), self.block_size)
        kv, gate = self.flat_state[slots].float().chunk(2, dim=-1)  # [n, span, C] each
        if self.overlap:
            kv = torch.cat([kv[:, :ratio, :dim], kv[:, ratio:, dim:]], dim=1)
            bias = self.bias
            gate = torch.cat(
                [gate[:, :ratio, :dim] + bias[:, :dim], gate[:, ratio:, dim:] + bias[:, dim:]],
                dim=1,
            )
            gate = gate.masked_fill((positions < 0)[..., None], float("-inf"))
        else:
            gate = gate + self.bias
        pooled = (kv * gate.softmax(dim=1)).sum(dim=1)  # [n, D]
        pooled = pooled * torch.rsqrt(pooled.square().mean(-1, keepdim=True) + self.eps)
        pooled = self.norm_weight * pooled
        cos, sin = self.cos_sin[windows * ratio].float().chunk(2, dim=-1)
        return rope_tail(pooled, cos, sin)
