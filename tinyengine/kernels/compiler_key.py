"""Triton's compiler key, hashed in another process while the engine starts.

Before its first compile, or its first lookup in the on-disk cache, a
process computes `triton.runtime.cache.triton_key()`: a sha256 over
Triton's compiler sources and its 400-500 MB libtriton, ~0.8 s on one core,
cached for the process. Every start pays it once, warm or empty, at the
first kernel variant, where a startup's compiles wait on it.

`start()` (the runner calls it before it imports its kernels, on a GPU with
the Triton ops) runs `triton_key()` in a child Python, and `wait()`
(on a GPU, once load has built the model, worker/precompile.py, before the
dry run's compiles) installs the child's answer as this process's, the way
Triton's own compile pools hand theirs the key. The child overlaps the
runner's setup, the tokenizer and the model's construction. Not a thread:
a thread's hashing takes the GIL back after every 1 MB chunk and crawls while the main
thread runs Python (5.9 s instead of 0.8 s; docs/benchmarks.md). The answer
is installed only from the same Triton files as this process's; a child
that fails, disagrees or is late (`TIMEOUT_S`) installs nothing, and the
first compile then hashes as it always has. A process that has the key
already (an earlier engine) starts no child.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from typing import Any

# Past this the child is killed and the first compile hashes here instead
# (the child needs ~1 s: importing Triton, then the hash).
TIMEOUT_S = 10.0

# The child's script: the Triton it imports and that Triton's key, one per line.
_CHILD = "import triton, triton.runtime.cache as c; print(triton.__file__); print(c.triton_key())"

_lock = threading.Lock()
_child: subprocess.Popen | None = None


def start() -> None:
    """Start hashing in a child process (once per process; idempotent)."""
    global _child
    with _lock:
        if _child is not None or _known():
            return
        try:
            _child = subprocess.Popen(
                [sys.executable, "-c", _CHILD], stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL, text=True,
            )  # fmt: skip
        except OSError:
            _child = None


def wait() -> bool:
    """Install the child's key if it started (waiting for it up to
    TIMEOUT_S); returns whether this process now has a known key."""
    global _child
    with _lock:
        child, _child = _child, None
        if child is None:
            return _known()
        try:
            out, _ = child.communicate(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            child.kill()
            child.communicate()
            return False
        lines = out.splitlines()
        if child.returncode != 0 or len(lines) != 2:
            return False
        return _install(*lines)


def _install(triton_file: str, key: str) -> bool:
    import triton
    import triton.runtime.cache as cache

    if os.path.realpath(triton_file) != os.path.realpath(triton.__file__) or not key:
        return False
    cache.triton_key = _Known(key)
    return True


def _known() -> bool:
    """Whether this process has the key already: installed, or hashed here."""
    cache = sys.modules.get("triton.runtime.cache")
    key = getattr(cache, "triton_key", None)
    if isinstance(key, _Known):
        return True
    cache_info = getattr(key, "cache_info", None)  # Triton's own: an lru_cache
    return cache_info is not None and cache_info().currsize > 0


class _Known:
    """Stands in for triton_key: the same answer, already computed."""

    def __init__(self, key: str) -> None:
        self.key = key

    def __call__(self) -> str:
        return self.key

    def cache_clear(self) -> Any:  # triton_key's lru_cache interface
        return None
