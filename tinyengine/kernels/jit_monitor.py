"""Counts Triton JIT compilations in this process, and the time they take.

Owns process-wide counters fed by two Triton hooks:

  * the JIT's post-compile hook, once per kernel variant this process
    builds or loads (a new specialization: new constexprs, dtypes or
    argument alignments), from Triton's on-disk cache or not. The engine
    reads it at READY and later: a kernel compiled after startup is a
    cold-start bug (a shape class that warmup missed), visible as
    `jit_compiles_after_ready`.
  * the compiler's listener (Triton >= 3.4), once per compile call with
    its duration and whether the on-disk cache had it: the seconds spent
    compiling for real, which is where an empty-cache start goes (also
    what forked compiles report back, `add_compile_seconds`). The startup
    report shows both per stage (worker/startup.py).

Never changes what Triton compiles; it only counts.
"""

from __future__ import annotations

import threading
from typing import Any

# compile_ahead's pool threads compile, and so call both hooks, at once: an
# unguarded `+=` on a module global can lose a count between its read and write.
_lock = threading.Lock()
_count = 0
_installed = False
_names: list[str] = []  # what compiled, in order (Triton's repr: kernel and specialization)
_compile_us = 0  # compiles the on-disk cache did not have, summed, in microseconds (listener)


def _on_compile(*args: Any, **kwargs: Any) -> None:
    global _count
    name = str(kwargs.get("repr") or getattr(kwargs.get("fn"), "name", "?"))
    with _lock:
        _count += 1
        _names.append(name)


def _on_listen(*args: Any, **kwargs: Any) -> None:
    """Triton's compiler listener: (src, metadata, metadata_group, times,
    cache_hit), by keyword in the Triton releases seen so far. A call this
    cannot read is ignored: counting must never break a compile."""
    global _compile_us
    times = kwargs.get("times", args[3] if len(args) > 3 else None)
    cache_hit = kwargs.get("cache_hit", args[4] if len(args) > 4 else True)
    total = getattr(times, "total", None)
    if not cache_hit and isinstance(total, (int, float)):
        with _lock:
            _compile_us += int(total)


def install() -> bool:
    """Hook into Triton (idempotent). Returns False when Triton or its hook
    API is unavailable, in which case the counts stay 0. A Triton without
    the compiler listener still counts variants; its compile time stays 0."""
    global _installed
    if _installed:
        return True
    try:
        from triton import knobs
    except Exception:
        return False
    previous = knobs.runtime.jit_post_compile_hook

    def hook(*args: Any, **kwargs: Any) -> Any:
        _on_compile(*args, **kwargs)
        return previous(*args, **kwargs) if previous is not None else None

    knobs.runtime.jit_post_compile_hook = hook
    compilation = getattr(knobs, "compilation", None)
    if compilation is not None and hasattr(compilation, "listener"):
        previous_listener = compilation.listener

        def listener(*args: Any, **kwargs: Any) -> None:
            _on_listen(*args, **kwargs)
            if previous_listener is not None:
                previous_listener(*args, **kwargs)

        compilation.listener = listener
    _installed = True
    return True


def num_compiles() -> int:
    return _count


def compile_seconds() -> float:
    """Seconds spent compiling what the on-disk cache did not have."""
    return _compile_us / 1e6


def add_compile_seconds(seconds: float) -> None:
    """Count compile time spent in another process for this one (a forked
    compile, kernels/compile_ahead.py, whose binary this process then finds
    in the on-disk cache)."""
    global _compile_us
    with _lock:
        _compile_us += int(seconds * 1e6)


def compiled_since(count: int) -> list[str]:
    """The kernels compiled after the count was `count` (for error messages)."""
    return _names[count:]
