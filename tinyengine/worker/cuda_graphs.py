"""Decode CUDA graphs: capture one graph per batch size over the runner's
persistent buffers, and replay them.

Owns the graph backends and the table size -> captured graph. It never decides
which batch sizes exist (the config does) nor what a forward is (the runner
hands it a callable that reads the persistent buffers).

Backends:
  CudaGraphBackend      real `torch.cuda.CUDAGraph`s sharing one memory pool.
  RecordingGraphBackend a CPU stand-in that makes the capture hazard testable
                        without a GPU: "capture" runs the step once and
                        remembers the address of the workspace arena it used;
                        every "replay" first checks that the arena is still at
                        that address (a real graph would read the old, freed
                        buffer otherwise), then runs the step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

# What a decode graph's step returns: hidden states, logits and the draw's
# tokens (None without a draw op), each over all of the graph's rows.
DecodeOutput = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]


class StaleGraphAddressError(RuntimeError):
    """A replay would read workspace memory that was freed after capture."""


class CudaGraphBackend:
    name = "cuda"

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.pool = torch.cuda.graph_pool_handle()

    def capture(self, step: Callable[[], torch.Tensor]) -> tuple[Any, torch.Tensor]:
        graph = torch.cuda.CUDAGraph()
        # Largest size first shares the pool best: smaller graphs fit in the
        # blocks the largest one left behind. `torch.cuda.graph` empties the
        # allocator's cache before each capture, which is needed: memory the
        # default pool caches cannot be freed while a capture runs, so a
        # graph's allocation could fail beside gigabytes cached but unused.
        with torch.cuda.graph(graph, pool=self.pool):
            output = step()
        return graph, output

    def replay(self, handle: tuple[Any, torch.Tensor], step: Callable[[], torch.Tensor]):
        graph, output = handle
        graph.replay()
        return output


class RecordingGraphBackend:
    name = "recording"

    def __init__(self, workspace: Any) -> None:
        self.workspace = workspace
        self.num_replays = 0

    def capture(self, step: Callable[[], torch.Tensor]) -> tuple[int, int]:
        step()
        return self.workspace.buffer.data_ptr(), self.workspace.size

    def replay(self, handle: tuple[int, int], step: Callable[[], torch.Tensor]) -> torch.Tensor:
        address, size = handle
        current = self.workspace.buffer.data_ptr()
        if current != address:
            raise StaleGraphAddressError(
                f"a graph captured against the workspace at 0x{address:x} ({size} bytes) is "
                f"replayed, but the arena now lives at 0x{current:x} ({self.workspace.size} "
                "bytes): the captured address was freed when the workspace grew"
            )
        self.num_replays += 1
        return step()


class DecodeGraphs:
    """Captured decode steps, one per batch size; a batch of n rows replays the
    smallest captured size >= n (the runner pads the rest)."""

    def __init__(self, backend: CudaGraphBackend | RecordingGraphBackend) -> None:
        self.backend = backend
        self.graphs: dict[int, Any] = {}

    @property
    def sizes(self) -> list[int]:
        return sorted(self.graphs)

    def capture(self, size: int, step: Callable[[], torch.Tensor]) -> None:
        self.graphs[size] = self.backend.capture(step)

    def padded_size(self, num_seqs: int) -> int | None:
        for size in self.sizes:
            if size >= num_seqs:
                return size
        return None

    def replay(self, size: int, step: Callable[[], torch.Tensor]) -> torch.Tensor:
        return self.backend.replay(self.graphs[size], step)


def default_capture_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every 8 up to max_num_seqs (which is always included)."""
    sizes = [s for s in (1, 2, 4) if s < max_num_seqs]
    sizes += list(range(8, max_num_seqs + 1, 8))
    if not sizes or sizes[-1] != max_num_seqs:
        sizes.append(max_num_seqs)
    return sizes


def capture_skip_reason(config: Any, device_type: str, ops_name: str) -> str:
    """Why the capture stage records no graph for this EngineConfig ("" when
    it will record)."""
    if config.enforce_eager:
        return "enforce_eager"
    if config.graph_backend == "none":
        return "graph_backend='none'"
    if config.batch_invariant and ops_name == "torch":
        return "batch_invariant (torch ops read lengths on the host)"
    if config.graph_backend != "recording" and device_type != "cuda":
        return "no CUDA device"
    return ""


def graph_backend(name: str, device: torch.device, workspace: Any) -> Any:
    """The backend EngineConfig.graph_backend names, where capture runs."""
    if name == "recording":
        return RecordingGraphBackend(workspace)
    return CudaGraphBackend(device)
