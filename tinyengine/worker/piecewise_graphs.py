"""Piecewise CUDA graphs: prefill and mixed steps up to a token budget replay
captured graphs of everything between attention calls, with attention run
eagerly between them (vLLM's PIECEWISE mode, without torch.compile).

Owns the token-count ladder, the capture of one step as a chain of graphs
split at the model's splitting ops (ForwardContext.splitting_op), and their
replay. It never decides which steps replay (the runner does) nor what a
forward is (it is handed a callable over the runner's persistent buffers).

How a capture splits: the step runs once under capture with ctx.split set;
each splitting op ends the graph being captured, runs eagerly (outside any
graph) on the capture's own context, and the next graph begins. The op's
inputs (tensors the previous graph wrote) and its output (which the next
graph reads) are kept, so their addresses stay valid. One set of them
serves every token count (SplitBuffers): the largest count, captured
first, keeps its own tensors, and each smaller count's graphs copy their
rows into the front of those (steps never overlap, and each writes before
it reads). A replay of a step of
n <= size tokens replays graph 0, calls each splitting op with the live
step's context on the first n rows of its kept inputs and writes the first
n rows of its kept output, replays the next graph, and so on. The padding
rows (n..size) run through the graphs on stale but finite values; every op
outside the splitting ops works row by row, so they never reach a real row,
and their K/V writes go to the reserved dummy slot.

Why a splitting op takes the context as an argument: a graph bakes in every
host value its code read at capture (lengths, branch choices); only code
handed the live context at replay may depend on the step. The recording
backend makes that testable on CPU: its replay re-runs the forward on the
*capture's* context (what the graphs would have baked in) and gives only the
splitting ops the live one, so model code that reads the step's metadata
outside a splitting op computes wrong tokens there as it would on a GPU.

Backends:
  CudaPiecewiseBackend       real graphs, in the decode graphs' memory pool.
  RecordingPiecewiseBackend  the CPU stand-in above; like the decode one it
                             also checks the workspace arena has not moved.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from tinyengine.worker.cuda_graphs import StaleGraphAddressError

# Token counts captured by default (up to max_num_batched_tokens): up to 512
# each at most 1.5x the one below (2x below 32), then every 256 up to 2048,
# where padding adds at most a third to a step and soon much less. A step
# past the largest runs eagerly, and an eager forward's host time (tens of
# ms for a small model) is what a serving step of one prompt plus the
# running decodes would otherwise pay: a 600-1,100-token step is the common
# case with prompts of up to 1,024 tokens.
DEFAULT_PIECEWISE_SIZES = (8, 16, 32, 48, 64, 96, 128, 192, 256, 384, 512,
                           768, 1024, 1280, 1536, 1792, 2048)  # fmt: skip


def default_piecewise_sizes(max_num_batched_tokens: int) -> list[int]:
    return [s for s in DEFAULT_PIECEWISE_SIZES if s <= max_num_batched_tokens]


@dataclass
class SplitCall:
    """One splitting op of a captured step: fn(ctx, *rows) -> output."""

    fn: Callable[..., torch.Tensor]
    rows: tuple[torch.Tensor, ...]
    output: torch.Tensor

    def run(self, ctx: Any, num_tokens: int) -> torch.Tensor:
        """The op on the live step: its first num_tokens rows into the kept
        output, whose address the next graph captured."""
        result = self.fn(ctx, *(r[:num_tokens] for r in self.rows))
        self.output[:num_tokens].copy_(result[:num_tokens])
        return self.output


class SplitBuffers:
    """The splitting ops' kept inputs and outputs, the i-th op of every
    captured token count sharing the i-th set."""

    def __init__(self) -> None:
        self.rows: list[tuple[torch.Tensor, ...]] = []
        self.outputs: list[torch.Tensor] = []

    def stage(self, index: int, rows: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        """Op `index`'s inputs for this capture: the first (largest) capture
        keeps the forward's own tensors; a later one copies its rows into
        their front (a copy the graph being captured records)."""
        if index == len(self.rows):
            self.rows.append(rows)
            return rows
        kept = self.rows[index]
        n = rows[0].shape[0]
        if len(kept) != len(rows) or any(
            k.shape[0] < n or k.shape[1:] != r.shape[1:] or k.dtype != r.dtype
            for k, r in zip(kept, rows, strict=False)
        ):
            raise RuntimeError(
                f"splitting op {index} of a {n}-token piecewise capture does not fit the "
                "buffers of the first capture: capture the largest token count first, and "
                "keep each op's row shapes independent of the token count"
            )
        views = tuple(k[:n] for k in kept)
        for view, row in zip(views, rows, strict=True):
            view.copy_(row)
        return views

    def output(self, index: int, result: torch.Tensor) -> torch.Tensor:
        """Op `index`'s output for this capture (the same sharing)."""
        if index == len(self.outputs):
            self.outputs.append(result)
            return result
        view = self.outputs[index][: result.shape[0]]
        view.copy_(result)
        return view


@dataclass
class CapturedStep:
    graphs: list[Any] = field(default_factory=list)  # CUDAGraphs (CUDA backend)
    calls: list[SplitCall] = field(default_factory=list)
    output: torch.Tensor | None = None
    # The recording backend's: the capture's context and forward, and the
    # workspace address it saw.
    ctx: Any = None
    step: Callable[[], torch.Tensor] | None = None
    workspace_address: int = 0


class CudaPiecewiseBackend:
    name = "cuda"

    def __init__(self, device: torch.device, pool: Any) -> None:
        self.device = device
        self.pool = pool  # shared with the decode graphs: never replayed concurrently
        self.stream = torch.cuda.Stream(device)
        self.num_replays = 0

    def capture(
        self, ctx: Any, step: Callable[[], torch.Tensor], buffers: SplitBuffers
    ) -> CapturedStep:
        captured = CapturedStep()
        open_graph: list[Any] = []  # the graph being captured, if any

        def begin() -> None:
            graph = torch.cuda.CUDAGraph()
            graph.capture_begin(pool=self.pool)
            open_graph.append(graph)

        def end() -> None:
            graph = open_graph.pop()
            graph.capture_end()
            captured.graphs.append(graph)

        def split(fn: Callable[..., torch.Tensor], *rows: torch.Tensor) -> torch.Tensor:
            index = len(captured.calls)
            rows = buffers.stage(index, rows)  # its copies belong to the graph before the op
            end()
            # Eager, on the capture's own dummy step.
            output = buffers.output(index, fn(ctx, *rows))
            captured.calls.append(SplitCall(fn, rows, output))
            begin()
            return output

        torch.cuda.synchronize(self.device)
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        ctx.split = split
        try:
            with torch.cuda.stream(self.stream):
                begin()
                try:
                    captured.output = step()
                finally:  # never leave a capture open, even on an error
                    if open_graph:
                        end()
        finally:
            ctx.split = None
        torch.cuda.current_stream(self.device).wait_stream(self.stream)
        return captured

    def replay(self, captured: CapturedStep, ctx: Any, num_tokens: int) -> torch.Tensor:
        for i, graph in enumerate(captured.graphs):
            graph.replay()
            if i < len(captured.calls):
                captured.calls[i].run(ctx, num_tokens)
        self.num_replays += 1
        return captured.output


class RecordingPiecewiseBackend:
    name = "recording"

    def __init__(self, workspace: Any) -> None:
        self.workspace = workspace
        self.num_replays = 0

    def capture(
        self, ctx: Any, step: Callable[[], torch.Tensor], buffers: SplitBuffers
    ) -> CapturedStep:
        captured = CapturedStep(ctx=ctx, step=step)

        def split(fn: Callable[..., torch.Tensor], *rows: torch.Tensor) -> torch.Tensor:
            index = len(captured.calls)
            rows = buffers.stage(index, rows)
            output = buffers.output(index, fn(ctx, *rows))
            captured.calls.append(SplitCall(fn, rows, output))
            return output

        ctx.split = split
        try:
            captured.output = step()
        finally:
            ctx.split = None
        captured.workspace_address = self.workspace.buffer.data_ptr()
        return captured

    def replay(self, captured: CapturedStep, ctx: Any, num_tokens: int) -> torch.Tensor:
        current = self.workspace.buffer.data_ptr()
        if current != captured.workspace_address:
            raise StaleGraphAddressError(
                f"a piecewise graph captured against the workspace at "
                f"0x{captured.workspace_address:x} is replayed, but the arena now lives at "
                f"0x{current:x}: the captured address was freed when the workspace grew"
            )
        calls = iter(captured.calls)

        def split(_fn: Callable[..., torch.Tensor], *rows: torch.Tensor) -> torch.Tensor:
            call = next(calls)
            # What the graph before the op would have written into its inputs;
            # then the op recorded at capture, as a real replay calls it.
            for kept, row in zip(call.rows, rows, strict=True):
                kept.copy_(row)
            return call.run(ctx, num_tokens)

        captured.ctx.split = split
        try:
            output = captured.step()
        finally:
            captured.ctx.split = None
        self.num_replays += 1
        return output


class PiecewiseGraphs:
    """Captured steps, one per token count; a step of n tokens replays the
    smallest captured count >= n (the runner pads its inputs to it)."""

    def __init__(self, backend: CudaPiecewiseBackend | RecordingPiecewiseBackend) -> None:
        self.backend = backend
        self.captured: dict[int, CapturedStep] = {}
        self.buffers = SplitBuffers()

    @property
    def sizes(self) -> list[int]:
        return sorted(self.captured)

    def capture(self, size: int, ctx: Any, step: Callable[[], torch.Tensor]) -> None:
        captured = self.backend.capture(ctx, step, self.buffers)
        # One splitting op per attention layer (each has one entry in the
        # cache list): a layer whose attention bypassed splitting_op would be
        # replayed with the dummy step's lengths baked in.
        if len(captured.calls) != len(ctx.kv_caches):
            raise RuntimeError(
                f"piecewise capture at {size} tokens met {len(captured.calls)} splitting ops "
                f"for {len(ctx.kv_caches)} attention layers: every attention must run through "
                "ForwardContext.splitting_op (or use cudagraph_mode='full_decode_only')"
            )
        self.captured[size] = captured

    def padded_size(self, num_tokens: int) -> int | None:
        for size in self.sizes:
            if size >= num_tokens:
                return size
        return None

    def replay(self, size: int, ctx: Any, num_tokens: int) -> torch.Tensor:
        """The step's hidden states, [size, hidden]: rows past num_tokens are padding."""
        return self.backend.replay(self.captured[size], ctx, num_tokens)


def piecewise_backend(name: str, device: torch.device, workspace: Any, pool: Any) -> Any:
    if name == "recording":
        return RecordingPiecewiseBackend(workspace)
    return CudaPiecewiseBackend(device, pool)
