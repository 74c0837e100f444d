"""The op set: every op a model or the sampler calls, chosen once per engine.

Owns the mapping (backend, device) -> OpSet, and switching the Triton
interpreter on when Triton kernels are to run on a CPU. A reader finds which
kernel runs by reading `torch_ops` and `triton_ops` below; models call only
`ctx.ops.<op>` and never pick an implementation themselves.

Must never import triton at module import time: the torch set, the CPU path
and the scheduling tests run without it, and the interpreter must be switched
on before triton is first imported.
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from tinyengine.kernels.workspace import Workspace

BACKENDS = ("torch", "triton")


@dataclass(frozen=True)
class OpSet:
    """One backend's ops. Each field has the signature of its torch reference
    (the module named in the comment); the Triton set fills the same fields."""

    name: str  # "torch" or "triton"
    # attention/reference.py
    write_kv_cache: Callable[..., None]
    paged_attention: Callable[..., torch.Tensor]
    # rope/reference.py: the Llama-family prologue (q/k norms, RoPE, cache write)
    rope_write_kv: Callable[..., torch.Tensor]
    # mla/reference.py: mla_decode, and head_matmul (x [T, H, a] @ w [H, a, b]
    # per head: MLA's absorbed projections)
    mla_decode: Callable[..., torch.Tensor]
    head_matmul: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    # moe/reference.py
    fused_moe: Callable[..., torch.Tensor]
    # norm/reference.py: rms_norm(x, weight, eps, residual=None)
    rms_norm: Callable[..., torch.Tensor | tuple[torch.Tensor, torch.Tensor]]
    # activation/reference.py: silu_and_mul(x [..., 2I]) -> [..., I]
    silu_and_mul: Callable[[torch.Tensor], torch.Tensor]
    # gemv/reference.py: linear(x, weight, bias=None) and the gate_up
    # projection fused with the activation, linear_silu_mul(x, weight, bias=None)
    linear: Callable[..., torch.Tensor]
    linear_silu_mul: Callable[..., torch.Tensor]
    # gemv/reference.py: rms_norm_linear(x, norm_weight, eps, residual, weight,
    # bias=None, *, silu_mul=False) -> (y, new residual), a pre-norm layer's
    # norm and the linear after it (fused at one row in the Triton set)
    rms_norm_linear: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    # DeepSeek-V4: compressor/reference.py (write_rows, compress_windows,
    # write_and_compress: both in one), indexer/reference.py (indexer_topk),
    # sparse_attention/reference.py
    write_rows: Callable[..., None]
    compress_windows: Callable[..., None]
    write_and_compress: Callable[..., None]
    indexer_topk: Callable[..., torch.Tensor]
    sparse_attention: Callable[..., torch.Tensor]
    # DeepSeek-V4's hyper-connections, mhc/reference.py: mhc_pre (weights,
    # Sinkhorn, collapse), mhc_head (the final collapse), mhc_post (expansion)
    mhc_pre: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    mhc_head: Callable[..., torch.Tensor]
    mhc_post: Callable[..., torch.Tensor]
    # sampling/reference.py's gumbel_argmax signature: the sampler's one-pass
    # draw. None: the sampler draws with its own torch path (worker/sampler.py).
    sample_draw: Callable[..., torch.Tensor] | None
    # kernels/batch_invariant.py's set (EngineConfig.batch_invariant) has its
    # by_row_blocks(fn, *rows) here: fn over fixed-size blocks of rows, for
    # per-token code a model runs outside the ops; None in the other sets.
    row_blocks: Callable[..., Any] | None = None

    @property
    def batch_invariant(self) -> bool:
        """Whether this is the batch-invariant set: models then run every token
        through their decode form (e.g. MLA's absorbed attention for prefill
        tokens too), so a token computes the same in a prefill chunk as in a
        decode step."""
        return self.row_blocks is not None

    def per_token(self, fn: Callable[..., Any], *rows: torch.Tensor) -> Any:
        """fn(*rows) for model code whose rows are tokens and that calls torch
        directly (not through an op): on fixed-size row blocks in the
        batch-invariant set (row_blocks), else as it is."""
        return fn(*rows) if self.row_blocks is None else self.row_blocks(fn, *rows)


def torch_ops() -> OpSet:
    """Torch references only: no Triton module is imported."""
    from tinyengine.kernels.activation import reference as activation
    from tinyengine.kernels.attention import reference as attention
    from tinyengine.kernels.compressor import reference as compressor
    from tinyengine.kernels.gemv import reference as gemv
    from tinyengine.kernels.indexer import reference as indexer
    from tinyengine.kernels.mhc import reference as mhc
    from tinyengine.kernels.mla import reference as mla
    from tinyengine.kernels.moe import reference as moe
    from tinyengine.kernels.norm import reference as norm
    from tinyengine.kernels.rope import reference as rope
    from tinyengine.kernels.sparse_attention import reference as sparse_attention

    return OpSet(
        name="torch",
        write_kv_cache=attention.write_kv_cache,
        paged_attention=attention.paged_attention,
        rope_write_kv=rope.rope_write_kv_torch,
        mla_decode=mla.mla_decode,
        head_matmul=mla.head_matmul,
        fused_moe=moe.fused_moe,
        rms_norm=norm.rms_norm_torch,
        silu_and_mul=activation.silu_and_mul,
        linear=gemv.linear,
        linear_silu_mul=gemv.linear_silu_mul,
        rms_norm_linear=gemv.rms_norm_linear,
        write_rows=compressor.write_rows,
        compress_windows=compressor.compress_windows,
        write_and_compress=compressor.write_and_compress,
        indexer_topk=indexer.indexer_topk,
        sparse_attention=sparse_attention.sparse_attention,
        mhc_pre=mhc.mhc_pre,
        mhc_head=mhc.mhc_head,
        mhc_post=mhc.mhc_post,
        sample_draw=None,
    )


def triton_ops(device_type: str, workspace: Workspace | None = None) -> OpSet:
    """The Triton kernels. On a CPU they run under the interpreter, which is
    there to test the attention, MLA, MoE, prologue and DeepSeek-V4 kernels; the norm,
    activation, GEMV and sampler kernels pay off only on a GPU, so off it the
    set keeps their references (the tokens of a CPU run stay the torch path's).
    `workspace` (the runner's): the linears' split-K partials and tickets
    come from it; without one the skinny GEMM never splits K."""
    enable_triton_interpreter_if_needed(device_type)
    import tinyengine.kernels.attention.triton as attention
    import tinyengine.kernels.compressor.triton as compressor
    import tinyengine.kernels.indexer.triton as indexer
    import tinyengine.kernels.mhc.triton as mhc
    import tinyengine.kernels.mla.triton as mla
    import tinyengine.kernels.moe.triton as moe
    import tinyengine.kernels.rope.triton as rope
    import tinyengine.kernels.sparse_attention.triton as sparse_attention

    ref = torch_ops()
    common = dict(
        name="triton",
        write_kv_cache=attention.write_kv_cache,
        paged_attention=attention.paged_attention,
        rope_write_kv=rope.rope_write_kv_triton,
        mla_decode=mla.mla_decode,
        head_matmul=ref.head_matmul,
        fused_moe=moe.fused_moe,
        # DeepSeek-V4: kernels for decode rows (prefill chunks go through the
        # references inside them); the plain cache write is the reference in
        # both sets.
        write_rows=ref.write_rows,
        compress_windows=compressor.compress_windows,
        write_and_compress=compressor.write_and_compress,
        indexer_topk=indexer.indexer_topk,
        sparse_attention=sparse_attention.sparse_attention,
        mhc_pre=mhc.mhc_pre,
        mhc_head=mhc.mhc_head,
        mhc_post=mhc.mhc_post,
    )
    if device_type != "cuda":
        return OpSet(
            **common, rms_norm=ref.rms_norm, silu_and_mul=ref.silu_and_mul, linear=ref.linear,
            linear_silu_mul=ref.linear_silu_mul, rms_norm_linear=ref.rms_norm_linear,
            sample_draw=None,
        )  # fmt: skip
    import tinyengine.kernels.activation.triton as activation
    import tinyengine.kernels.gemv.norm_linear as norm_linear
    import tinyengine.kernels.gemv.silu as gemv_silu
    import tinyengine.kernels.gemv.triton as gemv
    import tinyengine.kernels.norm.triton as norm
    import tinyengine.kernels.sampling.triton as sampling

    linear = (
        gemv.linear if workspace is None else functools.partial(gemv.linear, workspace=workspace)
    )
    return OpSet(
        **common,
        rms_norm=norm.rms_norm,
        silu_and_mul=activation.silu_and_mul_op,
        linear=linear,
        linear_silu_mul=gemv_silu.linear_silu_mul,
        rms_norm_linear=norm_linear.rms_norm_linear_with(linear),
        sample_draw=sampling.gumbel_argmax_triton,
    )


def choose_ops(backend: str, device_type: str, workspace: Workspace | None = None) -> OpSet:
    """The op set for EngineConfig's resolved attention_backend on a device
    type ("cuda" or "cpu"); `workspace`: see triton_ops."""
    if backend == "torch":
        return torch_ops()
    if backend == "triton":
        return triton_ops(device_type, workspace)
    raise ValueError(f"unknown attention backend {backend!r}; choose one of {list(BACKENDS)}")


def enable_triton_interpreter_if_needed(device_type: str) -> None:
    """Triton kernels run on a CPU only under its interpreter, which must be
    switched on before triton is first imported."""
    if device_type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        return
    if "triton" in sys.modules:
        raise ValueError(
            "attention_backend='triton' on CPU needs the Triton interpreter: set "
            "TRITON_INTERPRET=1 before anything imports triton (or use attention_backend='torch')"
        )
    os.environ["TRITON_INTERPRET"] = "1"
