"""The work of each startup stage, on one ModelRunner: load, profile, size KV,
warmup, capture, lock (the order is worker/startup.py's).

Owns: resolving an EngineConfig for its model and device and building the
runner (`StartupStages.for_config`); each stage's work; the worst-case dummy
batches of the profile run; the arithmetic of the KV budget.

Each stage returns its result and receives what it needs from an earlier stage
as an argument, handed over by the machine: profile -> `ProfileResult` ->
size_kv -> number of KV blocks -> warmup. This object keeps no stage's result
for another (only the compiles load starts, which profile waits for), never
decides the order, and never reaches into the engine (the
engine is built from the runner and the KV block count once the machine is
READY; warmup drives the runner and a scheduler of its own, worker/warmup.py).

Profile must reach the worst case of everything that scales with the batch —
the activations AND the workspace arena — because the arena is sized here,
before KV sizing, and locked after capture: a shape that first appears later
would have to grow it. On CPU with the torch op set (a "light" startup,
worker/warmup.py) the activation peak is not used (the KV budget is
cpu_kv_cache_gib), so profile runs only what sizes the arena.
"""

from __future__ import annotations

import os
import resource
from dataclasses import dataclass

import torch

from tinyengine.config import EngineConfig
from tinyengine.kernels import jit_monitor
from tinyengine.kernels.compile_ahead import AheadCompiles
from tinyengine.models.loader import load_hf_config
from tinyengine.sampling_params import SamplingParams
from tinyengine.worker.graph_capture import run_piecewise_shape
from tinyengine.worker.kv_cache import sliding_blocks_wanted, sliding_bytes, useful_blocks
from tinyengine.worker.precompile import (
    decode_shape_sizes,
    largest_decode,
    largest_prefill,
    start_precompile,
)
from tinyengine.worker.runner import ModelRunner
from tinyengine.worker.warmup import light_startup, run_warmup


@dataclass
class ProfileResult:
    peak_bytes: int  # activations + scratch of the worst step, above the steady state
    decode_peak_bytes: int  # the same for the largest decode batch (sizes the graph pool)
    # The piecewise graphs' share of the pool: the largest token count's
    # activations and its splitting ops' kept inputs and outputs.
    piecewise_bytes: int = 0


class StartupStages:
    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        # The dry run's compiles, from load (which starts them) to profile
        # (which waits for them): work in the background, not a result.
        self.compiles: AheadCompiles | None = None

    @classmethod
    def for_config(cls, config: EngineConfig) -> StartupStages:
        """Resolve `config` in place (device, limits, block size, dtype,
        max_model_len) and build its runner; nothing is loaded yet."""
        hf_config = load_hf_config(config.model, config.hf_overrides)
        device = config.resolved_device()
        config.resolve_limits(device)
        config.resolve_block_size(hf_config, device)
        config.check_batch_invariant(hf_config, device)
        config.check_devices(device)
        dtype = config.resolved_dtype(hf_config, device)
        config.resolve_max_model_len(hf_config)
        runner = ModelRunner(config, hf_config, device, dtype)
        if device == "cuda" or runner.ops.name == "triton":
            jit_monitor.install()  # imports triton: only where Triton kernels can run
        return cls(runner)

    # --- the stages ---

    def load(self) -> None:
        """Build the model and read its weights; in between, on a GPU with
        the Triton ops, walk the dry run (worker/precompile.py), so that its
        kernels compile in the pool while the weights are read."""

        def start_compiles() -> None:
            self.compiles = start_precompile(self.runner)

        try:
            self.runner.load_model(start_compiles)
        except BaseException:
            self._cancel_compiles()
            raise

    @torch.inference_mode()
    def profile(self) -> ProfileResult:
        """Dummy forwards at the worst shapes, against a KV cache of only the
        reserved dummy block (every row writes and reads it: the numbers are
        garbage, the memory and scratch demands are real)."""
        runner = self.runner
        cfg, device = runner.config, runner.device
        runner.allocate_kv_cache(0)

        # 0. On a GPU with the Triton ops, wait for the compiles load started
        #    (worker/precompile.py): the forwards below then find every kernel
        #    compiled instead of compiling each at its first launch.
        if self.compiles is not None:
            compiles, self.compiles = self.compiles, None
            compiles.finish()
        # 1. The largest prefill step: max_num_batched_tokens tokens in sequences
        #    no longer than max_model_len (and no more than max_num_seqs of them).
        #    Skipped by a light startup (CPU, torch op set; worker/warmup.py):
        #    there the KV budget is cpu_kv_cache_gib, so the activation peak it
        #    measures is never used, and it is not the arena's worst case
        #    either — the torch ops' prefill scratch is one gathered context of
        #    at most max_model_len tokens (attention/reference.py; MLA's
        #    expanded prefill takes none), which step 2 asks for. It is also
        #    the costliest forward on a CPU (tens of seconds for a 135M model).
        peak = 0
        if not light_startup(runner):
            mark = _memory_mark(device)
            largest_prefill(runner)
            peak = _peak_since(device, mark)

        # 2. The largest decode step: max_num_seqs rows, one of them at
        #    max_model_len context (eager attention scratch scales with the
        #    longest context, MLA's decode scratch with rows x longest context),
        #    then the sampler with every filter and logprobs. Every startup
        #    runs it: it is the arena's worst eager request, and the lock after
        #    capture turns any request beyond it into a WorkspaceLockedError.
        mark = _memory_mark(device)
        rows = cfg.max_num_seqs
        logits = largest_decode(runner)
        params = [SamplingParams(temperature=0.8, top_k=20, top_p=0.9, min_p=0.01, logprobs=5)]
        runner.sampler(logits, params * rows, [None] * rows, [[] for _ in range(rows)])
        del logits
        # 3. Every decode batch size a step can have (decode_shape_sizes),
        #    max_model_len context being the worst for each. Each is a shape
        #    run (ForwardContext.running_only): one layer of each kind, whose
        #    kernels and scratch every layer of that kind shares. These runs
        #    also compile every decode graph's kernels before capture (warmup
        #    does not repeat them).
        for size in decode_shape_sizes(runner):
            runner.run_decode_shape(size)
        decode_peak = _peak_since(device, mark)
        # 4. The largest piecewise-graph step (none on a light startup, whose
        #    budget is cpu_kv_cache_gib and whose arena step 2 sized).
        piecewise = 0
        sizes = runner.piecewise_graph_sizes()
        if sizes and not light_startup(runner):
            mark = _memory_mark(device)
            kept = run_piecewise_shape(runner, max(sizes))
            piecewise = _peak_since(device, mark) + kept
        return ProfileResult(max(peak, decode_peak), decode_peak, piecewise)

    def size_kv(self, profile: ProfileResult) -> int:
        """Allocate the KV cache: `num_kv_blocks` from the config, else what
        the budget holds after the profiled peak. Returns the usable blocks."""
        num_blocks = self.plan_kv(profile)
        self.allocate_kv(num_blocks)
        return num_blocks

    def plan_kv(self, profile: ProfileResult) -> int:
        """The usable blocks this rank's budget holds (size_kv's first half:
        with several ranks, each plans and all allocate the minimum)."""
        runner = self.runner
        if runner.config.num_kv_blocks:
            return runner.config.num_kv_blocks
        spec = runner.model.kv_cache_spec()
        sliding = sliding_bytes(spec, self._num_sliding(), runner.block_size, runner.dtype)
        return self._blocks_for_budget(profile, sliding)

    def allocate_kv(self, num_blocks: int) -> None:
        self.runner.allocate_kv_cache(num_blocks, self._num_sliding())

    def _num_sliding(self) -> int:
        runner = self.runner
        return sliding_blocks_wanted(runner.keep, runner.block_size, runner.config)

    def warmup(self, num_kv_blocks: int) -> None:
        run_warmup(self.runner, num_kv_blocks)

    def capture(self) -> dict[str, list[int]] | None:
        return self.runner.capture()

    def lock(self) -> None:
        self.runner.workspace.lock()

    def shutdown(self) -> None:
        """End the compiles load started, should profile never have waited
        for them (LockstepStages also ends its workers)."""
        self._cancel_compiles()

    def _cancel_compiles(self) -> None:
        if self.compiles is not None:
            compiles, self.compiles = self.compiles, None
            compiles.cancel()

    # --- the probes the machine reads around each stage ---

    @property
    def capture_skip_reason(self) -> str:
        return self.runner.capture_skip_reason

    def set_stage(self, name: str) -> None:
        self.runner.workspace.stage = name

    def workspace_bytes(self) -> int:
        return self.runner.workspace.size

    def workspace_growths(self) -> int:
        return self.runner.workspace.stats.num_growths

    def memory_in_use(self) -> int:
        if self.runner.device.type == "cuda":
            return torch.cuda.memory_allocated(self.runner.device)
        with open("/proc/self/statm") as f:  # resident pages
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    # --- KV budget ---

    def _blocks_for_budget(self, profile: ProfileResult, sliding_bytes: int) -> int:
        """KV blocks = (budget - what is already held - profiled peak - graph
        pool - the sliding cache group, whose size is fixed) / bytes per
        block of the full-history group; an error when one max_model_len
        sequence does not fit."""
        runner = self.runner
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
                - profile.piecewise_bytes  # ... and the piecewise graphs' share
            )
            gib = total / 2**30
            where = f"gpu_memory_utilization={cfg.gpu_memory_utilization} of {gib:.1f} GiB"
        else:
            budget = int(cfg.cpu_kv_cache_gib * 2**30)
            where = f"cpu_kv_cache_gib={cfg.cpu_kv_cache_gib}"
        spare = budget - sliding_bytes
        if per_block > 0:
            num_blocks = max(spare // per_block, 0)
        else:  # no layer keeps full history (V4 with sliding layers only): blocks cost nothing
            num_blocks = cfg.max_num_seqs * runner.max_blocks_per_seq if spare >= 0 else 0
        num_blocks = useful_blocks(num_blocks, cfg.max_num_seqs, runner.max_blocks_per_seq)
        if num_blocks < runner.max_blocks_per_seq:
            raise ValueError(
                f"the KV cache budget ({where}) holds {num_blocks} blocks of {runner.block_size} "
                f"tokens ({per_block} bytes each) but one max_model_len={runner.max_model_len} "
                f"sequence needs {runner.max_blocks_per_seq}; lower max_model_len or "
                "max_num_batched_tokens, or raise the budget"
            )
        return num_blocks


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
