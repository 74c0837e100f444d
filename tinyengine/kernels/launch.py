"""What every Triton launcher needs, in one place: whether the Triton
interpreter runs the kernels, the device's SM count, and the matmul precision
and log2 constant that the attention, MLA and MoE kernels share.

Also owns whether kernels launch with programmatic dependent launch
(`programmatic_launch`), and the reading of TRITON_INTERPRET inside the
engine (nothing else in tinyengine/kernels reads it). Must never import
triton itself: the op-set chooser imports this module before it decides
whether triton may be loaded.
"""

from __future__ import annotations

import functools
import os

import torch

LOG2E = 1.4426950408889634  # scores live in the log2 domain: exp2 replaces exp


def interpreting() -> bool:
    """Whether Triton kernels run under the interpreter (CPU CI): bf16 tiles
    must then be upcast (the interpreter's bf16 math is wrong) and no
    libdevice fast math is available."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@functools.lru_cache(maxsize=16)
def num_sms(device: torch.device, *, off_gpu: int) -> int:
    """The device's SM count; `off_gpu` where there is no GPU (the
    interpreter). Each launcher picks its own: grid heuristics that should
    choose as on a 132-SM GPU (an H200) pass 132, those that only split work pass 1 (the
    interpreter runs programs one by one, so splitting only adds work)."""
    if device.type != "cuda":
        return off_gpu
    return torch.cuda.get_device_properties(device).multi_processor_count


# Programmatic dependent launch (PDL) for the kernels of a decode step.
# Module state, not an EngineConfig field: it changes no result, only how
# kernels overlap; tests and benchmarks flip it to compare the two.
PDL_ENABLED = True


@functools.lru_cache(maxsize=16)
def _pdl_capable(device: torch.device) -> bool:
    return torch.cuda.get_device_capability(device)[0] >= 9


def programmatic_launch(device: torch.device) -> bool:
    """Launch with programmatic dependent launch on `device`? Hopper and
    newer GPUs let a kernel launched this way start while the kernel before
    it on the stream still runs (CUDA graphs keep the overlap as a
    programmatic edge). A kernel launched so must call `gdc_wait()` in every
    program before it reads anything an earlier kernel wrote or stores
    anything (what it does before that wait may only read data no kernel of
    the step writes: weights), and calls `gdc_launch_dependents()` after the
    wait so the next kernel can start early (after, not before: a chain of
    early starts would fill the SMs with waiting programs). Off under the
    interpreter, before Hopper and before Triton 3.4 (kernels/gdc.py)."""
    return (
        PDL_ENABLED
        and device.type == "cuda"
        and not interpreting()
        and _gdc_available()
        and _pdl_capable(device)
    )


def pdl_kwargs(device: torch.device) -> dict[str, bool]:
    """The launch keywords of a kernel with a USE_PDL constexpr: both on
    under `programmatic_launch`, else none (the constexpr defaults to off,
    and a Triton without PDL refuses a `launch_pdl` keyword)."""
    return {"USE_PDL": True, "launch_pdl": True} if programmatic_launch(device) else {}


@functools.cache  # asked at every launch; fixed for the process
def _gdc_available() -> bool:
    from tinyengine.kernels import gdc  # imports triton: only past the checks above

    return gdc.AVAILABLE


def dot_precision(dtype: torch.dtype) -> str:
    """tl.dot's input_precision for tiles of `dtype` (the DOT_PRECISION
    constexpr of the attention, MLA and MoE kernels). fp32 tiles multiply in
    3xTF32 (about fp32's accuracy, like torch's fp32 matmul) instead of
    Triton's default single TF32 pass, whose 10-bit mantissa puts an fp32
    model's prompt log-probs ~2e-3 off HF's; for bf16/fp16 tiles the setting
    means nothing ("tf32", the default). The interpreter ignores it (numpy
    matmul)."""
    return "tf32x3" if dtype == torch.float32 else "tf32"
