"""Counts Triton JIT compilations in this process.

Owns one process-wide counter fed by Triton's post-compile hook. The engine
reads it at READY and later: a kernel compiled after startup is a cold-start
bug (a shape class that warmup missed), visible as `jit_compiles_after_ready`.
Never changes what Triton compiles; it only counts.
"""

from __future__ import annotations

from typing import Any

_count = 0
_installed = False
_names: list[str] = []  # what compiled, in order (Triton's repr: kernel and specialization)


def _on_compile(*args: Any, **kwargs: Any) -> None:
    global _count
    _count += 1
    _names.append(str(kwargs.get("repr") or getattr(kwargs.get("fn"), "name", "?")))


def install() -> bool:
    """Hook into Triton (idempotent). Returns False when Triton or its hook
    API is unavailable, in which case the count stays 0."""
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
    _installed = True
    return True


def num_compiles() -> int:
    return _count


def compiled_since(count: int) -> list[str]:
    """The kernels compiled after the count was `count` (for error messages)."""
    return _names[count:]
