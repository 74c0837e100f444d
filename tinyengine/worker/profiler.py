"""Startup measurements: the profile run and KV-cache sizing.

Owns the worst-case dummy batches and the arithmetic of the KV budget. Profile
must reach the worst case of everything that scales with the batch — the
activations AND the workspace arena — because the arena is sized here, before
KV sizing, and locked after capture: a shape that first appears later would
have to grow it.
"""

from __future__ import annotations

import resource
from dataclasses import dataclass

import torch

from tinyengine.sampling_params import SamplingParams


@dataclass
class ProfileResult:
    peak_bytes: int  # activations + scratch of the worst step, above the steady state
    decode_peak_bytes: int  # the same for the largest decode batch (sizes the graph pool)


def _memory_mark(device: torch.device) -> int:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        return torch.cuda.memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _peak_since(device: torch.device, mark: int) -> int:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - mark
    return max(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - mark, 0)


def _split(total: int, parts: int) -> list[int]:
    return [total // parts + (1 if i < total % parts else 0) for i in range(parts)]


@torch.inference_mode()
def profile_run(runner, graph_sizes: list[int]) -> ProfileResult:
    """Dummy forwards at the worst shapes, against a KV cache of only the
    reserved dummy block (every row writes and reads it: the numbers are
    garbage, the memory and scratch demands are real)."""
    cfg, device = runner.config, runner.device
    runner.allocate_kv_cache(0)
    max_len = runner.max_model_len

    # 1. The largest prefill step: max_num_batched_tokens tokens in sequences
    #    no longer than max_model_len (and no more than max_num_seqs of them).
    mark = _memory_mark(device)
    num_seqs = min(-(-cfg.max_num_batched_tokens // max_len), cfg.max_num_seqs)
    q_lens = _split(min(cfg.max_num_batched_tokens, num_seqs * max_len), num_seqs)
    hidden = runner.dummy_forward(q_lens)
    ends = torch.tensor(q_lens, device=device).cumsum(0) - 1
    runner.model.compute_logits(hidden[ends])
    del hidden
    peak = _peak_since(device, mark)

    # 2. The largest decode step: max_num_seqs rows, one of them at
    #    max_model_len context (eager attention scratch scales with the
    #    longest context), then the sampler with every filter and logprobs.
    mark = _memory_mark(device)
    rows = cfg.max_num_seqs
    hidden = runner.dummy_forward([1] * rows, [max_len] + [1] * (rows - 1))
    logits = runner.model.compute_logits(hidden)
    params = [SamplingParams(temperature=0.8, top_k=20, top_p=0.9, min_p=0.01, logprobs=5)] * rows
    runner.sampler(logits, params, [None] * rows, [[] for _ in range(rows)])
    del hidden, logits
    # 3. Graph-shaped decode batches. Split-KV scratch is not monotonic in the
    #    batch size (a small batch splits the context more ways), so with the
    #    Triton kernels every size an eager decode step may have is run, not
    #    only the captured ones; max_model_len context is the worst for each.
    sizes = set(graph_sizes)
    if runner.attention_ops.name == "triton":
        sizes.update(range(1, cfg.max_num_seqs + 1))
    for size in sorted(sizes):
        runner.run_decode_shape(size)
    decode_peak = _peak_since(device, mark)
    return ProfileResult(max(peak, decode_peak), decode_peak)


def num_kv_blocks_for_budget(runner, profile: ProfileResult) -> int:
    """KV blocks = (budget - what is already held - profiled peak - graph
    pool) / bytes per block; an error when one max_model_len sequence does
    not fit."""
    cfg, device = runner.config, runner.device
    per_block = runner.kv_bytes_per_block()
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        held_by_torch = torch.cuda.memory_allocated(device)  # weights, buffers, workspace
        outside_torch = total - free - torch.cuda.memory_reserved(device)  # context, others
        budget = (
            int(total * cfg.gpu_memory_utilization)
            - outside_torch
            - held_by_torch
            - profile.peak_bytes
            - profile.decode_peak_bytes  # graph pool estimate: the largest decode step
        )
        where = f"gpu_memory_utilization={cfg.gpu_memory_utilization} of {total / 2**30:.1f} GiB"
    else:
        budget = int(cfg.cpu_kv_cache_gib * 2**30)
        where = f"cpu_kv_cache_gib={cfg.cpu_kv_cache_gib}"
    num_blocks = max(budget // per_block, 0)
    # No point holding more than every sequence at full length can use.
    num_blocks = min(num_blocks, cfg.max_num_seqs * runner.max_blocks_per_seq)
    if num_blocks < runner.max_blocks_per_seq:
        raise ValueError(
            f"the KV cache budget ({where}) holds {num_blocks} blocks of {runner.block_size} "
            f"tokens ({per_block} bytes each) but one max_model_len={runner.max_model_len} "
            f"sequence needs {runner.max_blocks_per_seq}; lower max_model_len or "
            "max_num_batched_tokens, or raise the budget"
        )
    return num_blocks
