"""Programmatic dependent launch, checked without a GPU: a kernel launched
with PDL may start while the kernel before it still runs, so it must wait
(gdc_wait) before it reads what that kernel wrote or stores anything
(kernels/launch.py). A kernel that takes USE_PDL and forgets the wait races
its predecessor, and on a GPU that shows only now and then.

Two checks on the CPU: every Triton kernel of the package with a USE_PDL
parameter calls gdc_wait and then gdc_launch_dependents; and the decode
split kernel (it reads the query and the newest K/V row the RoPE + cache
write kernel before it writes, and older rows before its wait), compiled
for sm_90, loads before its wait and stores only after it.
"""

from __future__ import annotations

import importlib
import inspect
import os
import pkgutil
import subprocess
import sys

import pytest

triton = pytest.importorskip("triton")

from triton.runtime.jit import KernelInterface  # noqa: E402

import tinyengine.kernels as kernels_pkg  # noqa: E402
from tinyengine.kernels import gdc  # noqa: E402


def _pdl_kernels() -> dict[str, object]:
    """Every Triton kernel of tinyengine.kernels with a USE_PDL parameter
    (a JITFunction, or under the interpreter its InterpretedFunction)."""
    found = {}
    for info in pkgutil.walk_packages(kernels_pkg.__path__, prefix="tinyengine.kernels."):
        try:
            module = importlib.import_module(info.name)
        except ImportError:  # an optional dependency (Gluon) this Triton lacks
            continue
        for name, obj in vars(module).items():
            if isinstance(obj, KernelInterface) and "USE_PDL" in getattr(obj, "arg_names", ()):
                found[f"{obj.fn.__module__}.{name}"] = obj
    return found


def test_every_pdl_kernel_waits_then_lets_the_next_start() -> None:
    kernels = _pdl_kernels()
    # The decode step's kernels (norm, skinny GEMM, RoPE + cache write,
    # split-KV split and reduce) at least.
    assert len(kernels) >= 5, sorted(kernels)
    for name, kernel in kernels.items():
        src = inspect.getsource(kernel.fn)
        wait, launch = src.find("gdc_wait()"), src.find("gdc_launch_dependents()")
        assert wait >= 0, f"{name} takes USE_PDL but never calls gdc_wait()"
        assert launch > wait, f"{name}: gdc_launch_dependents() must follow gdc_wait()"


# Compiled in a process of its own: the test session runs Triton's
# interpreter (TRITON_INTERPRET=1 from conftest.py), which compiles nothing.
_COMPILE_SPLIT_KERNEL = """
import re, triton
from triton.backends.compiler import GPUTarget
from tinyengine.kernels.attention.kernels import _decode_split_kernel as kernel
pointers = {
    "q_ptr": "*bf16", "k_cache_ptr": "*bf16", "v_cache_ptr": "*bf16", "out_ptr": "*bf16",
    "part_out_ptr": "*fp32", "part_lse_ptr": "*fp32", "block_tables_ptr": "*i32",
    "query_start_loc_ptr": "*i32", "seq_lens_ptr": "*i32",
}
constexprs = {
    "GROUP": 2, "BLOCK_G": 16, "BLOCK_N": 32, "BLOCK_SIZE": 16, "HEAD_DIM_K": 128,
    "HEAD_DIM_V": 128, "BLOCK_DK": 128, "BLOCK_DV": 128, "DIRECT": False, "UPCAST": False,
    "OFFS_32": True, "DOT_PRECISION": "tf32", "USE_PDL": True, "EARLY_K": True,
}
signature = {
    a: pointers.get(a) or ("constexpr" if a in constexprs else "fp32" if a == "qk_scale" else "i32")
    for a in kernel.arg_names
}
src = triton.compiler.ASTSource(kernel, signature, constexprs)
ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32)).asm["ptx"]
load, store = (re.search(rf"\\b{op}\\.global", ptx) for op in ("ld", "st"))
print(ptx.find("griddepcontrol.wait"), load.start() if load else -1, store.start() if store else -1)
"""


@pytest.mark.skipif(not gdc.AVAILABLE, reason="this Triton has no grid dependency control")
def test_decode_split_kernel_loads_early_and_stores_after_its_wait() -> None:
    # Which rows it may read before the wait is checked by running it
    # (test_triton_attention_decode.py: the newest row and the query written
    # only at the wait); here, that the sm_90 build does load early (the
    # indices and the first tile, the point of the early reads) and stores
    # nothing before it.
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", _COMPILE_SPLIT_KERNEL], env=env,
                         capture_output=True, text=True, timeout=300)  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    wait, first_load, first_store = map(int, run.stdout.split()[-3:])
    assert wait >= 0, "no griddepcontrol.wait in the PDL split kernel"
    assert 0 <= first_load < wait, "the split kernel no longer loads anything before its wait"
    assert first_store > wait, "the split kernel stores before its wait"
