"""Compile ahead: Triton kernels compiled in parallel threads before the
forwards that need them run.

Triton compiles a kernel variant at its first launch, on the launching
thread, so a startup on an empty Triton cache meets its ~16 variants one
after another, ~1 s each. Inside `compile_ahead(threads)` a Triton launch
does not run: it becomes Triton's compile-only launch (`warmup=True`) on a
thread pool, and leaving the block waits for every compile. Triton's
compiler spends most of its time outside the GIL (MLIR passes, LLVM,
ptxas), so the compiles overlap. Each compiled variant lands in the kernel's
in-process cache (and Triton's on-disk one), where the real launches of the
same shapes find it.

Because no Triton kernel runs inside the block, every tensor one would have
written keeps whatever it held: what the block computes is garbage. So only
forwards that are made for their shapes run there (the startup's dummy shape
runs, worker/precompile.py), and their host code must never depend on device
values, nor index with a Triton kernel's integer output in a torch op (a
garbage index would trip a device-side assert). Torch ops still run, on
garbage floats, which is harmless. Compiles that fail are ignored here: the
real launch compiles again and raises where it always would.

Owns the interception (one patch of JITFunction.run, undone on exit; Gluon
kernels inherit it) and the pool. Launches are deduplicated by what Triton's
default specialization looks at (`_variant_key`), so launches that differ
only in an integer's value share a compile. A variant the key misses (a
kernel's own specialization rules) compiles at its real launch, as it would
have without this block.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor, wait
from contextlib import contextmanager
from typing import Any

import torch


@contextmanager
def compile_ahead(threads: int) -> Iterator[list[Future]]:
    """Turn this thread's Triton launches into parallel compiles (module
    docstring); yields the list of compile futures, complete on exit."""
    from triton.runtime.jit import JITFunction

    launch = JITFunction.run
    owner = threading.get_ident()
    device = torch.cuda.current_device()
    seen: set[tuple] = set()
    futures: list[Future] = []
    pool = ThreadPoolExecutor(threads, thread_name_prefix="triton-compile")

    def compile_variant(fn: Any, args: tuple, grid: Any, kwargs: dict) -> Any:
        torch.cuda.set_device(device)  # Triton reads the thread's current device
        return launch(fn, *args, grid=grid, warmup=True, **kwargs)

    def run(fn: Any, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> Any:
        if threading.get_ident() != owner:  # the pool's own compile-only launches
            return launch(fn, *args, grid=grid, warmup=warmup, **kwargs)
        key = _variant_key(fn, args, kwargs)
        if key not in seen:
            seen.add(key)
            # The kernel's per-device cache is made on first use: made here,
            # once, not by two compile threads racing, each filling its own.
            caches = getattr(fn, "device_caches", None)
            if caches is not None:
                caches[device]
            futures.append(pool.submit(compile_variant, fn, args, grid, kwargs))
        return None

    JITFunction.run = run
    try:
        yield futures
    finally:
        JITFunction.run = launch
        wait(futures)
        pool.shutdown()


def _variant_key(fn: Any, args: tuple, kwargs: dict) -> tuple:
    """What makes a compiled variant, as Triton specializes by default: the
    kernel; per positional argument, a tensor's dtype and 16-byte alignment
    or an integer's being 1 or a multiple of 16; and every keyword argument
    that is not a tensor (constexprs, warps, stages)."""
    options = tuple(
        (name, value if isinstance(value, (int, float, str, bool, type(None))) else repr(value))
        for name, value in sorted(kwargs.items())
        if not isinstance(value, torch.Tensor)
    )
    return id(fn), tuple(_specialization(a) for a in args), options


def _specialization(arg: Any) -> tuple:
    if isinstance(arg, torch.Tensor):
        return arg.dtype, arg.data_ptr() % 16 == 0
    if isinstance(arg, int) and not isinstance(arg, bool):
        return "int", arg == 1, arg % 16 == 0
    return (arg,) if isinstance(arg, (bool, str, type(None))) else (type(arg).__name__,)
