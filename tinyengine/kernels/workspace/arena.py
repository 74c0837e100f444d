"""The workspace arena: one growable scratch buffer per device, shared by every
op that needs temporary memory (split-KV partials, gathered K/V, ...).

Owns that buffer, its growth, and its lock. It never hands out memory that a
captured CUDA graph may still be using: once locked, a request larger than the
buffer raises WorkspaceLockedError instead of growing.

Why a lock. A CUDA graph records raw device addresses. If the arena grew after
capture, the old buffer would be released to the allocator while the graphs
still point into it; the next replay would write into memory that now belongs
to some other tensor. The startup state machine sizes the arena during profile
and warmup (growth is free then), captures graphs, and then locks it, so any
late growth becomes a loud error naming the caller instead of silent
corruption.

Tickets. A kernel whose programs finish a shared result together (the
last split of a row merges the others' partials) counts arrivals in int32
tickets that must read 0 when it starts and that it leaves at 0. They
cannot live in the arena, whose bytes every op overwrites, so the arena
keeps a second, persistent buffer of them (`tickets`), zeroed when it is
allocated and growing under the same lock.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

ALIGNMENT = 256  # bytes: every view starts on a 256-byte boundary (TMA and vector loads like it)
_GROWTH_GRANULE = 1 << 20  # grow in whole MiB so a sequence of slightly larger asks is cheap
_TICKET_GRANULE = 4096  # tickets per growth step (16 KB)

Spec = tuple[Sequence[int], torch.dtype]


class WorkspaceLockedError(RuntimeError):
    """A locked workspace was asked for more bytes than it holds."""


@dataclass
class Growth:
    stage: str
    old_bytes: int
    new_bytes: int
    caller: str


@dataclass
class WorkspaceStats:
    size_bytes: int = 0
    largest_request_bytes: int = 0
    growths: list[Growth] = field(default_factory=list)

    @property
    def num_growths(self) -> int:
        return len(self.growths)


def _align(n: int) -> int:
    return (n + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT


def _caller() -> str:
    """file:line:function of the first frame outside this module."""
    here = os.path.abspath(__file__)
    for frame in inspect.stack()[2:]:
        if os.path.abspath(frame.filename) != here:
            return f"{frame.filename}:{frame.lineno}:{frame.function}"
    return "<unknown>"


class Workspace:
    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self.buffer = torch.empty(0, dtype=torch.uint8, device=self.device)
        self.stage = "unstaged"  # set by the startup state machine, recorded with each growth
        self.stats = WorkspaceStats()
        self._locked = False
        self._tickets = torch.zeros(0, dtype=torch.int32, device=self.device)

    @property
    def locked(self) -> bool:
        return self._locked

    @property
    def size(self) -> int:
        return self.buffer.numel()

    def lock(self) -> None:
        self._locked = True

    def unlock(self) -> None:
        self._locked = False

    def get(self, *specs: Spec) -> list[torch.Tensor]:
        """Views for one op's scratch tensors, each at a 256-byte-aligned offset.

        The views alias the arena: they are valid until the next `get` by any
        op, so an op must be done with its scratch before it returns.
        """
        offsets = []
        total = 0
        for shape, dtype in specs:
            offsets.append(total)
            nbytes = _numel(shape) * torch.empty((), dtype=dtype).element_size()
            total = _align(total + nbytes)
        self.stats.largest_request_bytes = max(self.stats.largest_request_bytes, total)
        if total > self.size:
            self._grow(total)
        views = []
        for (shape, dtype), offset in zip(specs, offsets, strict=True):
            nbytes = _numel(shape) * torch.empty((), dtype=dtype).element_size()
            views.append(self.buffer[offset : offset + nbytes].view(dtype).view(tuple(shape)))
        return views

    @property
    def num_tickets(self) -> int:
        return self._tickets.numel()

    def tickets(self, n: int) -> torch.Tensor:
        """n int32 counters that read 0 between kernels: the kernel that uses
        them must leave them at 0 (module docstring). Persistent: never part
        of a `get` view. Growing them follows the arena's rules (not when
        locked or capturing) and is recorded among its growths."""
        if n > self._tickets.numel():
            new_size = -(-n // _TICKET_GRANULE) * _TICKET_GRANULE
            caller = self._check_growth(n * 4, self._tickets.numel() * 4, _caller())
            self.stats.growths.append(Growth(self.stage, self._tickets.numel() * 4,
                                             new_size * 4, caller))  # fmt: skip
            self._tickets = torch.zeros(new_size, dtype=torch.int32, device=self.device)
        return self._tickets[:n]

    def _check_growth(self, nbytes: int, held: int, caller: str) -> str:
        """Raise if memory a captured graph may hold would be replaced now."""
        if self._locked:
            raise WorkspaceLockedError(
                f"workspace is locked (stage {self.stage!r}): {caller} asked for {nbytes} bytes "
                f"but it holds {held} bytes. Growing now would free memory that "
                "captured CUDA graphs still use; warm this shape up before capture instead."
            )
        if self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise WorkspaceLockedError(
                f"workspace growth during CUDA graph capture: {caller} asked for {nbytes} bytes "
                f"but it holds {held} bytes; this shape was not warmed up"
            )
        return caller

    def _grow(self, nbytes: int) -> None:
        caller = self._check_growth(nbytes, self.size, _caller())
        new_size = -(-nbytes // _GROWTH_GRANULE) * _GROWTH_GRANULE
        self.stats.growths.append(Growth(self.stage, self.size, new_size, caller))
        # The old buffer is dropped here: any raw pointer into it (a captured
        # graph) is now dangling. That is exactly what the lock prevents.
        raw = torch.empty(new_size + ALIGNMENT, dtype=torch.uint8, device=self.device)
        # The allocation may not start on a 256-byte boundary (CPU allocators
        # align less than CUDA's); the arena starts at the first one inside it.
        base = -raw.data_ptr() % ALIGNMENT
        self.buffer = raw[base : base + new_size]
        self.stats.size_bytes = new_size


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n
