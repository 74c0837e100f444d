"""`device_fn`: the decorator for Triton device functions (helpers a kernel
calls), i.e. `triton.jit`, plus a fix for Triton's CPU interpreter.

Why: under TRITON_INTERPRET=1 (CPU CI), every call of a jitted device function
re-patches triton.language (triton 3.9: `InterpretedFunction.__call__` runs
`_patch_lang` first), milliseconds a call on a CPU, although the kernel's
launch has already patched that very module for its whole run (and restores
it afterwards). Helpers called per tile or per rounding step then dominate:
in the fused RoPE + cache-write kernel about a third of a program's time is
re-patching (docs/benchmarks.md has the figures). Under the interpreter
`device_fn` makes the helper call its rewritten function directly; compiled
(GPU) code is exactly `triton.jit`'s.

Only for device functions: a kernel launch (`kernel[grid](...)`) still goes
through the interpreter's own launch, which does the patching and restoring.
Must never change what a helper computes.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import triton


def device_fn(fn: Callable[..., Any]) -> Any:
    jitted = triton.jit(fn)
    base = type(jitted)
    # Only the interpreter's function type is touched, and only when it still
    # has the hook this relies on (a Triton that changes it gets plain jit).
    if base.__name__ == "InterpretedFunction" and callable(getattr(jitted, "rewrite", None)):
        jitted.__class__ = _interpreted_device_function(base)
    return jitted


@functools.cache
def _interpreted_device_function(base: type) -> type:
    class InterpretedDeviceFunction(base):
        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            # Called from inside a running interpreted kernel, whose launch
            # patched triton.language already.
            return self.rewrite()(*args, **kwargs)

    return InterpretedDeviceFunction
