"""The tensor-parallel group of this process, through torch.distributed.

Owns which rank of how many this process is, and the two collectives the
sharded layers (models/layers.py) call: an all-reduce after a row-parallel
product or the vocab-parallel embedding, an all-gather of the vocab-parallel
logits. One group per process, set once before the model is built
(`init_tp`); without it the group is a single rank and every collective is
the identity, so a one-process engine never touches torch.distributed.

The backend is the process group's: gloo between CPU processes, NCCL between
GPUs. Sharding itself (which rows of a checkpoint tensor a rank keeps) is the
layers' business; `shard` is the one rule they share.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TPGroup:
    """Rank `rank` of `size`; `group` is the torch.distributed group (None for
    a single rank)."""

    rank: int = 0
    size: int = 1
    group: Any = None

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of x over the ranks, in place (x itself at one rank)."""
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """The ranks' x concatenated along `dim`, rank order."""
        if self.size == 1:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x, group=self.group)
        return torch.cat(parts, dim=dim)


_group = TPGroup()


def init_tp(rank: int, size: int, group: Any = None) -> TPGroup:
    """Make (rank, size, group) this process's tensor-parallel group; `group`
    defaults to the default torch.distributed group (already initialized)
    when size > 1."""
    global _group
    if not 0 <= rank < size:
        raise ValueError(f"tensor-parallel rank {rank} is not in [0, {size})")
    if size > 1 and group is None:
        if not dist.is_initialized():
            raise RuntimeError("tensor_parallel_size > 1 needs torch.distributed initialized")
        group = dist.group.WORLD
    _group = TPGroup(rank, size, group)
    return _group


def tp_group() -> TPGroup:
    """This process's tensor-parallel group (a single rank unless init_tp ran)."""
    return _group


def shard(total: int, rank: int, size: int, what: str) -> tuple[int, int]:
    """(start, length) of rank's equal slice of `total` items; `what` names
    them in the error when they do not divide evenly."""
    if total % size:
        raise ValueError(f"{what}={total} is not divisible by tensor_parallel_size={size}")
    length = total // size
    return rank * length, length
