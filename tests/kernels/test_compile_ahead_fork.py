"""Forked compiles (kernels/compile_ahead.py's `_forked`): a compile runs
first in a forked child, then on the calling thread, where Triton finds the
child's binary in its on-disk cache.

On the CPU: the order of the two calls and their processes, a child that
fails or hangs (the thread's own call still runs and decides), and a real
Triton compile for an sm_90 target whose second call is a cache hit.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

import tinyengine.kernels.compile_ahead as ca

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="forked compiles need os.fork")


def test_the_child_runs_first_then_the_caller(tmp_path):
    """And the seconds the child's compile added to jit_monitor's count
    (Triton's listener there) are added to this process's count."""
    from tinyengine.kernels import jit_monitor

    log = tmp_path / "calls"
    parent = os.getpid()

    def compile_fn(tag, *, flag):
        with open(log, "a") as f:
            f.write(f"{os.getpid()} {tag} {flag}\n")
        if os.getpid() != parent:
            jit_monitor.add_compile_seconds(1.25)
        return tag * 2

    before = jit_monitor.compile_seconds()
    assert ca._forked(compile_fn)("ab", flag=1) == "abab"
    assert jit_monitor.compile_seconds() - before == pytest.approx(1.25)
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


def test_an_unreadable_compile_is_not_taken_for_cached():
    assert not ca._cached(object(), target=None, options={})


@pytest.mark.parametrize("pidfd", [True, False], ids=["pidfd", "polling"])
def test_a_stuck_child_is_killed(monkeypatch, pidfd):
    monkeypatch.setattr(ca, "CHILD_TIMEOUT_S", 0.3)
    if not pidfd:  # an OS without pidfds: the wait polls
        monkeypatch.delattr(os, "pidfd_open", raising=False)
    parent = os.getpid()

    def compile_fn():
        if os.getpid() != parent:
            time.sleep(60)
        return "done"

    start = time.monotonic()
    assert ca._forked(compile_fn)() == "done"
    assert time.monotonic() - start < 10


_CHILD_COMPILE = """
import os

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction

import tinyengine.kernels.compile_ahead as ca


def _scale(x_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=offs < n) * 2, mask=offs < n)


signature = {"x_ptr": "*fp32", "n": "i32", "BLOCK": "constexpr"}
src = ASTSource(JITFunction(_scale), signature=signature, constexprs={(2,): 128})
stages = []
real = triton.compiler.compiler.make_backend


def counting_backend(target):  # records the stages this process runs
    backend = real(target)
    add = backend.add_stages

    def add_stages(st, options, *rest):
        add(st, options, *rest)
        for name, fn in list(st.items()):
            st[name] = lambda m, md, fn=fn, name=name: (stages.append(name), fn(m, md))[1]

    backend.add_stages = add_stages
    return backend


triton.compiler.compiler.make_backend = counting_backend
forks = []
real_fork = os.fork


def counting_fork():
    forks.append(1)
    return real_fork()


os.fork = counting_fork
compile_forked = ca._forked(triton.compile)
kernel = compile_forked(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
print("cubin" in kernel.asm, stages, len(forks))
kernel = compile_forked(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
print("cubin" in kernel.asm, stages, len(forks))
"""


def test_a_triton_compile_in_the_child_is_a_cache_hit_for_the_caller(tmp_path):
    """A real compile for an sm_90 target (no GPU needed): the child runs
    every stage, the caller none (a cache hit), and the caller gets the
    binary; a second call finds it cached and forks nothing. In a fresh
    process: the CPU tests' Triton interpreter patches triton.language,
    which a real compile in this one would meet."""
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "cache")
    script = tmp_path / "child_compile.py"  # Triton reads a kernel's source from its file
    script.write_text(_CHILD_COMPILE)
    run = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True,
                         timeout=300, cwd=os.getcwd())  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    # The first call compiles in its one child; the second finds the
    # binary cached before forking, so it forks no child.
    assert run.stdout.split() == ["True", "[]", "1", "True", "[]", "1"], run.stdout
    assert any((tmp_path / "cache").rglob("*.cubin"))
