"""tinyengine/kernels/device_fn.py: a helper declared with @device_fn computes what the
same helper under @triton.jit computes, and under the CPU interpreter it does
not re-patch triton.language on every call (the kernel launch patches once)."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from tinyengine.kernels.device_fn import device_fn

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@device_fn
def _twice_plus(x, y):
    return 2 * x + y


@triton.jit
def _twice_plus_jit(x, y):
    return 2 * x + y


@triton.jit
def _apply_kernel(x_ptr, out_ptr, n, STEPS: tl.constexpr, USE_DEVICE_FN: tl.constexpr):
    offs = tl.arange(0, 16)
    ok = offs < n
    x = tl.load(x_ptr + offs, mask=ok, other=0.0)
    acc = x
    for _ in tl.static_range(STEPS):
        if USE_DEVICE_FN:
            acc = _twice_plus(acc, x)
        else:
            acc = _twice_plus_jit(acc, x)
    tl.store(out_ptr + offs, acc, mask=ok)


def _run(use_device_fn: bool) -> torch.Tensor:
    x = torch.arange(10, dtype=torch.float32, device=DEVICE) / 7
    out = torch.empty_like(x)
    _apply_kernel[(1,)](x, out, 10, STEPS=5, USE_DEVICE_FN=use_device_fn)
    return out


def test_same_result_as_triton_jit() -> None:
    expected = torch.arange(10, dtype=torch.float32) / 7 * 63  # acc <- 2 acc + x, five times
    assert torch.allclose(_run(True).cpu(), expected)
    assert torch.equal(_run(True), _run(False))


@pytest.mark.skipif(DEVICE == "cuda", reason="interpreter behaviour; the GPU compiles")
def test_interpreter_patches_once_per_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    from triton.runtime import interpreter

    calls = []
    real = interpreter._patch_lang

    def counting(fn):
        calls.append(fn.__name__)
        return real(fn)

    monkeypatch.setattr(interpreter, "_patch_lang", counting)
    _run(True)
    assert calls == ["_apply_kernel"]  # the launch only, not the five helper calls
    calls.clear()
    _run(False)
    assert calls.count("_twice_plus_jit") == 5  # what @triton.jit helpers cost
