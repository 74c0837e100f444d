"""Warmup: scheduler-realistic batches through the real engine, then one eager
run of every shape that will be captured.

Owns the choice of warmup workload. It drives the engine's public request path
(add_request / step), so the scheduler, runner, sampler and detokenizer all
see real traffic, and every Triton kernel compiles for every shape class it
will meet. Afterwards it leaves no trace: KV cache zeroed, block manager reset
(a warmup block must never serve a prefix-cache hit), stats cleared.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from tinyengine.sampling_params import SamplingParams
from tinyengine.scheduling.scheduler import SchedulerStats

if TYPE_CHECKING:
    from tinyengine.engine import LLMEngine

DECODE_STEPS = 3


def run_warmup(engine: LLMEngine, graph_sizes: list[int]) -> None:
    cfg, runner = engine.config, engine.runner
    block_manager = engine.scheduler.block_manager
    # As many sequences as a step allows, each with an equal share of the
    # token budget, then a few decode steps with all of them running — all
    # fitted to the KV cache we were given (num_kv_blocks may be tiny).
    capacity = block_manager.num_blocks * block_manager.block_size
    decode_steps = max(0, min(DECODE_STEPS, capacity - 2))
    prompt_len = min(
        cfg.max_num_batched_tokens // cfg.max_num_seqs,
        runner.max_model_len - decode_steps - 1,
        capacity - decode_steps - 1,
    )
    prompt_len = max(prompt_len, 1)
    per_seq_blocks = block_manager.blocks_needed(prompt_len + decode_steps + 1)
    num_seqs = min(cfg.max_num_seqs, block_manager.num_blocks // per_seq_blocks)
    gen = torch.Generator().manual_seed(1234)
    max_tokens = decode_steps + 1  # the first token comes with the prefill
    kinds = [
        SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
        SamplingParams(
            temperature=0.7,
            top_k=20,
            top_p=0.9,
            max_tokens=max_tokens,
            ignore_eos=True,
            seed=1,
            logprobs=2,
        ),
    ]
    ids = []
    for i in range(num_seqs):
        prompt = torch.randint(0, runner.vocab_size, (prompt_len,), generator=gen).tolist()
        ids.append(engine.add_request({"prompt_token_ids": prompt}, kinds[i % 2], f"warmup-{i}"))
    for _ in range(10 * (num_seqs * prompt_len // cfg.max_num_batched_tokens + max_tokens + 2)):
        if not engine.has_unfinished_requests():
            break
        engine.step()
    for request_id in ids:  # anything unfinished (should be none) goes too
        engine.abort_request(request_id)

    # Triton picks its prefill tile by the step's longest query, so one
    # prefill per power-of-two query length compiles every tile class now
    # rather than on some user's first request after startup.
    if runner.attention_ops.name == "triton":
        longest = min(cfg.max_num_batched_tokens, runner.max_model_len - 1)
        q_len = 2
        while q_len < 2 * longest:
            runner.dummy_forward([min(q_len, longest)])
            q_len *= 2
        # The fused MoE picks its tiles by the step's token count (a few size
        # classes); a class may start beyond max_model_len, where only
        # multi-sequence steps reach, so run each class's first count.
        for tokens in _moe_token_counts(runner.model, cfg.max_num_batched_tokens):
            seqs = -(-tokens // max(longest, 1))
            if seqs <= cfg.max_num_seqs:
                runner.dummy_forward([tokens // seqs + (i < tokens % seqs) for i in range(seqs)])

    # One eager run of every shape that will be captured, through the very
    # callable the graph will capture.
    for size in graph_sizes:
        runner.run_decode_shape(size)

    runner.zero_kv_cache()
    block_manager.reset()
    engine.scheduler.stats = SchedulerStats()
    runner.generators.clear()


def _moe_token_counts(model: torch.nn.Module, max_tokens: int) -> list[int]:
    """One token count per fused-MoE size class of the model's MoE layers
    (none for a dense model)."""
    from tinyengine.models.moe import DeepseekMoE

    shapes = {(m.gate.cfg.top_k, m.experts.num_experts)
              for m in model.modules() if isinstance(m, DeepseekMoE)}  # fmt: skip
    if not shapes:
        return []
    from tinyengine.kernels.moe_tiles import moe_token_classes

    return sorted({t for k, e in shapes for t in moe_token_classes(max_tokens, k, e)})
