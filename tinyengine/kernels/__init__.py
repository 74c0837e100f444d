"""Pure tensor ops, one folder per op, each with a torch reference and a Triton
implementation of the same signature side by side (tests compare them):

    attention/   paged attention and the KV-cache write
    mla/         MLA decode over a paged latent cache
    moe/         fused mixture-of-experts
    norm/        RMSNorm, plain and fused with the residual add
    activation/  SiLU-and-mul (its own folder: the model calls it after any
                 linear, not only after a GEMV; the GEMV's fused epilogue in
                 gemv/silu.py reuses its numbers instead of owning them)
    rope/        the Llama-family rope + cache-write prologue, standalone RoPE
    gemv/        linear layers at decode shapes (the skinny GEMM)
    sampling/    the sampler's one-pass Gumbel-max draw
    workspace/   the scratch arena every op draws temporary memory from

Shared by the launchers: launch.py (interpreter detection, SM count, matmul
precision), device_fn.py, tma.py, split_reduce.py (the merge of split-KV
partials, MLA's and V4 sparse attention's). For startup: jit_monitor.py
counts compiles, compile_ahead.py compiles a startup's variants in
parallel, compiler_key.py hashes Triton's compiler key in a child process.
opset.py is the one place that decides which implementation runs (`OpSet`,
chosen once per engine from EngineConfig and carried by the forward context).

Must never import anything above tinyengine.kernels (models, worker, ...), and
must not import triton at package import time.
"""

import os

# Triton fuses multiplies and adds into FMAs unless told otherwise, and
# announces (3.9) that from 3.10 it will not by default. The kernels' speed
# and their tests' tolerances were set with fusion on, so this process keeps
# it unless the user has chosen with TRITON_DEFAULT_FP_FUSION (read at each
# compile, so this holds whenever triton is imported).
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")

from tinyengine.kernels.opset import BACKENDS, OpSet, choose_ops, torch_ops, triton_ops  # noqa: E402

__all__ = ["BACKENDS", "OpSet", "choose_ops", "torch_ops", "triton_ops"]
