"""The Gluon kernels' shared compile-failure path (kernels/gluon_support.py),
on the CPU: a Triton whose Gluon API cannot compile a kernel makes its
launcher raise GluonUnavailable (the op then runs its Triton kernel) and
record the error that kernel's `supports` reads."""

from __future__ import annotations

import pytest

pytest.importorskip("triton.experimental.gluon")

from triton.compiler.errors import CompilationError  # noqa: E402

import tinyengine.kernels.sparse_attention.gluon as sparse_gluon  # noqa: E402
from tinyengine.kernels.gluon_support import GluonUnavailable, launch_or_give_up  # noqa: E402


def _fails(*args, **kwargs):
    raise CompilationError("src", None, "no such layout")


def test_a_compile_error_is_recorded_and_raised():
    failed: list[str] = []
    with pytest.raises(GluonUnavailable, match="no such layout"):
        launch_or_give_up(lambda: _fails(), "test", failed)
    assert len(failed) == 1 and "no such layout" in failed[0]
    launch_or_give_up(lambda: None, "test", failed)  # a launch that works raises nothing


def test_a_failed_pass_pipeline_is_a_compile_error_and_a_fault_is_not():
    failed: list[str] = []

    def pipeline_fails():
        raise RuntimeError("PassManager::run failed")

    def faults():
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    with pytest.raises(GluonUnavailable, match="PassManager"):
        launch_or_give_up(pipeline_fails, "test", failed)
    with pytest.raises(RuntimeError, match="illegal memory access"):
        launch_or_give_up(faults, "test", failed)
    assert failed == ["PassManager::run failed"]


def test_the_sparse_kernel_gives_up_for_good(monkeypatch):
    class Kernel:
        def __getitem__(self, grid):
            return _fails

    monkeypatch.setattr(sparse_gluon, "_sparse_split_gluon", Kernel())
    monkeypatch.setattr(sparse_gluon, "_compile_failed", [])
    with pytest.raises(GluonUnavailable):
        sparse_gluon.launch_split((1, 1, 1), (), {})
    assert sparse_gluon._compile_failed  # what `supports` reads first: False from now on
