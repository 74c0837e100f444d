"""Triton mHC kernels: `mhc_pre`, `mhc_head` and `mhc_post` with the
signatures and the numbers of kernels/mhc/reference.py.

Why. Written as torch ops, one hyper-connection is ~150 launches of tiny
kernels (the Sinkhorn loop alone is 4 per iteration over [T, hc, hc]),
twice per layer: at batch-1 decode they are most of a step's launches. Here
each op is one launch.

`_mhc_pre_kernel`, one program per BLOCK_T tokens (HEAD selects the head's
variant):
1. a pass over each token's hc * D stream values for the unweighted RMS
   norm's factor rsqrt(mean(x^2) + eps), which scales the raw projection
   `mixes` (the norm has no weight, so normalising before or after the
   projection is the same up to fp32 rounding);
2. pre / post / comb from the mixes in registers: sigmoids, the row softmax
   and the Sinkhorn loop over [hc, hc] tiles (hc is a power-of-two constexpr:
   4 in V4-Flash, 2 in the tiny test model);
3. a second pass over the streams (now in L2) for the collapse
   sum_j pre_j * streams[j], fp32, stored in the streams' dtype.
`_mhc_post_kernel`, one program per (BLOCK_T tokens, D chunk): post * out +
comb^T @ streams, rounding where HF's bf16 ops round (the weights cast to the
streams' dtype, each product and the mix rounded before the sum), fp32 math
between.

BLOCK_T is 1 on a GPU: a token's hc * D values are already a program's worth
of work, and T = 1 (decode) wants no idle lanes. The interpreter pays per
program and per op, not per element, so there a program takes many tokens
(`_token_tile`); the kernels are the same code either way.

All math is fp32 (the interpreter's bf16 arithmetic is wrong, and HF's is
fp32 here anyway). Graph safety: grids come from shapes only, the scale is
read on the device, the only allocations are the outputs; the token count is
not specialized on, so a new batch size compiles nothing.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tinyengine.kernels.launch import interpreting

# Stream elements per tile: [BLOCK_T, hc, BLOCK_D] fp32 values in registers.
_PRE_TILE = 4096
_POST_BLOCK = 512
# Under the interpreter: elements per tile (numpy arrays, no register limit).
_INTERPRETER_TILE = 1 << 16


@triton.jit(do_not_specialize=["num_tokens"])
def _mhc_pre_kernel(
    streams_ptr, mixes_ptr, base_ptr, scale_ptr, post_ptr, comb_ptr, out_ptr,
    stride_st, stride_sh, stride_m, stride_o,
    num_tokens, D, iters, hc_eps, norm_eps,
    HC: tl.constexpr, HEAD: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """Grid (cdiv(T, BLOCK_T),). HEAD: mixes/base are [hc] per token, scale
    [1], and only the collapse is written (post_ptr / comb_ptr unused)."""
    toks = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    tmask = toks < num_tokens
    rows = tl.arange(0, HC)
    cols = tl.arange(0, BLOCK_D)
    row_ptrs = streams_ptr + toks[:, None, None] * stride_st + rows[None, :, None] * stride_sh

    sq = tl.zeros([BLOCK_T, HC, BLOCK_D], dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D):
        offs = d0 + cols
        mask = tmask[:, None, None] & (offs < D)[None, None, :]
        x = tl.load(row_ptrs + offs[None, None, :], mask=mask, other=0.0).to(tl.float32)
        sq += x * x
    rstd = tl.rsqrt(tl.sum(tl.sum(sq, axis=2), axis=1) / (HC * D) + norm_eps)[:, None]

    # Tokens past the end read zeros: finite weights, never stored.
    mix_rows = mixes_ptr + toks[:, None] * stride_m
    vmask = tmask[:, None]
    pre_w = tl.load(mix_rows + rows[None, :], mask=vmask, other=0.0) * rstd
    pre = tl.sigmoid(pre_w * tl.load(scale_ptr) + tl.load(base_ptr + rows)[None, :]) + hc_eps
    if not HEAD:
        post_w = tl.load(mix_rows + HC + rows[None, :], mask=vmask, other=0.0) * rstd
        post_b = tl.load(base_ptr + HC + rows)[None, :]
        post = 2 * tl.sigmoid(post_w * tl.load(scale_ptr + 1) + post_b)
        tl.store(post_ptr + toks[:, None] * HC + rows[None, :], post, mask=vmask)
        ij = rows[:, None] * HC + rows[None, :]
        cmask = tmask[:, None, None]
        comb = tl.load(mix_rows[:, :, None] + 2 * HC + ij[None], mask=cmask, other=0.0)
        comb = comb * rstd[:, :, None] * tl.load(scale_ptr + 2)
        comb = comb + tl.load(base_ptr + 2 * HC + ij)[None]
        comb = tl.exp(comb - tl.max(comb, axis=2)[:, :, None])
        comb = comb / tl.sum(comb, axis=2)[:, :, None] + hc_eps
        # Sinkhorn as HF: columns (sums over i), then iters - 1 x (rows, columns).
        comb = comb / (tl.sum(comb, axis=1)[:, None, :] + hc_eps)
        for _ in range(1, iters):
            comb = comb / (tl.sum(comb, axis=2)[:, :, None] + hc_eps)
            comb = comb / (tl.sum(comb, axis=1)[:, None, :] + hc_eps)
        tl.store(comb_ptr + toks[:, None, None] * HC * HC + ij[None], comb, mask=cmask)

    out_rows = out_ptr + toks[:, None] * stride_o
    for d0 in range(0, D, BLOCK_D):
        offs = d0 + cols
        mask = tmask[:, None] & (offs < D)[None, :]
        x = tl.load(row_ptrs + offs[None, None, :], mask=mask[:, None, :], other=0.0)
        collapsed = tl.sum(pre[:, :, None] * x.to(tl.float32), axis=1)
        tl.store(out_rows + offs[None, :], collapsed.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["num_tokens"])
def _mhc_post_kernel(
    streams_ptr, post_ptr, comb_ptr, out_ptr, new_ptr,
    stride_st, stride_sh, stride_o, num_tokens, D,
    HC: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """Grid (cdiv(T, BLOCK_T), cdiv(D, BLOCK_D)):
    new[i] = post_i * out + sum_k comb[k, i] * streams[k]."""
    toks = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    tmask = (toks < num_tokens)[:, None]
    rows = tl.arange(0, HC)
    offs = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask = tmask & (offs < D)[None, :]
    dtype = new_ptr.dtype.element_ty
    s_rows = streams_ptr + toks[:, None] * stride_st + offs[None, :]
    c_rows = comb_ptr + toks[:, None] * HC * HC + rows[None, :]
    mixed = tl.zeros([BLOCK_T, HC, BLOCK_D], dtype=tl.float32)
    for k in tl.static_range(HC):
        s_k = tl.load(s_rows + k * stride_sh, mask=mask, other=0.0).to(tl.float32)
        c_k = tl.load(c_rows + k * HC, mask=tmask, other=0.0).to(dtype).to(tl.float32)
        mixed += c_k[:, :, None] * s_k[:, None, :]
    post = tl.load(post_ptr + toks[:, None] * HC + rows[None, :], mask=tmask, other=0.0)
    post = post.to(dtype).to(tl.float32)
    o = tl.load(out_ptr + toks[:, None] * stride_o + offs[None, :], mask=mask, other=0.0)
    spread = (post[:, :, None] * o.to(tl.float32)[:, None, :]).to(dtype).to(tl.float32)
    new = spread + mixed.to(dtype).to(tl.float32)
    new_ptrs = (
        new_ptr + toks[:, None, None] * HC * D + rows[None, :, None] * D + offs[None, None, :]
    )
    tl.store(new_ptrs, new.to(dtype), mask=mask[:, None, :])


def _token_tile(num_tokens: int, elements_per_token: int) -> int:
    """Tokens per program: 1 on a GPU, as many as fit a big tile under the
    interpreter."""
    if not interpreting():
        return 1
    fit = max(1, _INTERPRETER_TILE // elements_per_token)
    return min(triton.next_power_of_2(num_tokens), triton.next_power_of_2(fit + 1) // 2)


def _inner_contiguous(t: torch.Tensor) -> torch.Tensor:
    """The kernels index the last dim with unit stride; anything else is copied."""
    return t if t.stride(-1) == 1 else t.contiguous()


def _check_hc(hc: int) -> None:
    if hc & (hc - 1):
        raise ValueError(f"mhc: hc_mult must be a power of two, got {hc}")


def _launch_pre(streams, mixes, base, scale, post, comb, iters, hc_eps, norm_eps, head):
    num_tokens, hc, dim = streams.shape
    out = torch.empty(num_tokens, dim, dtype=streams.dtype, device=streams.device)
    if num_tokens == 0:
        return out
    _check_hc(hc)
    streams, mixes = _inner_contiguous(streams), _inner_contiguous(mixes)
    block_d = min(triton.next_power_of_2(dim), max(1, _PRE_TILE // hc))
    block_t = _token_tile(num_tokens, hc * block_d)
    _mhc_pre_kernel[(triton.cdiv(num_tokens, block_t),)](
        streams, mixes, base, scale, post, comb, out,
        streams.stride(0), streams.stride(1), mixes.stride(0), out.stride(0),
        num_tokens, dim, iters, hc_eps, norm_eps,
        HC=hc, HEAD=head, BLOCK_T=block_t, BLOCK_D=block_d, num_warps=4,
    )  # fmt: skip
    return out


def mhc_pre(
    streams: torch.Tensor,
    mixes: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    *,
    iters: int,
    hc_eps: float,
    norm_eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    num_tokens, hc, _ = streams.shape
    post = torch.empty(num_tokens, hc, dtype=torch.float32, device=streams.device)
    comb = torch.empty(num_tokens, hc, hc, dtype=torch.float32, device=streams.device)
    collapsed = _launch_pre(
        streams, mixes, base, scale, post, comb, iters, hc_eps, norm_eps, head=False
    )
    return post, comb, collapsed


def mhc_head(
    streams: torch.Tensor,
    mixes: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    *,
    hc_eps: float,
    norm_eps: float,
) -> torch.Tensor:
    # post / comb are never touched with HEAD; any valid pointer will do.
    return _launch_pre(streams, mixes, base, scale, base, base, 1, hc_eps, norm_eps, head=True)


def mhc_post(
    streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor, out: torch.Tensor
) -> torch.Tensor:
    num_tokens, hc, dim = streams.shape
    new = torch.empty(num_tokens, hc, dim, dtype=streams.dtype, device=streams.device)
    if num_tokens == 0:
        return new
    _check_hc(hc)
    streams, out = _inner_contiguous(streams), _inner_contiguous(out)
    post, comb = post.contiguous(), comb.contiguous()
    block_d = min(triton.next_power_of_2(dim), _POST_BLOCK)
    block_t = _token_tile(num_tokens, hc * hc * block_d)
    grid = (triton.cdiv(num_tokens, block_t), triton.cdiv(dim, block_d))
    _mhc_post_kernel[grid](
        streams, post, comb, out, new,
        streams.stride(0), streams.stride(1), out.stride(0), num_tokens, dim,
        HC=hc, BLOCK_T=block_t, BLOCK_D=block_d, num_warps=4,
    )  # fmt: skip
    return new
