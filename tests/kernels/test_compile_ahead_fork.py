"""Forked compiles (kernels/compile_ahead.py's `_forked`): a compile runs
first in a forked child, then on the calling thread, where Triton finds the
child's binary in its on-disk cache.

On the CPU: the order of the two calls and their processes, a child that
fails or hangs (the thread's own call still runs and decides), and a real
Triton compile for an sm_90 target whose second call is a cache hit.
"""

from __future__ import annotations

import os
import time

import pytest

import tinyengine.kernels.compile_ahead as ca

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="forked compiles need os.fork")


def test_the_child_runs_first_then_the_caller(tmp_path):
    log = tmp_path / "calls"

    def compile_fn(tag, *, flag):
        with open(log, "a") as f:
            f.write(f"{os.getpid()} {tag} {flag}\n")
        return tag * 2

    assert ca._forked(compile_fn)("ab", flag=1) == "abab"
    calls = [line.split() for line in log.read_text().splitlines()]
    assert [c[1:] for c in calls] == [["ab", "1"], ["ab", "1"]]
    assert calls[0][0] != str(os.getpid()) and calls[1][0] == str(os.getpid())


def test_a_failing_child_leaves_the_outcome_to_the_caller(tmp_path):
    parent = os.getpid()

    def compile_fn():
        if os.getpid() != parent:
            raise RuntimeError("child fails")
        return "compiled here"

    assert ca._forked(compile_fn)() == "compiled here"

    def always_fails():
        raise ValueError("bad kernel")

    with pytest.raises(ValueError, match="bad kernel"):
        ca._forked(always_fails)()


def test_a_stuck_child_is_killed(monkeypatch):
    monkeypatch.setattr(ca, "CHILD_TIMEOUT_S", 0.3)
    parent = os.getpid()

    def compile_fn():
        if os.getpid() != parent:
            time.sleep(60)
        return "done"

    start = time.monotonic()
    assert ca._forked(compile_fn)() == "done"
    assert time.monotonic() - start < 10


def test_a_triton_compile_in_the_child_is_a_cache_hit_for_the_caller(tmp_path, monkeypatch):
    triton = pytest.importorskip("triton")
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "cache"))
    if hasattr(triton, "knobs"):
        monkeypatch.setattr(triton.knobs.cache, "dir", str(tmp_path / "cache"), raising=False)

    from triton.runtime.jit import JITFunction

    def _scale(x_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=offs < n) * 2, mask=offs < n)

    # A compiled JITFunction even where the CPU tests run Triton's interpreter.
    signature = {"x_ptr": "*fp32", "n": "i32", "BLOCK": "constexpr"}
    src = ASTSource(JITFunction(_scale), signature=signature, constexprs={(2,): 128})
    target = GPUTarget("cuda", 90, 32)
    stages = []
    real = triton.compiler.compiler.make_backend

    def counting_backend(t):  # the caller's stages, if it ran any
        backend = real(t)
        add = backend.add_stages

        def add_stages(st, options, *rest):
            add(st, options, *rest)
            for name, fn in list(st.items()):
                st[name] = lambda m, md, fn=fn, name=name: (stages.append(name), fn(m, md))[1]

        backend.add_stages = add_stages
        return backend

    monkeypatch.setattr(triton.compiler.compiler, "make_backend", counting_backend)
    kernel = ca._forked(triton.compile)(src, target=target, options={"num_warps": 4})
    assert "cubin" in kernel.asm and stages == []  # compiled by the child only
    assert any((tmp_path / "cache").rglob("*.cubin"))
