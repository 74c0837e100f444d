"""Run a function on several local gloo ranks (torch.multiprocessing spawn)
and bring rank 0's result back: the harness of the sharding tests.

`work(rank, size, *args)` runs in every rank after the process group and
the tensor-parallel layer state (distributed/tp.py) are set up; it must be
a module-level function (spawn pickles it by name). A rank that raises
writes its traceback beside the result file, and the caller's assertion
error shows every failed rank's.
"""

from __future__ import annotations

import os
import socket
import sys
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tinyengine.distributed.tp import init_tp


def spawn_ranks(work: Callable[..., Any], args: tuple, size: int, tmp_path) -> Any:
    """work's return value on rank 0 (saved with torch.save by that rank)."""
    out = str(tmp_path / f"ranks{size}.pt")
    try:
        mp.spawn(_rank_main, args=(size, free_port(), work, args, out), nprocs=size, join=True)
    except Exception as exc:
        errors = [open(f"{out}.rank{r}.err").read() for r in range(size)
                  if os.path.exists(f"{out}.rank{r}.err")]  # fmt: skip
        raise AssertionError("a rank failed:\n" + "\n".join(errors)) from exc
    return torch.load(out)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, size: int, port: int, work: Callable[..., Any], args: tuple,
               out: str) -> None:  # fmt: skip
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=size)  # fmt: skip
        init_tp(rank, size)
        torch.set_num_threads(1)
        value = work(rank, size, *args)
        if rank == 0:
            torch.save(value, out)
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:
        with open(f"{out}.rank{rank}.err", "w") as f:
            f.write(traceback.format_exc())
        raise
    # The rank's work is done; skip the interpreter's finalization. gloo's
    # worker thread may free a finished collective (the barrier holds the
    # all-gather before it) only after finalization has begun: dropping its
    # tensors' Python objects then needs the GIL, and the thread aborts the
    # process (SIGABRT, "terminate called without an active exception").
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
