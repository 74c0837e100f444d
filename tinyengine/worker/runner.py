"""ModelRunner: turns one scheduler step into one forward pass and one sample.

Owns the model, the KV cache tensors, the sampler, per-request random
generators, and the *persistent input buffers* — input_ids, positions,
slot_mapping, query_start_loc, seq_lens, block_tables — allocated once at their
worst-case size and rewritten in place every step. Persistent buffers are what
make CUDA graphs possible later: a captured graph reads fixed addresses, so the
inputs must always live at those addresses (vLLM's V2 runner design).

It never decides what runs (the scheduler does) and never looks at text.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

import kernels
from models.context import AttentionMetadata, ForwardContext
from models.loader import load_model
from tinyengine.config import EngineConfig
from tinyengine.scheduling.scheduler import SchedulerOutput
from tinyengine.worker.kv_cache import allocate_kv_cache, bytes_per_block
from tinyengine.worker.sampler import Sampler, SamplerOutput


@dataclass
class InputBuffers:
    """Worst-case-sized device tensors written in place each step."""

    input_ids: torch.Tensor  # int64 [max_num_batched_tokens]
    positions: torch.Tensor  # int64 [max_num_batched_tokens]
    slot_mapping: torch.Tensor  # int64 [max_num_batched_tokens]
    query_start_loc: torch.Tensor  # int32 [max_num_seqs + 1]
    seq_lens: torch.Tensor  # int32 [max_num_seqs]
    block_tables: torch.Tensor  # int32 [max_num_seqs, max_blocks_per_seq]
    logits_indices: torch.Tensor  # int64 [max_num_seqs]

    @classmethod
    def allocate(cls, max_tokens: int, max_seqs: int, max_blocks: int, device) -> InputBuffers:
        def zeros(*shape: int, dtype: torch.dtype) -> torch.Tensor:
            return torch.zeros(*shape, dtype=dtype, device=device)

        return cls(
            input_ids=zeros(max_tokens, dtype=torch.int64),
            positions=zeros(max_tokens, dtype=torch.int64),
            slot_mapping=zeros(max_tokens, dtype=torch.int64),
            query_start_loc=zeros(max_seqs + 1, dtype=torch.int32),
            seq_lens=zeros(max_seqs, dtype=torch.int32),
            block_tables=zeros(max_seqs, max_blocks, dtype=torch.int32),
            logits_indices=zeros(max_seqs, dtype=torch.int64),
        )


class ModelRunner:
    def __init__(
        self,
        config: EngineConfig,
        hf_config: dict,
        device: str,
        dtype: torch.dtype,
    ) -> None:
        self.config = config
        self.device = torch.device(device)
        self.dtype = dtype
        self.block_size = config.block_size
        self.max_model_len = config.max_model_len
        assert self.max_model_len is not None, "resolve max_model_len before building the runner"
        self.max_blocks_per_seq = -(-self.max_model_len // self.block_size)

        self.model = load_model(config.model, hf_config, dtype, self.device)
        self.vocab_size = int(hf_config["vocab_size"])
        self.attention_ops = kernels.get_attention_ops(
            config.resolved_attention_backend(self.device.type)
        )
        self.sampler = Sampler(self.device, seed=config.seed)
        self.generators: dict[str, torch.Generator] = {}
        self.buffers = InputBuffers.allocate(
            config.max_num_batched_tokens, config.max_num_seqs, self.max_blocks_per_seq, self.device
        )
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.num_kv_blocks = 0

    # --- KV cache ---

    def kv_bytes_per_block(self) -> int:
        num_kv_heads, head_dim = self.model.kv_cache_shape_per_layer()
        return bytes_per_block(
            self.model.num_attention_layers, self.block_size, num_kv_heads, head_dim, self.dtype
        )

    def determine_num_kv_blocks(self) -> int:
        """How many blocks fit the memory budget. (The startup state machine
        replaces this estimate with a profiled one.)"""
        per_block = self.kv_bytes_per_block()
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            used = total - free
            budget = int(total * self.config.gpu_memory_utilization) - used
            # Activations of the largest step, roughly: a few hidden-sized
            # fp32 buffers per batched token. Profiling makes this exact.
            hidden = int(getattr(self.model, "hidden_size", 4096))
            budget -= 64 * self.config.max_num_batched_tokens * hidden
        else:
            budget = int(self.config.cpu_kv_cache_gib * 2**30)
        num_blocks = budget // per_block
        # No point holding more than every sequence at full length can use.
        num_blocks = min(num_blocks, self.config.max_num_seqs * self.max_blocks_per_seq)
        if num_blocks < self.max_blocks_per_seq:
            raise ValueError(
                f"the KV cache budget holds {max(num_blocks, 0)} blocks of {self.block_size} "
                f"tokens ({per_block} bytes each) but one max_model_len={self.max_model_len} "
                f"sequence needs {self.max_blocks_per_seq}; lower max_model_len or raise "
                "gpu_memory_utilization / cpu_kv_cache_gib"
            )
        return num_blocks

    def allocate_kv_cache(self, num_blocks: int) -> None:
        num_kv_heads, head_dim = self.model.kv_cache_shape_per_layer()
        self.kv_caches = allocate_kv_cache(
            self.model.num_attention_layers,
            num_blocks,
            self.block_size,
            num_kv_heads,
            head_dim,
            self.dtype,
            self.device,
        )
        self.num_kv_blocks = num_blocks

    # --- one step ---

    def prepare_inputs(self, out: SchedulerOutput) -> tuple[ForwardContext, int, list[int]]:
        """Write the step's inputs into the persistent buffers. Returns the
        forward context, the number of token rows, and for each scheduled
        request the row whose logits it samples from (-1: no sample)."""
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_start_loc = [0]
        seq_lens: list[int] = []
        sample_rows: list[int] = []
        num_seqs = len(out.scheduled)
        block_table = np.zeros((num_seqs, self.max_blocks_per_seq), dtype=np.int32)
        for i, sched in enumerate(out.scheduled):
            request, start, end = sched.request, sched.start, sched.start + sched.num_new_tokens
            input_ids.extend(request.all_token_ids[start:end])
            positions.extend(range(start, end))
            block_ids = request.block_ids
            slots.extend(block_ids[p // bs] * bs + p % bs for p in range(start, end))
            query_start_loc.append(len(input_ids))
            seq_lens.append(end)
            block_table[i, : len(block_ids)] = block_ids
            sample_rows.append(len(input_ids) - 1 if sched.samples else -1)

        num_tokens = len(input_ids)
        b = self.buffers
        _write(b.input_ids, input_ids)
        _write(b.positions, positions)
        _write(b.slot_mapping, slots)
        _write(b.query_start_loc, query_start_loc)
        _write(b.seq_lens, seq_lens)
        b.block_tables[:num_seqs].copy_(torch.from_numpy(block_table), non_blocking=True)

        attn = AttentionMetadata(
            num_tokens=num_tokens,
            num_seqs=num_seqs,
            max_query_len=max(s.num_new_tokens for s in out.scheduled),
            max_seq_len=max(seq_lens),
            query_start_loc=b.query_start_loc[: num_seqs + 1],
            seq_lens=b.seq_lens[:num_seqs],
            block_tables=b.block_tables[:num_seqs],
            slot_mapping=b.slot_mapping[:num_tokens],
            query_start_loc_cpu=query_start_loc,
            seq_lens_cpu=seq_lens,
        )
        ctx = ForwardContext(attn=attn, kv_caches=self.kv_caches, attention_ops=self.attention_ops)
        return ctx, num_tokens, sample_rows

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> tuple[list[int | None], SamplerOutput | None]:
        """Run the model on the step and sample. Returns the sampled token per
        scheduled request (None where its chunk does not reach its end) and the
        raw sampler output (for logprobs), in the order of `out.scheduled`."""
        ctx, num_tokens, sample_rows = self.prepare_inputs(out)
        b = self.buffers
        hidden = self.model(b.input_ids[:num_tokens], b.positions[:num_tokens], ctx)

        sampling = [i for i, row in enumerate(sample_rows) if row >= 0]
        if not sampling:
            return [None] * len(sample_rows), None
        _write(b.logits_indices, [sample_rows[i] for i in sampling])
        logits = self.model.compute_logits(hidden[b.logits_indices[: len(sampling)]])

        requests = [out.scheduled[i].request for i in sampling]
        sampled = self.sampler(
            logits,
            [r.sampling_params for r in requests],
            [self._generator(r.request_id, r.sampling_params.seed) for r in requests],
            [_banned_tokens(r) for r in requests],
        )
        tokens: list[int | None] = [None] * len(sample_rows)
        for i, token_id in zip(sampling, sampled.token_ids, strict=True):
            tokens[i] = token_id
        return tokens, sampled

    def _generator(self, request_id: str, seed: int | None) -> torch.Generator | None:
        if seed is None:
            return None
        generator = self.generators.get(request_id)
        if generator is None:
            generator = torch.Generator(device=self.device)
            generator.manual_seed(seed)
            self.generators[request_id] = generator
        return generator

    def free_request(self, request_id: str) -> None:
        self.generators.pop(request_id, None)


def _write(buffer: torch.Tensor, values: list[int]) -> None:
    if values:
        buffer[: len(values)].copy_(torch.tensor(values, dtype=buffer.dtype), non_blocking=True)


def _banned_tokens(request) -> list[int]:
    """Before min_tokens outputs exist, a request may not end: its eos and stop
    tokens are masked out of the distribution (vLLM's min_tokens semantics)."""
    params = request.sampling_params
    if request.num_output_tokens >= params.min_tokens:
        return []
    banned = list(params.stop_token_ids)
    if not params.ignore_eos:
        banned.extend(request.eos_token_ids)
    return banned
