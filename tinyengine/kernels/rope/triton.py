"""Triton twin of kernels/rope/reference.py: per-head q/k RMSNorm (optional), neox
RoPE, and the k/v write into the paged cache, in one launch.

Owns that fused kernel. Same signature and the same rounding steps as
rope_write_kv_torch (read its docstring), so outputs are equal, not just
close. Must never read anything on the host or allocate more than the rotated
q: it runs inside captured CUDA graphs, once per layer per step.

Grid (T, 2): program (t, 0) normalises and rotates token t's q heads into the
contiguous output; program (t, 1) does the same for its k heads, storing them
straight into cache slot slot_mapping[t], and copies its v heads beside them.
The rotated k therefore never exists outside the cache.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tinyengine.kernels.device_fn import device_fn
from tinyengine.kernels.gdc import gdc_launch_dependents, gdc_wait
from tinyengine.kernels.launch import pdl_kwargs


@device_fn
def _round(x, dtype):
    """Round an fp32 tile to the activation dtype and back (a torch op's
    output rounding). For bf16 the round-to-nearest-even is done on the bits:
    the compiler may drop a plain fp32 -> bf16 -> fp32 conversion pair (results
    then differ from torch's by a few bf16 steps wherever the two products of
    a rotation nearly cancel), but never integer ops."""
    if dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True)
    return x.to(dtype).to(tl.float32)


@device_fn
def _norm_rope_store(
    src, stride_sh, dst, stride_dh, w_ptr, cos, sin, num_heads, eps,
    HEAD_DIM: tl.constexpr, HALF: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr, BLOCK_PASS: tl.constexpr, HAS_NORM: tl.constexpr,
):  # fmt: skip
    """src heads [num_heads, HEAD_DIM] -> (norm) -> RoPE -> dst (any dtype)."""
    act = src.dtype.element_ty
    h = tl.arange(0, BLOCK_H)[:, None]
    i = tl.arange(0, BLOCK_HALF)[None, :]
    h_ok = h < num_heads
    i_ok = h_ok & (i < HALF)
    a = tl.load(src + h * stride_sh + i, mask=i_ok, other=0.0).to(tl.float32)
    b = tl.load(src + h * stride_sh + HALF + i, mask=i_ok, other=0.0).to(tl.float32)
    if BLOCK_PASS > 0:  # dims past the rotary span: normalised, not rotated
        p = 2 * HALF + tl.arange(0, BLOCK_PASS)[None, :]
        p_ok = h_ok & (p < HEAD_DIM)
        x_p = tl.load(src + h * stride_sh + p, mask=p_ok, other=0.0).to(tl.float32)
    if HAS_NORM:
        ss = tl.sum(a * a, 1) + tl.sum(b * b, 1)
        if BLOCK_PASS > 0:
            ss += tl.sum(x_p * x_p, 1)
        rstd = (1.0 / tl.sqrt(ss / HEAD_DIM + eps))[:, None]
        # HF: normalise in fp32, round, multiply by the weight, round.
        wa = tl.load(w_ptr + i, mask=i < HALF, other=0.0).to(tl.float32)
        wb = tl.load(w_ptr + HALF + i, mask=i < HALF, other=0.0).to(tl.float32)
        a = _round(_round(a * rstd, act) * wa, act)
        b = _round(_round(b * rstd, act) * wb, act)
        if BLOCK_PASS > 0:
            wp = tl.load(w_ptr + p, mask=p < HEAD_DIM, other=0.0).to(tl.float32)
            x_p = _round(_round(x_p * rstd, act) * wp, act)
    # HF in the activation dtype: every product rounds before the sum.
    ra = _round(a * cos, act) - _round(b * sin, act)
    rb = _round(b * cos, act) + _round(a * sin, act)
    # Rounded before the store's conversion (then exact in any rounding mode).
    out_ty = dst.dtype.element_ty
    tl.store(dst + h * stride_dh + i, _round(ra, act).to(out_ty), mask=i_ok)
    tl.store(dst + h * stride_dh + HALF + i, _round(rb, act).to(out_ty), mask=i_ok)
    if BLOCK_PASS > 0:
        tl.store(dst + h * stride_dh + p, x_p.to(out_ty), mask=p_ok)


@triton.jit
def _rope_write_kv_kernel(
    q_ptr, k_ptr, v_ptr, pos_ptr, cache_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    q_out_ptr, qw_ptr, kw_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_cache,
    stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch,
    stride_qot, stride_qoh,
    num_q_heads, num_kv_heads, eps,
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, HALF: tl.constexpr,
    BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_HALF: tl.constexpr,
    BLOCK_PASS: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    HAS_NORM: tl.constexpr, USE_PDL: tl.constexpr = False,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    is_kv = tl.program_id(1) == 1
    act = q_ptr.dtype.element_ty
    # Positions and slots (host-staged) and the cos/sin table are written by
    # no kernel of the step: under PDL (kernels/launch.py) they are read
    # while the projection before this kernel still runs; q, k and v only
    # after the wait.
    pos = tl.load(pos_ptr + t).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    i = tl.arange(0, BLOCK_HALF)[None, :]
    cos = tl.load(cache_ptr + pos * stride_cache + i, mask=i < HALF, other=0.0)
    sin = tl.load(cache_ptr + pos * stride_cache + HALF + i, mask=i < HALF, other=0.0)
    if USE_PDL:
        gdc_wait()
        gdc_launch_dependents()
    cos = cos.to(act).to(tl.float32)  # HF rounds cos/sin to the activation dtype
    sin = sin.to(act).to(tl.float32)
    if not is_kv:
        _norm_rope_store(
            q_ptr + t * stride_qt, stride_qh, q_out_ptr + t * stride_qot, stride_qoh, qw_ptr,
            cos, sin, num_q_heads, eps, HEAD_DIM, HALF, BLOCK_HQ, BLOCK_HALF, BLOCK_PASS,
            HAS_NORM,
        )  # fmt: skip
    else:
        if slot >= 0:  # a negative slot is a padding row: it must touch no block
            blk = slot // BLOCK_SIZE
            off = slot % BLOCK_SIZE
            _norm_rope_store(
                k_ptr + t * stride_kt, stride_kh,
                k_cache_ptr + blk * stride_kcb + off * stride_kcs, stride_kch, kw_ptr,
                cos, sin, num_kv_heads, eps, HEAD_DIM, HALF, BLOCK_HK, BLOCK_HALF, BLOCK_PASS,
                HAS_NORM,
            )  # fmt: skip
            h = tl.arange(0, BLOCK_HK)[:, None]
            d = tl.arange(0, BLOCK_DV)[None, :]
            v_ok = (h < num_kv_heads) & (d < HEAD_DIM_V)
            v = tl.load(v_ptr + t * stride_vt + h * stride_vh + d, mask=v_ok)
            vc = v_cache_ptr + blk * stride_vcb + off * stride_vcs + h * stride_vch + d
            tl.store(vc, v.to(v_cache_ptr.dtype.element_ty), mask=v_ok)


def rope_write_kv_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    q_norm_weight: torch.Tensor | None = None,
    k_norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
) -> torch.Tensor:
    """Same contract as rope/reference.py's rope_write_kv_torch."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads, head_dim_v = k.shape[1], v.shape[2]
    rot = cos_sin_cache.shape[1]
    if (q_norm_weight is None) != (k_norm_weight is None):
        raise ValueError("rope_write_kv: give both q_norm_weight and k_norm_weight, or neither")
    if k.shape != (num_tokens, num_kv_heads, head_dim) or v.shape[:2] != k.shape[:2]:
        raise ValueError(
            f"rope_write_kv: k {tuple(k.shape)} / v {tuple(v.shape)} do not match q "
            f"{tuple(q.shape)} ([T, Hkv, D] and [T, Hkv, Dv])"
        )
    if rot % 2 or not 0 < rot <= head_dim:
        raise ValueError(f"rope_write_kv: rotary dim {rot} must be even and <= head_dim {head_dim}")
    for name, t in (("q", q), ("k", k), ("v", v), ("cos_sin_cache", cos_sin_cache),
                    ("k_cache", k_cache), ("v_cache", v_cache)):  # fmt: skip
        if t.stride(-1) != 1:
            raise ValueError(f"rope_write_kv: the last dim of {name} must be contiguous")
    if slot_mapping.shape[0] < num_tokens or positions.shape[0] < num_tokens:
        raise ValueError(
            f"rope_write_kv: {num_tokens} rows but {positions.shape[0]} positions and "
            f"{slot_mapping.shape[0]} slots"
        )
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if num_tokens == 0:
        return q_out
    has_norm = q_norm_weight is not None
    half = rot // 2
    block_hq = triton.next_power_of_2(num_q_heads)
    _rope_write_kv_kernel[(num_tokens, 2)](
        q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping,
        q_out, q_norm_weight if has_norm else q, k_norm_weight if has_norm else q,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        cos_sin_cache.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        q_out.stride(0), q_out.stride(1),
        num_q_heads, num_kv_heads, eps,
        HEAD_DIM=head_dim, HEAD_DIM_V=head_dim_v, HALF=half,
        BLOCK_HQ=block_hq, BLOCK_HK=triton.next_power_of_2(num_kv_heads),
        BLOCK_HALF=triton.next_power_of_2(half),
        BLOCK_PASS=triton.next_power_of_2(head_dim - rot) if head_dim > rot else 0,
        BLOCK_DV=triton.next_power_of_2(head_dim_v), BLOCK_SIZE=k_cache.shape[1],
        HAS_NORM=has_norm, **pdl_kwargs(q.device),
        # ~8 elements (16 bytes of bf16) per thread for the q heads.
        num_warps=max(1, min(8, block_hq * triton.next_power_of_2(head_dim) // 256)),
    )  # fmt: skip
    return q_out
