"""ModelRunner: turns one scheduler step into one forward pass and one sample.

Owns the model, the KV cache tensors, the workspace arena, the sampler and
its per-request state (worker/request_sampling.py), the decode CUDA graphs,
and the *persistent input buffers* — input_ids, positions, slot_mapping,
query_start_loc, seq_lens, block_tables — allocated once at their worst-case
size and rewritten in place every step. Persistent buffers are what make
CUDA graphs possible: a captured graph reads fixed addresses, so the inputs
must always live there (vLLM's V2 runner design).

It never decides what runs (the scheduler does), never looks at text, and
does the startup stages' GPU work only when the startup machine calls it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from tinyengine.config import EngineConfig
from tinyengine.distributed.tp import tp_group
from tinyengine.kernels import choose_ops, compiler_key
from tinyengine.kernels.batch_invariant import batch_invariant_ops
from tinyengine.kernels.workspace import Workspace
from tinyengine.models.context import AttentionMetadata, ForwardContext
from tinyengine.models.loader import load_model
from tinyengine.models.rotary import RopeCache
from tinyengine.scheduling.block_manager import SlidingGroup
from tinyengine.scheduling.scheduler import SchedulerOutput
from tinyengine.worker.block_table import HostBlockTable
from tinyengine.worker.cuda_graphs import (
    DecodeGraphs,
    DecodeOutput,
    capture_skip_reason,
    default_capture_sizes,
)
from tinyengine.worker.graph_capture import capture_graphs, piecewise_sizes
from tinyengine.worker.inflight import InflightTokens
from tinyengine.worker.input_buffers import InputBuffers, write
from tinyengine.worker.kv_cache import allocate_cache, bytes_per_block, sliding_keep, zero_cache
from tinyengine.worker.piecewise_graphs import PiecewiseGraphs
from tinyengine.worker.prompt_logprobs import prompt_logprobs
from tinyengine.worker.request_sampling import RequestSamplingState
from tinyengine.worker.sample_output import PromptLogprobRows, StepLaunch
from tinyengine.worker.sampler import Sampler
from tinyengine.worker.step_inputs import (
    StepInputs,
    build_step_inputs,
    decode_inputs,
    gather_tables,
)
from tinyengine.worker.step_rows import NO_ROWS, StepRows


class ModelRunner:
    def __init__(self, config: EngineConfig, hf_config: dict, device: str, dtype: torch.dtype):
        self.config = config
        self.hf_config = hf_config
        self.device = torch.device(device)
        self.dtype = dtype
        self.block_size = config.block_size
        assert config.max_model_len is not None, "resolve max_model_len before building the runner"
        self.max_model_len = config.max_model_len
        self.max_blocks_per_seq = -(-self.max_model_len // self.block_size)
        self.vocab_size = int(hf_config["vocab_size"])

        self.model: torch.nn.Module | None = None
        self.workspace = Workspace(self.device)
        # Every op the model and the sampler call, chosen once (kernels/opset.py).
        backend = config.resolved_attention_backend(self.device.type, hf_config)
        if backend == "triton" and self.device.type == "cuda":
            compiler_key.start()  # hashed in a child while the startup goes on
        self.ops = choose_ops(backend, self.device.type, self.workspace)
        if config.batch_invariant:
            self.ops = batch_invariant_ops(self.ops)
        self.sampler = Sampler(self.device, seed=config.seed, draw=self.ops.sample_draw)
        self.request_sampling = RequestSamplingState(self.sampler)
        self.buffers = InputBuffers.allocate(
            config.max_num_batched_tokens, config.max_num_seqs, self.max_blocks_per_seq, self.device
        )
        self.block_table = HostBlockTable(self.max_blocks_per_seq)
        self.kv_caches: list[Any] = []  # per layer, as ctx.kv_caches
        self.num_kv_blocks = 0
        self.num_sliding_blocks = 0  # the sliding cache group's, if the model has one
        self.keep: int | None = None  # that group's kept span (HybridCacheSpec.keep)
        # Reserved blocks that padding rows write to: the per-token group's
        # (the sliding one's, if any) and the full-history group's.
        self.dummy_block = self.entry_dummy_block = 0
        self.capture_sizes = sorted(
            set(config.cuda_graph_sizes or default_capture_sizes(config.max_num_seqs))
        )
        self.graphs: DecodeGraphs | None = None
        # Prefill/mixed token counts for piecewise graphs (worker/piecewise_graphs.py).
        self.piecewise_sizes = piecewise_sizes(config)
        self.piecewise: PiecewiseGraphs | None = None
        self.capture_skip_reason = ""
        self._decode_ctxs: dict[int, ForwardContext] = {}
        # The engine's StepProfiler when EngineConfig.profile_steps is on: its
        # forward hooks bracket the launch (None: not profiling, no cost).
        self.profiler: Any = None
        # Asynchronous scheduling: the last launched step's sampled ids.
        self.inflight = InflightTokens()
        # The other tensor-parallel ranks (worker/worker_group.py's
        # WorkerGroup) once startup is READY; None with one rank, and on
        # every rank while the startup stages run (each runs them itself).
        self.peers: Any = None

    # --- stage work: load, KV cache ---

    def load_model(self, before_weights: Callable[[], None] | None = None) -> None:
        """Build the model and fill its weights; `before_weights` runs in
        between, on the built model (the startup's dry run, worker/stages.py)."""
        tp = tp_group()

        def built(model: torch.nn.Module) -> None:
            self.model = model
            for module in model.modules():  # max_model_len may pass the model's positions
                if isinstance(module, RopeCache):
                    module.cover_positions(self.max_model_len)
            self.keep = sliding_keep(model.kv_cache_spec())
            if self.keep is not None:
                self.block_table = HostBlockTable(self.max_blocks_per_seq, sliding=True)
                self.buffers.entry_block_tables = torch.zeros_like(self.buffers.block_tables)
            if before_weights is not None:
                before_weights()

        load_model(  # `built` keeps the model
            self.config.model, self.hf_config, self.dtype, self.device, self.config.load_format,
            tp_rank=tp.rank, tp_size=tp.size, expert_parallel=self.config.enable_expert_parallel,
            threads=self.config.load_threads, on_built=built,
        )  # fmt: skip

    def kv_bytes_per_block(self) -> int:
        """One block of the full-history group (the one whose count varies)."""
        return bytes_per_block(self.model.kv_cache_spec(), self.block_size, self.dtype)

    def sliding_group(self) -> SlidingGroup | None:
        """The block manager's description of the sliding group, if any."""
        if self.keep is None:
            return None
        return SlidingGroup(self.num_sliding_blocks, self.keep)

    def allocate_kv_cache(self, num_blocks: int, num_sliding_blocks: int = 0) -> None:
        """`num_blocks` usable blocks (and `num_sliding_blocks` of a sliding
        group), each group with one more reserved dummy block (its last)
        that padding rows and profile batches write into."""
        self.kv_caches = []  # release the old cache before allocating the new one
        self._decode_ctxs.clear()
        self.kv_caches = allocate_cache(
            self.model.kv_cache_spec(), num_blocks + 1, self.block_size, self.dtype,
            self.device, num_sliding_blocks + 1,
        )  # fmt: skip
        self.num_kv_blocks, self.num_sliding_blocks = num_blocks, num_sliding_blocks
        self.entry_dummy_block = num_blocks
        self.dummy_block = num_sliding_blocks if self.keep is not None else num_blocks
        self.block_table.null_block = self.dummy_block

    def zero_kv_cache(self) -> None:
        zero_cache(self.kv_caches)

    # --- one step: inputs on the host, then the forward on every rank ---

    def write_inputs(self, inputs: StepInputs) -> ForwardContext:
        """Write a step's inputs into the persistent buffers; returns its
        context (a graph-shaped step's is the fixed one its graph captured)."""
        b, size = self.buffers, inputs.graph_size
        b.write_step(inputs, pad_slot=self.dummy_block * self.block_size)
        if size is not None:
            return self.decode_context(size)
        query_start_loc, seq_lens = inputs.query_start_loc, inputs.seq_lens
        num_tokens, num_seqs = inputs.num_tokens, len(seq_lens)
        attn = AttentionMetadata(
            num_tokens=num_tokens,
            num_seqs=num_seqs,
            max_query_len=int(np.diff(query_start_loc).max()),
            max_seq_len=max(seq_lens),
            query_start_loc=b.query_start_loc[: num_seqs + 1],
            seq_lens=b.seq_lens[:num_seqs],
            block_tables=b.block_tables[:num_seqs],
            slot_mapping=b.slot_mapping[:num_tokens],
            query_start_loc_cpu=query_start_loc,
            seq_lens_cpu=seq_lens,
            entry_block_tables=self._entry_tables(num_seqs),
        )
        return self._context(attn)

    def _entry_tables(self, num_seqs: int) -> torch.Tensor | None:
        tables = self.buffers.entry_block_tables
        return None if tables is None else tables[:num_seqs]

    def _context(self, attn: AttentionMetadata) -> ForwardContext:
        return ForwardContext(attn, self.kv_caches, self.ops, self.workspace)

    @torch.inference_mode()
    def dummy_forward(self, q_lens: list[int], seq_lens: list[int] | None = None) -> torch.Tensor:
        """An eager forward over made-up tokens whose K/V all go to the reserved
        dummy block (profile and warmup use it to reach chosen shapes). Sequence
        i computes its last q_lens[i] positions of a seq_lens[i]-token context
        (default: the whole context is new). Returns the hidden states."""
        return self.dummy_step(q_lens, seq_lens)[1]()

    def dummy_step(
        self, q_lens: list[int], seq_lens: list[int] | None = None
    ) -> tuple[ForwardContext, Callable[[], torch.Tensor]]:
        """dummy_forward's inputs, written; returns their context and the
        forward over them (piecewise capture runs it under its graphs)."""
        seq_lens = seq_lens or q_lens
        starts = np.concatenate([[0], np.cumsum(q_lens)]).tolist()
        num_tokens = starts[-1]
        width = -(-max(seq_lens) // self.block_size)
        ctx = self.write_inputs(StepInputs(
            None,
            [(7919 * t + 13) % self.vocab_size for t in range(num_tokens)],
            [s - q + j for q, s in zip(q_lens, seq_lens, strict=True) for j in range(q)],
            [self.dummy_block * self.block_size] * num_tokens,
            seq_lens,
            starts,
            # Padding rows only: every position of every row reads a dummy block.
            gather_tables(self, np.empty(0, dtype=np.int64), width, len(seq_lens)),
        ))  # fmt: skip
        b = self.buffers
        return ctx, lambda: self.model(b.input_ids[:num_tokens], b.positions[:num_tokens], ctx)

    def decode_context(self, size: int) -> ForwardContext:
        """The fixed context of a graph-shaped decode batch of `size` rows: it
        reads only device buffers (no host lengths) and sizes kernels for
        max_model_len, so one capture serves every later step of that size."""
        ctx = self._decode_ctxs.get(size)
        if ctx is None:
            b = self.buffers
            attn = AttentionMetadata(
                num_tokens=size,
                num_seqs=size,
                max_query_len=1,
                max_seq_len=self.max_model_len,
                query_start_loc=b.decode_query_start_loc[: size + 1],
                seq_lens=b.seq_lens[:size],
                block_tables=b.block_tables[:size],
                slot_mapping=b.slot_mapping[:size],
                query_start_loc_cpu=None,
                seq_lens_cpu=None,
                entry_block_tables=self._entry_tables(size),
            )
            ctx = self._decode_ctxs[size] = self._context(attn)
        return ctx

    def write_decode_inputs(self, size: int, rows: StepRows) -> None:
        """Decode rows into the buffers, padded to `size` rows."""
        self.write_inputs(decode_inputs(self, size, rows))

    def decode_step(self, size: int) -> Callable[[], DecodeOutput]:
        """The callable a decode graph captures, the whole step over `size`
        rows: the model, the LM head over every row, and the sampler's draw
        when the op set has one (it reads inv_temperature and seeds, which
        Sampler.stage_graph_draw writes; its tokens are used only when that
        said so). Padding rows cost the LM head nothing it would not read
        anyway: at these sizes the vocab matrix is the traffic."""
        b, ctx, model, ops = self.buffers, self.decode_context(size), self.model, self.ops
        draw = self.sampler.draw

        def step() -> DecodeOutput:
            hidden = model(b.input_ids[:size], b.positions[:size], ctx)
            logits = model.compute_logits(hidden, ops)
            if draw is None:
                return hidden, logits, None
            return hidden, logits, draw(logits, b.inv_temperature[:size], b.seeds[:size])

        return step

    @torch.inference_mode()
    def launch(self, plan: SchedulerOutput) -> StepLaunch:
        """Enqueue the step's forward and sampling on the device and start the
        copy of its results to the host, without waiting for any of it. With
        several tensor-parallel ranks (`peers`, set once startup is READY)
        the other ranks get the step's inputs first and run the same forward;
        only this rank samples, and shares the ids the next step may read."""
        inputs, sampling = build_step_inputs(self, plan)
        peers = self.peers
        if peers is None:
            return self._launch(plan, inputs, sampling)
        peers.run_step(inputs)
        try:
            return self._launch(plan, inputs, sampling)
        except Exception as exc:  # the workers ran on (or died): the ranks are out of step
            raise peers.dead_error(exc) from exc

    def _launch(self, plan: SchedulerOutput, inputs: StepInputs, sampling: list[int]) -> StepLaunch:
        requests = [plan.scheduled[i].request for i in sampling]
        rows = self.request_sampling.rows(requests, self.vocab_size)
        params, generators, banned, _ = rows
        size, b = inputs.graph_size, self.buffers
        # A decode graph's draw serves the batch when its first rows are the
        # sampling ones (every decode row samples) and the sampler can stage it.
        drawn = (
            size is not None
            and _first_rows(sampling)
            and self.sampler.stage_graph_draw(
                params, generators, banned, self.vocab_size,
                b.inv_temperature[:size], b.seeds[:size],
            )
        )  # fmt: skip
        logits, tokens, prompt_rows = self.forward_step(inputs)
        if logits is None:
            return StepLaunch(len(plan.scheduled), sampling, None, prompt_rows)
        if drawn:
            pending = self.sampler.finish(logits, tokens, params)
        else:
            pending = self.sampler.sample(logits, *rows)
        self.remember_sampled(pending.token_ids, [r.request_id for r in requests])
        if self.peers is not None:
            self.peers.share_sampled(pending.token_ids)
        return StepLaunch(len(plan.scheduled), sampling, pending, prompt_rows)

    @torch.inference_mode()
    def forward_step(
        self, inputs: StepInputs
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, PromptLogprobRows | None]:
        """What every rank runs of a step: write the inputs, replay the decode
        graph of its size or run eagerly; then the logits of the sampling rows
        (None when none samples), the tokens a decode graph's draw chose for
        them (None on other steps), and the prompt logprobs asked for (their
        logits are collectives too, so every rank computes them)."""
        prof = self.profiler
        ctx = self.write_inputs(inputs)
        self.inflight.fill(self.buffers.input_ids, inputs.inflight)
        if prof is not None:
            prof.forward_start()
        b, size = self.buffers, inputs.graph_size
        n, rows, k = inputs.num_tokens, inputs.logits_rows, len(inputs.logits_rows)
        if size is not None:
            hidden, logits, tokens = self.graphs.replay(size, self.decode_step(size))
        elif inputs.piecewise_size is not None:
            hidden = self.piecewise.replay(inputs.piecewise_size, ctx, n)[:n]
        else:
            hidden = self.model(b.input_ids[:n], b.positions[:n], ctx)
        prompt = None
        if inputs.prompt_rows:  # syncs (see its module docstring)
            prompt = prompt_logprobs(self.model, self.ops, hidden, inputs.prompt_rows)
        if not k:
            logits = tokens = None
        elif size is not None and _first_rows(rows):
            # Views of the graph's outputs, which its next replay overwrites:
            # whatever reads them (the copy to the host, the next step's
            # in-flight ids) is enqueued before that replay.
            logits, tokens = logits[:k], None if tokens is None else tokens[:k]
        else:  # an eager step, or a decode step not every row of which samples
            write(b.logits_indices, rows)
            index, tokens = b.logits_indices[:k], None
            logits = logits[index] if size else self.model.compute_logits(hidden[index], self.ops)
        if prof is not None:  # the profiled "forward" includes the lm_head
            prof.forward_end()
        return logits, tokens, prompt

    def remember_sampled(self, token_ids: torch.Tensor, request_ids: list[str]) -> None:
        """The ids just sampled, which the next step's in-flight rows read."""
        self.inflight.remember(token_ids, request_ids)

    # --- stage work: capture (worker/graph_capture.py) ---

    def capture_enabled(self) -> bool:
        """Whether capture will record graphs (sets capture_skip_reason if not)."""
        self.capture_skip_reason = capture_skip_reason(self.config, self.device.type, self.ops.name)
        return not self.capture_skip_reason

    def graph_sizes(self) -> list[int]:
        """The decode sizes capture will record ([] when it will not)."""
        return self.capture_sizes if self.capture_enabled() else []

    def piecewise_graph_sizes(self) -> list[int]:
        """The prefill/mixed token counts capture will record ([] when none)."""
        return self.piecewise_sizes if self.capture_enabled() else []

    @torch.inference_mode()
    def run_decode_shape(self, size: int) -> None:
        """A shape run (ForwardContext.running_only one layer of each kind)
        of the graph-shaped decode step of `size` padding rows: profile's, to
        size the arena and compile the kernels of every decode graph."""
        self.write_decode_inputs(size, NO_ROWS)
        with self.decode_context(size).running_only(self.model.layer_kinds()):
            self.decode_step(size)()

    @torch.inference_mode()
    def capture(self) -> dict[str, list[int]] | None:
        """Record the decode ("full") and prefill/mixed ("piecewise") graphs;
        returns their sizes, None when capture is skipped."""
        if not self.capture_enabled():
            return None
        self.graphs, self.piecewise = capture_graphs(self)
        return {"full": self.graphs.sizes,
                "piecewise": self.piecewise.sizes if self.piecewise else []}  # fmt: skip

    # --- per-request state ---

    def free_request(self, request_id: str) -> None:
        self.request_sampling.free(request_id)
        self.block_table.release(request_id)

    def discard_inflight(self) -> None:
        self.inflight.discard()


def _first_rows(rows: list[int]) -> bool:
    """Whether ascending row indices are 0, 1, ..., len - 1 (and not empty)."""
    return bool(rows) and rows[-1] == len(rows) - 1
