"""The skinny GEMM's split over K (gemv/kernel.py's HAS_SPLIT): how a launch
splits and where its scratch comes from (`split_k_plan`, host side), and how
a tile's slices meet (`sum_slices`, in the kernel).

When a DOT config asks for `split_k` slices and a workspace is given, each
program (p, s) sums slice s of output tile p's K into an fp32 partial in the
workspace's arena and takes a ticket on tile p (the workspace's persistent
counters, which must read 0 between kernels); the program that takes the
last ticket adds the partials in slice order -- so the sum does not depend
on which program finished last -- and resets the ticket to 0. Tickets and
partials are touched only after the kernel's PDL wait.

Must never allocate outside the workspace, and never grow it while a graph
is being captured (the arena raises; this lets it).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tinyengine.kernels.device_fn import device_fn
from tinyengine.kernels.workspace import Workspace, WorkspaceLockedError


def split_k_plan(
    workspace: Workspace | None, split_k: int, k: int, block_k: int, block_m: int,
    block_n: int, tiles: int, unsplit: torch.Tensor,
) -> tuple[int, int, torch.Tensor, torch.Tensor]:  # fmt: skip
    """(slices, K per slice, partials, tickets) of one launch over `tiles`
    output tiles. One slice (`unsplit` as the unused partials and tickets)
    without a workspace, when the config asks for none, or in an eager step
    whose split would outgrow a locked arena: after the lock nothing is
    captured any more, and one program per tile needs no scratch."""
    if workspace is None or split_k <= 1:
        return 1, k, unsplit, unsplit
    k_split = triton.cdiv(triton.cdiv(k, split_k), block_k) * block_k
    split = triton.cdiv(k, k_split)
    if split == 1:
        return 1, k, unsplit, unsplit
    try:
        parts = workspace.get(((split * tiles * block_m * block_n,), torch.float32))[0]
        return split, k_split, parts, workspace.tickets(tiles)
    except WorkspaceLockedError:
        if not workspace.locked:
            raise  # growth during a capture: this shape was not warmed up
        return 1, k, unsplit, unsplit


@device_fn
def sum_slices(res, part_ptr, ticket_ptr, tile, SPLIT_K, BLOCK_M: tl.constexpr,
               BLOCK_N: tl.constexpr):  # fmt: skip
    """(the tile's sum over every slice, whether this program took the last
    ticket) after this program's slice `res` [BLOCK_M, BLOCK_N] (fp32); only
    the last program's sum is complete, the others must stop."""
    offs = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
    tiles = tl.num_programs(0)
    tl.store(part_ptr + (tl.program_id(1) * tiles + tile) * (BLOCK_M * BLOCK_N) + offs, res)
    tl.debug_barrier()  # every thread's partial is stored before the ticket
    last = tl.atomic_add(ticket_ptr + tile, 1, sem="acq_rel") == SPLIT_K - 1
    if last:
        res = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for s in range(SPLIT_K):
            res += tl.load(
                part_ptr + (s * tiles + tile) * (BLOCK_M * BLOCK_N) + offs, cache_modifier=".cg"
            )
        tl.store(ticket_ptr + tile, 0)
    return res, last
