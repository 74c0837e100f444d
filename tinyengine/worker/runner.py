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
from tinyengine.kernels import choose_ops
from tinyengine.kernels.batch_invariant import batch_invariant_ops
from tinyengine.kernels.workspace import Workspace
from tinyengine.models.context import AttentionMetadata, ForwardContext
from tinyengine.models.loader import load_model
from tinyengine.models.rotary import RopeCache
from tinyengine.scheduling.block_manager import SlidingGroup
from tinyengine.scheduling.scheduler import SchedulerOutput
from tinyengine.worker.block_table import HostBlockTable
from tinyengine.worker.cuda_graphs import (
    CudaGraphBackend,
    DecodeGraphs,
    RecordingGraphBackend,
    default_capture_sizes,
)
from tinyengine.worker.input_buffers import InputBuffers, write
from tinyengine.worker.kv_cache import allocate_cache, bytes_per_block, sliding_keep, zero_cache
from tinyengine.worker.prompt_logprobs import prompt_logprobs
from tinyengine.worker.request_sampling import RequestSamplingState
from tinyengine.worker.sample_output import StepLaunch
from tinyengine.worker.sampler import Sampler
from tinyengine.worker.step_rows import NO_ROWS, StepRows, step_rows


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
        self.ops = choose_ops(backend, self.device.type)
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
        self.capture_skip_reason = ""
        self._decode_ctxs: dict[int, ForwardContext] = {}
        # The engine's StepProfiler when EngineConfig.profile_steps is on: its
        # forward hooks bracket the launch (None: not profiling, no cost).
        self.profiler: Any = None
        # Asynchronous scheduling: the last launched step's sampled ids (on the
        # device) by request, and this step's rows that read one of them.
        self._last_sampled: tuple[torch.Tensor, dict[str, int]] | None = None
        self._inflight_rows: list[tuple[int, str]] = []

    # --- stage work: load, KV cache ---

    def load_model(self) -> None:
        self.model = load_model(
            self.config.model, self.hf_config, self.dtype, self.device, self.config.load_format
        )
        for module in self.model.modules():  # max_model_len may pass the model's positions
            if isinstance(module, RopeCache):
                module.cover_positions(self.max_model_len)
        self.keep = sliding_keep(self.model.kv_cache_spec())
        if self.keep is not None:
            self.block_table = HostBlockTable(self.max_blocks_per_seq, sliding=True)
            self.buffers.entry_block_tables = torch.zeros_like(self.buffers.block_tables)

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

    # --- one step ---

    def _rows(self, plan: SchedulerOutput) -> StepRows:
        """The step's rows (worker/step_rows.py); remembers which rows wait
        for a token still in flight, for `_fill_inflight`."""
        rows, self._inflight_rows = step_rows(plan, self.block_table, self.block_size)
        return rows

    def _fill_inflight(self) -> None:
        """input_ids[row] = the id the last launched step sampled for that
        request, copied on the device (stream order puts it after that step)."""
        if not self._inflight_rows:
            return
        tokens, row_of = self._last_sampled
        dst = [row for row, _ in self._inflight_rows]
        src = [row_of[request_id] for _, request_id in self._inflight_rows]
        index = torch.tensor([dst, src], dtype=torch.long).to(self.device, non_blocking=True)
        ids = self.buffers.input_ids
        ids.index_copy_(0, index[0], tokens.index_select(0, index[1]).to(ids.dtype))

    def _write_tables(self, table_rows: np.ndarray, width: int, pad_to: int = 0) -> None:
        """The scheduled rows' block tables (padded with rows that read only
        the dummy blocks), and only the columns some row uses: kernels read a
        row's entries below its seq_len alone, so stale columns further right
        are never looked at (and a full-width table is megabytes per step at
        long max_model_len)."""
        tables = [
            (
                self.buffers.block_tables,
                self.block_table.gather(table_rows, width, pad_to, self.dummy_block),
            )
        ]
        if self.keep is not None:
            tables.append((self.buffers.entry_block_tables, self.block_table.gather_entries(
                table_rows, width, pad_to, self.entry_dummy_block)))  # fmt: skip
        for buffer, table in tables:
            num_rows = table.shape[0]
            buffer[:num_rows, :width].copy_(torch.from_numpy(table), non_blocking=True)

    def prepare_inputs(self, plan: SchedulerOutput) -> ForwardContext:
        """Write an eager step's inputs into the persistent buffers."""
        input_ids, positions, slots, seq_lens, table = self._rows(plan)
        q_lens = [s.num_new_tokens for s in plan.scheduled]
        query_start_loc = np.concatenate([[0], np.cumsum(q_lens)]).tolist()
        seq_lens = [int(n) for n in seq_lens]  # host lengths for the kernels' launch sizes
        return self._write_eager(input_ids, positions, slots, query_start_loc, seq_lens, table)

    def _write_eager(self, input_ids, positions, slots, query_start_loc, seq_lens, table):
        """`table`: (rows, width) as _write_tables takes them."""
        b = self.buffers
        write(b.input_ids, input_ids)
        write(b.positions, positions)
        write(b.slot_mapping, slots)
        write(b.query_start_loc, query_start_loc)
        write(b.seq_lens, seq_lens)
        self._write_tables(*table)
        num_tokens, num_seqs = len(input_ids), len(seq_lens)
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
        seq_lens = seq_lens or q_lens
        starts = np.concatenate([[0], np.cumsum(q_lens)]).tolist()
        num_tokens = starts[-1]
        width = -(-max(seq_lens) // self.block_size)
        ctx = self._write_eager(
            [(7919 * t + 13) % self.vocab_size for t in range(num_tokens)],
            [s - q + j for q, s in zip(q_lens, seq_lens, strict=True) for j in range(q)],
            [self.dummy_block * self.block_size] * num_tokens,
            starts,
            seq_lens,
            # Padding rows only: every position of every row reads a dummy block.
            (np.empty(0, dtype=np.int64), width, len(seq_lens)),
        )
        b = self.buffers
        return self.model(b.input_ids[:num_tokens], b.positions[:num_tokens], ctx)

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
                query_start_loc=b.query_start_loc[: size + 1],
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
        """Decode rows into the buffers, padded to `size` rows. Padding rows are
        one-token sequences in the reserved dummy block: they compute garbage
        that nobody reads and can never touch a live block."""
        input_ids, positions, slots, seq_lens, (table_rows, width) = rows
        b = self.buffers
        write(b.input_ids, input_ids, pad_to=size)
        write(b.positions, positions, pad_to=size)
        write(b.slot_mapping, slots, pad_to=size, pad=self.dummy_block * self.block_size)
        write(b.query_start_loc, range(size + 1))
        write(b.seq_lens, seq_lens, pad_to=size, pad=1)
        self._write_tables(table_rows, width, size)

    def decode_step(self, size: int) -> Callable[[], torch.Tensor]:
        """The callable a decode graph captures: the model over `size` rows."""
        b, ctx = self.buffers, self.decode_context(size)
        return lambda: self.model(b.input_ids[:size], b.positions[:size], ctx)

    @torch.inference_mode()
    def launch(self, plan: SchedulerOutput) -> StepLaunch:
        """Enqueue the step's forward and sampling on the device and start the
        copy of its results to the host, without waiting for any of it."""
        prof = self.profiler
        hidden, sample_rows = self._forward(plan, prof)
        prompt_rows = None
        if any(s.request.sampling_params.prompt_logprobs is not None for s in plan.scheduled):
            # syncs (see its module docstring)
            prompt_rows = prompt_logprobs(self.model, self.ops, hidden, plan)
        sampling = [i for i, row in enumerate(sample_rows) if row >= 0]
        if not sampling:
            if prof is not None:
                prof.forward_end()
            return StepLaunch(len(sample_rows), sampling, None, prompt_rows)
        b = self.buffers
        write(b.logits_indices, [sample_rows[i] for i in sampling])
        logits = self.model.compute_logits(hidden[b.logits_indices[: len(sampling)]], self.ops)
        if prof is not None:  # the profiled "forward" includes the lm_head
            prof.forward_end()

        requests = [plan.scheduled[i].request for i in sampling]
        params, generators, banned, histories = self.request_sampling.rows(
            requests, logits.shape[-1]
        )
        pending = self.sampler.sample(logits, params, generators, banned, histories)
        # The next step may read these ids on the device (asynchronous scheduling).
        self._last_sampled = (pending.token_ids, {r.request_id: i for i, r in enumerate(requests)})
        return StepLaunch(len(sample_rows), sampling, pending, prompt_rows)

    def _forward(self, plan: SchedulerOutput, prof: Any = None) -> tuple[torch.Tensor, list[int]]:
        """Replay a decode graph when one fits the batch, else run eagerly.
        Returns hidden states and, per scheduled request, its sampling row."""
        num_seqs = len(plan.scheduled)
        is_decode = all(s.num_new_tokens == 1 for s in plan.scheduled)
        size = self.graphs.padded_size(num_seqs) if self.graphs and is_decode else None
        if size is not None:
            self.write_decode_inputs(size, self._rows(plan))
            self._fill_inflight()
            if prof is not None:
                prof.forward_start()
            hidden = self.graphs.replay(size, self.decode_step(size))
            # A one-token chunk of a prompt is decode-shaped but does not sample.
            return hidden, [i if s.samples else -1 for i, s in enumerate(plan.scheduled)]
        ctx = self.prepare_inputs(plan)
        self._fill_inflight()
        if prof is not None:
            prof.forward_start()
        b, n = self.buffers, ctx.attn.num_tokens
        hidden = self.model(b.input_ids[:n], b.positions[:n], ctx)
        ends = ctx.attn.query_start_loc_cpu[1:]
        rows = [end - 1 if s.samples else -1 for s, end in zip(plan.scheduled, ends, strict=True)]
        return hidden, rows

    # --- stage work: capture ---

    def capture_enabled(self) -> bool:
        """Whether capture will record graphs (sets capture_skip_reason if not)."""
        if self.config.enforce_eager or self.config.graph_backend == "none":
            self.capture_skip_reason = (
                "enforce_eager" if self.config.enforce_eager else "graph_backend='none'"
            )
            return False
        if self.config.batch_invariant and self.ops.name == "torch":
            self.capture_skip_reason = "batch_invariant (torch ops read lengths on the host)"
            return False
        if self.config.graph_backend != "recording" and self.device.type != "cuda":
            self.capture_skip_reason = "no CUDA device"
            return False
        return True

    def graph_sizes(self) -> list[int]:
        """The decode sizes capture will record ([] when it will not)."""
        return self.capture_sizes if self.capture_enabled() else []

    def make_graph_backend(self) -> CudaGraphBackend | RecordingGraphBackend | None:
        if not self.capture_enabled():
            return None
        if self.config.graph_backend == "recording":
            return RecordingGraphBackend(self.workspace)
        return CudaGraphBackend(self.device)

    @torch.inference_mode()
    def run_decode_shape(self, size: int) -> torch.Tensor:
        """One eager run of the graph-shaped decode step of `size` padding rows
        (profile and warmup use it to size scratch and compile kernels)."""
        self.write_decode_inputs(size, NO_ROWS)
        return self.decode_step(size)()

    @torch.inference_mode()
    def capture(self) -> list[int] | None:
        backend = self.make_graph_backend()
        if backend is None:
            return None
        from tqdm.auto import tqdm  # a bar over the sizes; hidden when stderr is not a TTY

        graphs = DecodeGraphs(backend)
        sizes = sorted(self.capture_sizes, reverse=True)  # largest first: one shared pool
        for size in tqdm(sizes, desc="capture graphs", unit="graph", disable=None, leave=False):
            self.write_decode_inputs(size, NO_ROWS)
            graphs.capture(size, self.decode_step(size))
        self.graphs = graphs
        return graphs.sizes

    # --- per-request state ---

    def free_request(self, request_id: str) -> None:
        self.request_sampling.free(request_id)
        self.block_table.release(request_id)

    def discard_inflight(self) -> None:
        """Forget the launched steps' sampled ids (their step failed): no later
        step may read them as its input."""
        self._last_sampled = None
        self._inflight_rows = []
