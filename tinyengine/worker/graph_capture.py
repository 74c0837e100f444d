"""The capture stage's work on a runner: which graphs exist and recording them.

Owns the order of capture (piecewise token counts, then decode sizes, each
largest first: smaller graphs fit in the pool blocks the larger ones left)
and the dummy steps captured. It never decides whether capture runs (the
runner's capture_enabled) nor how a graph replays (worker/cuda_graphs.py,
worker/piecewise_graphs.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from tinyengine.config import EngineConfig
from tinyengine.worker.cuda_graphs import DecodeGraphs, graph_backend
from tinyengine.worker.piecewise_graphs import (
    PiecewiseGraphs,
    default_piecewise_sizes,
    piecewise_backend,
)
from tinyengine.worker.step_rows import NO_ROWS


def piecewise_sizes(config: EngineConfig) -> list[int]:
    """The token counts piecewise graphs cover under config.cudagraph_mode."""
    if config.cudagraph_mode != "full_and_piecewise":
        return []
    # A dummy step of the largest count must fit the step limits.
    limit = min(config.max_num_batched_tokens, config.max_num_seqs * config.max_model_len)
    sizes = config.piecewise_graph_sizes or default_piecewise_sizes(limit)
    return sorted({s for s in sizes if s <= limit})


def piecewise_rows(size: int, max_model_len: int) -> list[int]:
    """A dummy step of `size` tokens as sequences no longer than max_model_len."""
    seqs = -(-size // max_model_len)
    return [size // seqs + (1 if i < size % seqs else 0) for i in range(seqs)]


def capture_graphs(runner: Any) -> tuple[DecodeGraphs, PiecewiseGraphs | None]:
    """Every graph, with the workspace arena held fixed: a growth between two
    captures would free memory the earlier graphs recorded (the lock stage
    then locks it for good)."""
    workspace = runner.workspace
    workspace.lock()
    try:
        return _capture_graphs(runner)
    finally:
        workspace.unlock()


def _capture_graphs(runner: Any) -> tuple[DecodeGraphs, PiecewiseGraphs | None]:
    from tqdm.auto import tqdm  # a bar over the graphs; hidden when stderr is not a TTY

    decode_backend = graph_backend(runner.config.graph_backend, runner.device, runner.workspace)
    piecewise = None
    sizes = sorted(runner.piecewise_sizes, reverse=True)
    bar = tqdm(total=len(sizes) + len(runner.capture_sizes), desc="capture graphs",
               unit="graph", disable=None, leave=False)  # fmt: skip
    if sizes:
        pool = getattr(decode_backend, "pool", None)  # one pool for every graph
        backend = piecewise_backend(
            runner.config.graph_backend, runner.device, runner.workspace, pool
        )
        piecewise = PiecewiseGraphs(backend)
        for size in sizes:
            ctx, step = runner.dummy_step(piecewise_rows(size, runner.max_model_len))
            piecewise.capture(size, ctx, step)
            bar.update()
    graphs = DecodeGraphs(decode_backend)
    for size in sorted(runner.capture_sizes, reverse=True):
        runner.write_decode_inputs(size, NO_ROWS)
        graphs.capture(size, runner.decode_step(size))
        bar.update()
    bar.close()
    return graphs, piecewise


def run_piecewise_shape(runner: Any, size: int, *, layer_kinds: bool = False) -> int:
    """One eager run of the step piecewise capture will record at `size`
    tokens (warmup: it compiles that shape's kernels and sizes its scratch;
    `layer_kinds`: one layer of each kind, ForwardContext.running_only).
    Returns the bytes its splitting ops' inputs and outputs hold: a capture
    keeps them for good (piecewise_graphs.SplitBuffers), so profile counts
    them into the graph pool, over every layer."""
    ctx, step = runner.dummy_step(piecewise_rows(size, runner.max_model_len))
    layers = runner.model.layer_kinds() if layer_kinds else None
    storages: dict[int, int] = {}  # a kept row keeps its whole storage (q: all of qkv)

    def split(fn: Callable[..., torch.Tensor], *rows: torch.Tensor) -> torch.Tensor:
        output = fn(ctx, *rows)
        for t in (*rows, output):
            storage = t.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
        return output

    ctx.split = split
    try:
        with torch.inference_mode(), ctx.running_only(layers):
            step()
    finally:
        ctx.split = None
    return sum(storages.values())
