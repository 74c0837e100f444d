"""Precompile: on a GPU with the Triton ops, a dry run of every dummy forward
the startup will run, whose Triton kernels compile in parallel threads
instead of running (kernels/compile_ahead.py). The load stage walks it
between building the model and reading its weights, so the compiles run
while the weights are read; profile waits for them before its real forwards.

The startup's dummy forwards (profile's worst prefill and decode steps and
its decode-size shape runs, warmup's prefill size classes and piecewise
shape runs) meet every kernel variant serving needs. Run for real, they
compile those variants one at a time at their first launch, which is most
of an empty-cache start. Run here first with launches turned into compiles,
they hand every variant to a thread pool at once; the real runs then find
them compiled. With a warm Triton cache the dry run only loads them, in
parallel too.

Owns the list of those forwards' shapes, which profile and warmup share
with it (`largest_prefill`, `largest_decode`, `decode_shape_sizes`,
warmup.py's `run_prefill_classes`). Everything the dry run computes is
garbage and is dropped; it never runs the sampler (whose logprobs index
with the draw's tokens) or a scheduled step (whose next input ids are the
sampled ones).
"""

from __future__ import annotations

import os

import torch

from tinyengine.kernels import compiler_key
from tinyengine.kernels.compile_ahead import AheadCompiles
from tinyengine.models.context import KVCacheSpec
from tinyengine.worker.graph_capture import run_piecewise_shape
from tinyengine.worker.kv_cache import allocate_kv_cache, useful_blocks
from tinyengine.worker.runner import ModelRunner
from tinyengine.worker.warmup import run_prefill_classes, workload


def start_precompile(runner: ModelRunner) -> AheadCompiles | None:
    """The dry run (module docstring) when the runner runs Triton kernels on
    a GPU and EngineConfig.compile_threads allows more than one thread.
    Returns the compiles it handed to the pool, still running (None:
    skipped); their `finish()` waits for them. The model need not hold its
    weights yet: nothing the dry run computes is read."""
    if runner.device.type == "cuda":
        # The compiler key the runner had hashed in a child, installed (and
        # the child reaped) whether or not the dry run runs.
        compiler_key.wait()
    threads = compile_threads(runner.config.compile_threads)
    if threads < 2 or runner.device.type != "cuda" or runner.ops.name != "triton":
        return None
    from tinyengine.kernels.attention.triton import wide_offsets  # imports Triton: GPU only

    runner.allocate_kv_cache(0)  # the dummy block the forwards write
    # The weights are not read yet: zeros, not an empty allocation's
    # leftovers, so that the torch ops' integer parameters (DeepSeek-V4's
    # hash-routing table) index in range. A memset: milliseconds.
    with torch.no_grad():
        for param in runner.model.parameters():
            param.zero_()
    compiles = AheadCompiles(threads)
    try:
        with torch.inference_mode(), compiles.dry():
            startup_forwards(runner)
            # Profile runs against a one-block KV cache; serving's may be too
            # large for the paged attention kernels' int32 offsets, a variant of
            # its own that would otherwise compile in warmup, one at a time.
            if kv_cache_may_need_wide_offsets(runner):
                with wide_offsets():
                    startup_forwards(runner)
    except BaseException:
        compiles.cancel()
        raise
    return compiles


def startup_forwards(runner: ModelRunner) -> None:
    """Every dummy forward the startup runs, in shape: profile's and
    warmup's (module docstring). Prefill shapes first: their variants (the
    prefill attention tiles, the fused MoE's large-token classes) are the
    slowest to compile, and the pool starts each compile when the walk
    meets it, so met last they would finish last."""
    pieces = runner.piecewise_graph_sizes()
    largest_prefill(runner)
    run_prefill_classes(runner, set(pieces))
    for size in reversed(pieces):
        run_piecewise_shape(runner, size, layer_kinds=True)
    largest_decode(runner)
    for size in decode_shape_sizes(runner):
        runner.run_decode_shape(size)
    warmup_requests(runner)


def kv_cache_may_need_wide_offsets(runner: ModelRunner) -> bool:
    """Whether the KV cache size_kv will allocate may reach offsets past
    int32 in one layer (attention/triton.py's offsets_fit_32): judged on the
    largest it can be, `num_kv_blocks` or as many blocks as
    gpu_memory_utilization of the whole device holds (no more than
    sequences can use, as size_kv caps them), laid out on the meta device
    (no memory), with the reserved dummy block. Only a paged K/V cache is
    read by those kernels: MLA's latent cache (DeepSeek-V2/V3) and a hybrid
    one (V4) are not."""
    from tinyengine.kernels.attention.triton import offsets_fit_32

    spec = runner.model.kv_cache_spec()
    if not isinstance(spec, KVCacheSpec) or spec.is_latent:
        return False
    cfg = runner.config
    blocks = cfg.num_kv_blocks
    if not blocks:
        total = torch.cuda.mem_get_info(runner.device)[1]
        blocks = int(total * cfg.gpu_memory_utilization) // runner.kv_bytes_per_block()
        blocks = useful_blocks(blocks, cfg.max_num_seqs, runner.max_blocks_per_seq)
    k_cache, v_cache = allocate_kv_cache(spec, blocks + 1, runner.block_size, runner.dtype,
                                         "meta")[0]  # fmt: skip
    return not offsets_fit_32(k_cache, v_cache)


def compile_threads(setting: int | None) -> int:
    """EngineConfig.compile_threads resolved: None is one per CPU core, up
    to 16 (a startup meets ~16-30 variants)."""
    if setting is not None:
        return setting
    return min(16, len(os.sched_getaffinity(0)))


def largest_prefill(runner: ModelRunner) -> None:
    """Profile's worst prefill step: max_num_batched_tokens tokens in
    sequences no longer than max_model_len (and no more than max_num_seqs
    of them), then the LM head over each sequence's last row."""
    cfg, max_len = runner.config, runner.max_model_len
    num_seqs = min(-(-cfg.max_num_batched_tokens // max_len), cfg.max_num_seqs)
    total = min(cfg.max_num_batched_tokens, num_seqs * max_len)
    q_lens = [total // num_seqs + (1 if i < total % num_seqs else 0) for i in range(num_seqs)]
    hidden = runner.dummy_forward(q_lens)
    ends = torch.tensor(q_lens, device=runner.device).cumsum(0) - 1
    runner.model.compute_logits(hidden[ends], runner.ops)


def largest_decode(runner: ModelRunner) -> torch.Tensor:
    """Profile's worst decode step: max_num_seqs rows, one of them at
    max_model_len context; returns its logits (eager attention scratch
    scales with the longest context, MLA's decode scratch with rows times
    the longest context)."""
    rows, max_len = runner.config.max_num_seqs, runner.max_model_len
    hidden = runner.dummy_forward([1] * rows, [max_len] + [1] * (rows - 1))
    return runner.model.compute_logits(hidden, runner.ops)


def warmup_requests(runner: ModelRunner) -> None:
    """Warmup's served requests as dummy forwards of their shapes: their
    prompts in one prefill step, then each decode step at its context
    lengths. Their lengths meet variants no other startup forward does (a
    kernel's int argument specializes by divisibility by 16, e.g. the
    compressed-token counts of DeepSeek-V4's attention)."""
    num_seqs, prompt_len, decode_steps = workload(runner, None)
    runner.dummy_forward([prompt_len] * num_seqs)
    for step in range(decode_steps):
        runner.dummy_forward([1] * num_seqs, [prompt_len + 1 + step] * num_seqs)


def decode_shape_sizes(runner: ModelRunner) -> list[int]:
    """Every decode batch size a step can have. A decode batch that a
    captured graph fits is padded to that graph's size, so below the largest
    captured size only the captured sizes occur; above it (all sizes when
    nothing is captured) a batch runs eagerly at its own size. With the
    Triton kernels each of those is run, since split-KV scratch is not
    monotonic in the batch size (a small batch splits the context more
    ways)."""
    captured = runner.graph_sizes()
    sizes = set(captured)
    if runner.ops.name == "triton":
        sizes.update(range(max(captured, default=0) + 1, runner.config.max_num_seqs + 1))
    return sorted(sizes)
