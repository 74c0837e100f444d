"""Warmup: scheduler-realistic batches through a real scheduler and the runner,
then one eager run of every shape that will be captured.

On CPU with the torch op set (`light_startup`) warmup is one small workload
instead: two requests (greedy, and seeded top-k/top-p with logprobs) with a
two-block prompt, one prefill step and one decode step, through the same
scheduler and `launch`, so the scheduler, prefix-cache hashing, sampler and
result paths have all run once before the first real request. Nothing more
protects anything there: the torch ops compile nothing and have no tile
classes, the arena already reached its final size in profile (its graph-shaped
decode runs included, when the recording backend will capture), and the
per-step cost on a CPU is seconds, not microseconds.

Owns the choice of warmup workload. Requests go through a Scheduler of its own
over the KV cache size_kv allocated, and every step through the runner's
`launch` (inputs, forward, sampler, results to the host), so every Triton
kernel compiles for every shape class it will meet. Afterwards it leaves no
trace: the KV cache is zeroed and its scheduler is dropped (the engine builds
a fresh one, so a warmup block can never serve a prefix-cache hit), and no
per-request runner state remains. It never touches the engine.
"""

from __future__ import annotations

import torch

from tinyengine.sampling_params import SamplingParams
from tinyengine.scheduling.block_manager import BlockManager
from tinyengine.scheduling.request import Request
from tinyengine.scheduling.scheduler import Scheduler
from tinyengine.worker.graph_capture import run_piecewise_shape
from tinyengine.worker.runner import ModelRunner

DECODE_STEPS = 3
# The light (CPU, torch op set) workload: one request per sampling kind, a
# prompt of two full blocks (prefix-cache hashing runs), one decode step.
LIGHT_SEQS = 2
LIGHT_DECODE_STEPS = 1
LIGHT_PROMPT_BLOCKS = 2


def light_startup(runner: ModelRunner) -> bool:
    """Whether startup may skip the work that only GPUs or Triton kernels need:
    on CPU with the torch op set nothing is compiled, no tile class exists,
    and the KV budget is `cpu_kv_cache_gib` rather than measured free memory.
    The Triton op set on CPU (the interpreter) keeps the full startup."""
    return runner.device.type == "cpu" and runner.ops.name == "torch"


def run_warmup(runner: ModelRunner, num_kv_blocks: int) -> None:
    cfg = runner.config
    block_manager = BlockManager(
        num_kv_blocks, cfg.block_size, cfg.enable_prefix_caching, runner.sliding_group()
    )
    scheduler = Scheduler(block_manager, cfg.max_num_seqs, cfg.max_num_batched_tokens)
    num_seqs, prompt_len, decode_steps = workload(runner, block_manager)
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
    requests = []
    for i in range(num_seqs):
        prompt = torch.randint(0, runner.vocab_size, (prompt_len,), generator=gen).tolist()
        requests.append(Request(f"warmup-{i}", prompt, kinds[i % 2], max_tokens))
    max_steps = 10 * (num_seqs * prompt_len // cfg.max_num_batched_tokens + max_tokens + 2)
    _serve(runner, scheduler, requests, max_steps)

    pieces = set() if light_startup(runner) else set(runner.piecewise_graph_sizes())
    if runner.ops.name == "triton":
        run_prefill_classes(runner, pieces)

    # One eager run of every piecewise shape that will be captured, through
    # the very step capture will record, one layer of each kind (what a shape
    # run needs, worker/runner.py): it compiles that shape's Triton kernels
    # (profile ran only the largest). The decode graphs' shapes need no
    # second run: profile ran every captured decode size through the same
    # callable (worker/stages.py, for the arena), which compiled their
    # kernels; the KV cache allocated since changes no kernel specialization
    # (its strides do not depend on the block count). The torch ops compile
    # nothing, so a light startup skips these.
    for size in sorted(pieces):
        run_piecewise_shape(runner, size, layer_kinds=True)

    runner.zero_kv_cache()
    runner.request_sampling.generators.clear()


def workload(runner: ModelRunner, block_manager: BlockManager | None) -> tuple[int, int, int]:
    """Warmup's requests: (how many, prompt length, decode steps). As many
    sequences as a step allows (light: two), each with an equal share of the
    token budget (light: at most two blocks), then a few decode steps
    (light: one) with all of them running, all fitted to the KV cache of
    `block_manager` (its blocks may be few). None: the cache is not sized
    yet and is taken as unbounded (precompile's dry run of these shapes)."""
    cfg = runner.config
    light = light_startup(runner)
    max_seqs = min(LIGHT_SEQS, cfg.max_num_seqs) if light else cfg.max_num_seqs
    decode_steps = LIGHT_DECODE_STEPS if light else DECODE_STEPS
    prompt_len = min(
        cfg.max_num_batched_tokens // max_seqs, runner.max_model_len - decode_steps - 1
    )
    if light:
        prompt_len = min(prompt_len, LIGHT_PROMPT_BLOCKS * cfg.block_size)
    if block_manager is None:
        return max_seqs, max(prompt_len, 1), decode_steps
    capacity = block_manager.num_blocks * cfg.block_size
    decode_steps = max(0, min(decode_steps, capacity - 2))
    prompt_len = max(min(prompt_len, capacity - decode_steps - 1), 1)
    per_seq_blocks = block_manager.blocks_needed(prompt_len + decode_steps + 1)
    return min(max_seqs, block_manager.num_blocks // per_seq_blocks), prompt_len, decode_steps


def run_prefill_classes(runner: ModelRunner, pieces: set[int]) -> None:
    """One dummy prefill per kernel size class a real prefill may meet
    (Triton ops), so each compiles now rather than on some user's first
    request after startup."""
    cfg = runner.config
    # Triton picks its prefill tile by the step's longest query, so one
    # prefill per power-of-two query length reaches every tile class. A
    # length that a piecewise shape runs as one sequence (`pieces`) is left
    # to it: the same forward over the same inputs (worker/graph_capture.py's
    # piecewise_rows).
    longest = min(cfg.max_num_batched_tokens, runner.max_model_len - 1)
    q_len = 2
    while q_len < 2 * longest:
        q = min(q_len, longest)
        if q not in pieces:
            runner.dummy_forward([q])
        q_len *= 2
    # Kernels that pick tiles by the step's token count (the fused MoE's
    # size classes) name the counts to run; a class may start beyond
    # max_model_len, where only multi-sequence steps reach. Only on the
    # GPU: under the CPU interpreter nothing compiles, a class costs a
    # whole interpreted prefill, and profile's worst prefill has sized
    # the arena already.
    if runner.device.type == "cuda":
        for tokens in runner.model.warmup_token_counts(cfg.max_num_batched_tokens):
            seqs = -(-tokens // max(longest, 1))
            if seqs <= cfg.max_num_seqs:
                rows = [tokens // seqs + (i < tokens % seqs) for i in range(seqs)]
                runner.dummy_forward(rows)


def _serve(
    runner: ModelRunner, scheduler: Scheduler, requests: list[Request], max_steps: int
) -> None:
    """The engine's step loop without text: schedule, launch, wait, append,
    stop on length. Anything unfinished after max_steps (should be none) is
    aborted; every request's runner state is released."""
    for request in requests:
        scheduler.add_request(request)
    for _ in range(max_steps):
        if not scheduler.has_unfinished_requests():
            break
        plan = scheduler.schedule()
        if plan.is_empty:
            continue
        token_ids, _ = runner.launch(plan).result()
        for request in scheduler.update_from_output(plan, token_ids):
            status = request.check_token_stop()
            if status is not None:
                scheduler.finish(request, status)
    for request in requests:
        scheduler.abort(request.request_id)
        runner.free_request(request.request_id)
