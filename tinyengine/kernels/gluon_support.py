"""What the Gluon kernels (kernels/mla/gluon.py, kernels/sparse_attention/gluon.py)
import from Triton's experimental Gluon dialect, under one name whichever
Triton is installed, and when they may run at all.

Gluon ships with Triton >= 3.4 and is experimental: a few names moved
between the releases these kernels were written against (3.6 and 3.9), and
without Gluon (`HAVE_GLUON` False) every caller runs its Triton kernel.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

import torch
import triton
from triton.compiler.errors import CompilationError

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_init,
        warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    # Renamed after Triton 3.6 (same arguments): the TMA load
    # (async_copy_global_to_shared -> async_load), the cp.async gather
    # (the same rename) and the CTA barrier (thread_barrier -> barrier).
    tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
    cp_async_load = (
        getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared
    )
    cta_barrier = getattr(gl, "thread_barrier", None) or gl.barrier
    HAVE_GLUON = True
except ImportError:  # pragma: no cover - depends on the installed Triton
    HAVE_GLUON = False

__all__ = [
    "HAVE_GLUON", "GluonUnavailable", "TensorDescriptor", "async_copy", "cp_async_load",
    "cta_barrier", "fence_async_shared", "gl", "gluon", "is_hopper", "launch_or_give_up",
    "mbarrier", "tma_load", "warpgroup_mma", "warpgroup_mma_init",
    "warpgroup_mma_wait",
]  # fmt: skip

logger = logging.getLogger(__name__)


@functools.cache
def is_hopper(device_index: int | None) -> bool:
    """sm_90: the only architecture the Gluon kernels were written for."""
    return torch.cuda.get_device_capability(device_index)[0] == 9


class GluonUnavailable(RuntimeError):
    """This Triton could not compile a Gluon kernel (its Gluon API differs from
    the ones the kernels were written against); the caller runs its Triton
    kernel instead, and the kernel's `supports` says False from now on."""


def launch_or_give_up(launch: Callable[[], None], what: str, failed: list[str]) -> None:
    """Run `launch`, one Gluon kernel's launch. A compile error (compiles
    happen at warmup, before any graph capture) is recorded in `failed`, the
    kernel's own list, which its `supports` reads; logged; and raised as
    GluonUnavailable. A compile error is the front end's CompilationError or
    a failed MLIR pass pipeline further down (a RuntimeError naming the
    PassManager); any other error, a CUDA fault included, propagates."""
    try:
        launch()
    except (CompilationError, RuntimeError) as err:
        if not isinstance(err, CompilationError) and "PassManager" not in str(err):
            raise
        failed.append(str(err).splitlines()[-1] if str(err) else type(err).__name__)
        logger.warning(
            "the Gluon %s kernel does not compile with triton %s (%s); "
            "running the Triton kernel instead", what, triton.__version__, failed[0],
        )  # fmt: skip
        raise GluonUnavailable(failed[0]) from err
