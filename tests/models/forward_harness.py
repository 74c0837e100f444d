"""A tiny stand-in for the runner, for model tests: owns a paged KV cache,
hands out blocks, builds the AttentionMetadata / ForwardContext of a step
by hand, and returns per-row logits.

It exists so model tests do not depend on tinyengine/worker, and it must stay
boring: one flat batch per step, the torch reference op set by default, blocks handed out
in scrambled order (so a model that ignored the block table would fail).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from tinyengine.kernels import OpSet, torch_ops
from tinyengine.models.context import AttentionMetadata, ForwardContext, HybridCacheSpec
from tinyengine.models.loader import load_hf_config, load_model


def load_tiny(
    path: str | Path,
    hf_overrides: dict[str, Any] | None = None,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
) -> nn.Module:
    """The engine's two loading calls, as the runner makes them."""
    return load_model(str(path), load_hf_config(str(path), hf_overrides), dtype, device)


class PagedHarness:
    def __init__(
        self,
        model: nn.Module,
        *,
        block_size: int = 16,
        num_blocks: int = 32,
        seed: int = 0,
        ops: OpSet | None = None,
    ) -> None:
        self.model = model
        self.ops = ops or torch_ops()
        self.block_size = block_size
        spec = model.kv_cache_spec()
        param = next(model.parameters())
        self.device = param.device  # everything follows the model (CPU or CUDA)
        dtype = model.lm_head.weight.dtype
        self.kv_caches: list = []
        if isinstance(spec, HybridCacheSpec):
            self.kv_caches = [
                {
                    t.name: torch.zeros(
                        num_blocks,
                        t.rows_per_block(block_size),
                        t.width,
                        dtype=t.dtype or dtype,
                        device=self.device,
                    )  # fmt: skip
                    for t in layer
                }
                for layer in spec.layers
            ]
        else:
            shape = (num_blocks, block_size, spec.num_kv_heads, spec.head_dim_k)
            self.kv_caches = [
                (
                    torch.zeros(shape, dtype=dtype, device=self.device),
                    torch.zeros(shape, dtype=dtype, device=self.device),
                )
                for _ in range(model.num_attention_layers)
            ]
        self.free_blocks = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed))
        self.free_blocks = self.free_blocks.tolist()
        self.block_tables: dict[int, list[int]] = {}
        self.seq_lens: dict[int, int] = {}

    def _slot(self, seq_id: int, position: int) -> int:
        table = self.block_tables.setdefault(seq_id, [])
        while len(table) <= position // self.block_size:
            table.append(self.free_blocks.pop())
        return table[position // self.block_size] * self.block_size + position % self.block_size

    @torch.inference_mode()
    def step(
        self, new_tokens: dict[int, list[int]], *, num_padding: int = 0
    ) -> dict[int, torch.Tensor]:
        """Run one forward over the new tokens of each sequence (in dict order);
        returns fp32 logits [q_len, vocab] per sequence. `num_padding` extra
        rows with slot -1 imitate a batch padded to a captured size."""
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        starts = [0]
        seq_lens: list[int] = []
        for seq_id, tokens in new_tokens.items():
            start = self.seq_lens.get(seq_id, 0)
            for offset, token in enumerate(tokens):
                input_ids.append(token)
                positions.append(start + offset)
                slots.append(self._slot(seq_id, start + offset))
            self.seq_lens[seq_id] = start + len(tokens)
            starts.append(starts[-1] + len(tokens))
            seq_lens.append(self.seq_lens[seq_id])
        input_ids += [0] * num_padding
        positions += [0] * num_padding
        slots += [-1] * num_padding

        tables = [self.block_tables[seq_id] for seq_id in new_tokens]
        width = max(len(t) for t in tables)

        def dev(values: list, dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype, device=self.device)

        attn = AttentionMetadata(
            num_tokens=len(input_ids),
            num_seqs=len(new_tokens),
            max_query_len=max(len(t) for t in new_tokens.values()),
            max_seq_len=max(seq_lens),
            query_start_loc=dev(starts, torch.int32),
            seq_lens=dev(seq_lens, torch.int32),
            block_tables=dev([t + [0] * (width - len(t)) for t in tables], torch.int32),
            slot_mapping=dev(slots, torch.int64),
            query_start_loc_cpu=starts,
            seq_lens_cpu=seq_lens,
        )
        ctx = ForwardContext(attn, self.kv_caches, self.ops)
        hidden = self.model(dev(input_ids, torch.int64), dev(positions, torch.int64), ctx)
        logits = self.model.compute_logits(hidden[: starts[-1]], self.ops)
        return {
            seq_id: logits[starts[i] : starts[i + 1]].cpu() for i, seq_id in enumerate(new_tokens)
        }
