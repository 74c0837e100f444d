"""Compile ahead: Triton kernels compiled in parallel threads before the
forwards that need them run.

Triton compiles a kernel variant at its first launch, on the launching
thread, so a startup on an empty Triton cache meets its ~16 variants one
after another, ~1 s each. Inside an `AheadCompiles`' `dry()` block a Triton
launch does not run: it becomes Triton's compile-only launch
(`warmup=True`) on a thread pool, and `finish()` waits for every compile;
in between, the caller may do other work while the pool compiles. Each compiled
variant lands in the kernel's in-process cache (and Triton's on-disk one),
where the real launches of the same shapes find it.

Because no Triton kernel runs inside the block, every tensor one would have
written keeps whatever it held: what the block computes is garbage. So only
forwards that are made for their shapes run there (the startup's dummy
shape runs, worker/precompile.py), and their host code must never depend on
device values, nor index with a Triton kernel's integer output in a torch
op (a garbage index would trip a device-side assert). Torch ops still run,
on garbage floats, which is harmless. Compiles that fail are ignored here:
the real launch compiles again and raises where it always would.

Threads alone overlap only what the compiler does outside the GIL (ptxas,
parts of the MLIR and LLVM stages): Triton's Python front end and the rest
hold it, so on a many-core host a pool of threads gets through ~25 variants
no faster than ~5-8 s. So where the OS can fork, each pool thread compiles
its variant in a forked child of this process (`_forked`): the child
inherits every imported module and the kernel's source, compiles into
Triton's on-disk cache with a GIL of its own, and exits; the thread then
makes the same compile call, which finds the binary there. A child never
touches CUDA (Triton compiles for an explicit target; the child exits with
os._exit, running no destructors), so forking a process that holds a CUDA
context is safe for it. A child that fails, or has not finished in
`CHILD_TIMEOUT_S`, costs only time: the thread's own call then compiles
(and fails) as it would have without the fork.

Owns the interception (one patch of JITFunction.run, undone when the dry
block ends; Gluon kernels inherit it), the pool and the forked compiles.
Launches are deduplicated by what Triton's default specialization looks at
(`_variant_key`), so launches that differ only in an integer's value share
a compile. A variant the key misses (a kernel's own specialization rules)
compiles at its real launch, as it would have without this block.
"""

from __future__ import annotations

import gc
import os
import select
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

import torch

from tinyengine.kernels import jit_monitor

# A compile's child past this is killed and the compile runs on its thread
# (the largest kernels compile in ~5 s on one core).
CHILD_TIMEOUT_S = 120.0
_fork_lock = threading.Lock()


class AheadCompiles:
    """A pool of compiles fed by `dry()` blocks and waited for by `finish()`.

    Between the two the compiles run in the background (their forked
    children hold no GIL of this process), so a caller can do other work
    meanwhile: the startup reads the weights (worker/stages.py)."""

    def __init__(self, threads: int) -> None:
        from triton.compiler import compile as triton_compile

        self._triton_compile = triton_compile
        # The kernels whose compile call goes through a child, and their own.
        self._fork = hasattr(os, "fork") and not _always_compile()
        self._forked: dict[Any, Callable] = {}
        self._device = torch.cuda.current_device()
        self._seen: set[tuple] = set()
        self.futures: list[Future] = []
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="triton-compile")

    @contextmanager
    def dry(self) -> Iterator[list[Future]]:
        """Inside, this thread's Triton launches become compiles handed to
        the pool (module docstring); yields the list of their futures."""
        from triton.runtime.jit import JITFunction

        launch = JITFunction.run
        owner = threading.get_ident()
        device = self._device

        def compile_variant(fn: Any, args: tuple, grid: Any, kwargs: dict) -> Any:
            torch.cuda.set_device(device)  # Triton reads the thread's current device
            kernel = launch(fn, *args, grid=grid, warmup=True, **kwargs)
            # What Triton otherwise does at the variant's first real launch, on
            # the launching thread: load the binary onto the device and make its
            # host launcher (before Triton 3.9 a small C module per argument
            # signature, built by the system's C compiler on a cache miss).
            init_handles = getattr(kernel, "_init_handles", None)
            if init_handles is not None:
                init_handles()
            return kernel

        def run(fn: Any, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> Any:
            if threading.get_ident() != owner:  # the pool's own compile-only launches
                return launch(fn, *args, grid=grid, warmup=warmup, **kwargs)
            key = _variant_key(fn, args, kwargs)
            if key not in self._seen:
                self._seen.add(key)
                # The kernel's per-device cache is made on first use: made here,
                # once, not by two compile threads racing, each filling its own.
                caches = getattr(fn, "device_caches", None)
                if caches is not None:
                    caches[device]
                compile_fn = getattr(fn, "compile", None)
                if self._fork and fn not in self._forked and compile_fn is self._triton_compile:
                    self._forked[fn] = compile_fn
                    fn.compile = _forked(compile_fn)
                self.futures.append(self._pool.submit(compile_variant, fn, args, grid, kwargs))
            return None

        JITFunction.run = run
        try:
            yield self.futures
        finally:
            JITFunction.run = launch

    def finish(self) -> int:
        """Wait for every compile handed over; how many there were."""
        self._close(cancel=False)
        return len(self.futures)

    def cancel(self) -> None:
        """Drop the compiles not yet started and wait for the running ones
        (a startup that failed meanwhile)."""
        self._close(cancel=True)

    def _close(self, cancel: bool) -> None:
        self._pool.shutdown(wait=True, cancel_futures=cancel)  # waits for all not cancelled
        for fn, compile_fn in self._forked.items():
            fn.compile = compile_fn
        self._forked.clear()


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


def _always_compile() -> bool:
    """Triton set to compile on every call (TRITON_ALWAYS_COMPILE): a
    child's binary would not be reused, so nothing is forked."""
    from triton import knobs

    return bool(getattr(getattr(knobs, "compilation", None), "always_compile", False))


def _forked(compile_fn: Callable) -> Callable:
    """compile_fn, first run in a forked child (module docstring)."""

    def compile_forked(*args: Any, **kwargs: Any) -> Any:
        if _cached(*args, **kwargs):  # a warm start: nothing to compile, nothing to fork
            return compile_fn(*args, **kwargs)
        # The child's compile seconds (jit_monitor's count) come back through a pipe.
        seconds_r, seconds_w = os.pipe()
        with _fork_lock, warnings.catch_warnings():
            # Python warns that a child of a threaded process may deadlock;
            # the child runs only the compiler, and a stuck one is killed.
            warnings.simplefilter("ignore", DeprecationWarning)
            pid = os.fork()
        if pid == 0:
            code = 1
            try:
                os.close(seconds_r)
                gc.disable()  # collecting the parent's objects could free CUDA memory
                before = jit_monitor.compile_seconds()
                compile_fn(*args, **kwargs)
                os.write(seconds_w, repr(jit_monitor.compile_seconds() - before).encode())
                code = 0
            finally:
                os._exit(code)
        os.close(seconds_w)
        try:
            _reap(pid, CHILD_TIMEOUT_S)
            reported = os.read(seconds_r, 64)
        finally:
            os.close(seconds_r)
        if reported:
            jit_monitor.add_compile_seconds(float(reported))
        return compile_fn(*args, **kwargs)

    return compile_forked


def _cached(*args: Any, **kwargs: Any) -> bool:
    """Whether Triton's on-disk cache already holds the compile that
    triton.compile(*args, **kwargs) would make, looked up as it looks it up
    (its cache key and file group). Computing the key also fills the
    compiler's per-process caches (the backend's hash, ptxas's version)
    before any fork, so no child recomputes them. Any failure (other
    arguments, another Triton's internals) answers False: the variant is
    then compiled in a child, which finds it cached if it was."""
    try:
        return _cache_lookup(*args, **kwargs)
    except Exception:
        return False


def _cache_lookup(src: Any, target: Any = None, options: Any = None, _env_vars: Any = None) -> bool:
    import hashlib

    from triton.compiler.compiler import (
        get_cache_invalidating_env_vars,
        get_cache_key,
        make_backend,
    )
    from triton.runtime.cache import get_cache_manager

    backend = make_backend(target)
    opts = backend.parse_options(dict(options or {}, **src.parse_options()))
    env = get_cache_invalidating_env_vars() if _env_vars is None else _env_vars
    digest = hashlib.sha256(get_cache_key(src, backend, opts, env_vars=env).encode()).hexdigest()
    return get_cache_manager(digest).get_group(f"{src.name[:150]}.json") is not None


def _reap(pid: int, timeout_s: float) -> None:
    """Wait for child pid, killing it past timeout_s. The wait blocks on a
    pidfd where the OS has them: a thread polling instead would take the
    GIL hundreds of times a second from the threads reading the weights."""
    try:
        pidfd = os.pidfd_open(pid)
    except (AttributeError, OSError):
        pidfd = None
    if pidfd is not None:
        try:
            exited, _, _ = select.select([pidfd], [], [], timeout_s)
        finally:
            os.close(pidfd)
        if not exited:
            os.kill(pid, 9)
        os.waitpid(pid, 0)
        return
    deadline = time.monotonic() + timeout_s
    while os.waitpid(pid, os.WNOHANG) == (0, 0):
        if time.monotonic() > deadline:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            return
        time.sleep(0.002)
