"""Fused sampling, the Triton kernel: one pass over each row of logits picks
its token by the Gumbel-max trick (sampling/reference.py defines the draw, its
random numbers and the rules both implementations keep; read it first).

Owns the GPU draw: the Philox words, the fast log2 and the grid. Must never
allocate anything but its output (the split path's scratch lives in the
output's own storage), read a device tensor on the host, or change its
inputs: it runs inside captured CUDA graphs.

    gumbel_argmax_triton(logits [R, V], inv_temperature [R] fp32, seeds [R] int64)
        -> tokens [R] int64

Grid: (rows, splits). At large batches (rows >= 4x the SM count) one program
owns a whole row (a 152k-token bf16 row is ~300 KB, streamed in chunks of 4 * BLOCK
columns, keeping a running (max, column) per position in registers); smaller
batches split the vocabulary so that every SM gets work, and a second tiny
kernel reduces the splits' (max, column) pairs, stored packed in int64 after
the tokens in the output's storage. `launch_gumbel_argmax` takes the launch
shape (tests force splits with it); the op never does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from tinyengine.kernels.device_fn import device_fn
from tinyengine.kernels.launch import interpreting, num_sms
from tinyengine.kernels.sampling.reference import _quarter

_MAX_BLOCK = 1024  # Philox counters per chunk: 4096 columns; a split is >= 1 chunk
_PROGRAMS_PER_SM = 4  # split the vocab until the grid has this many programs per SM
_MAX_SPLITS = 64  # the reduce kernel's fixed width (152k vocab: at most 38 chunks anyway)


# ----------------------------------------------------------------------------- kernels


@device_fn
def _uniform(word):
    """u = (word >> 9) * 2^-23 + 2^-24: exact, and never 0 or 1."""
    return (word >> 9).to(tl.int32).to(tl.float32) * 1.1920928955078125e-07 + 5.960464477539063e-08


@device_fn
def _log2(x, FAST: tl.constexpr):
    """lg2.approx on the GPU (one MUFU op instead of a ~20-instruction
    polynomial); the interpreter has no libdevice."""
    if FAST:
        return libdevice.fast_log2f(x)
    else:
        return tl.log2(x)


@device_fn
def _noise(word, FAST: tl.constexpr):
    """Gumbel noise in log2 units from one Philox word (see the module docstring)."""
    u = _uniform(word)
    v = 1.0 - u
    series = v * (1.0 + v * (0.5 + v * (0.3333333333333333 + v * 0.25))) * 1.4426950408889634
    e = tl.where(v < 0.0078125, series, -_log2(u, FAST))
    return -_log2(tl.maximum(e, 9.313225746154785e-10), FAST)


@device_fn
def _scan_lane(
    row_ptr, col, ok, word, scale, best, best_col, NOISE: tl.constexpr, FAST: tl.constexpr
):  # fmt: skip
    """Fold one block of columns into the per-position running (max, column).
    A lane's columns only grow from block to block, so strict > keeps the lowest."""
    x = tl.load(row_ptr + col, mask=ok, other=float("-inf")).to(tl.float32)
    if NOISE:
        s = x * scale + _noise(word, FAST)
    else:
        s = x
    take = s > best
    return tl.where(take, s, best), tl.where(take, col, best_col)


@device_fn
def _scan(
    row_ptr, seed, scale, lo, hi, vocab, quarter,
    BLOCK: tl.constexpr, NOISE: tl.constexpr, FAST: tl.constexpr,
):  # fmt: skip
    """(max score, its lowest column) over counters [lo, hi) of one row, all four
    lanes; column 2**31 - 1 ("none") when every score there is -inf."""
    b0 = tl.full([BLOCK], float("-inf"), tl.float32)
    b1, b2, b3 = b0, b0, b0
    i0 = tl.full([BLOCK], 2147483647, tl.int32)
    i1, i2, i3 = i0, i0, i0
    for start in range(lo, hi, BLOCK):
        ctr = start + tl.arange(0, BLOCK)
        ok = ctr < hi
        if NOISE:
            w0, w1, w2, w3 = tl.randint4x(seed, ctr)
        else:
            w0, w1, w2, w3 = ctr, ctr, ctr, ctr
        c1 = ctr + quarter
        c2 = c1 + quarter
        c3 = c2 + quarter
        b0, i0 = _scan_lane(row_ptr, ctr, ok & (ctr < vocab), w0, scale, b0, i0, NOISE, FAST)
        b1, i1 = _scan_lane(row_ptr, c1, ok & (c1 < vocab), w1, scale, b1, i1, NOISE, FAST)
        b2, i2 = _scan_lane(row_ptr, c2, ok & (c2 < vocab), w2, scale, b2, i2, NOISE, FAST)
        b3, i3 = _scan_lane(row_ptr, c3, ok & (c3 < vocab), w3, scale, b3, i3, NOISE, FAST)
    m = tl.maximum(
        tl.maximum(tl.max(b0, 0), tl.max(b1, 0)), tl.maximum(tl.max(b2, 0), tl.max(b3, 0))
    )
    j0 = tl.min(tl.where(b0 == m, i0, 2147483647), 0)
    j1 = tl.min(tl.where(b1 == m, i1, 2147483647), 0)
    j2 = tl.min(tl.where(b2 == m, i2, 2147483647), 0)
    j3 = tl.min(tl.where(b3 == m, i3, 2147483647), 0)
    return m, tl.minimum(tl.minimum(j0, j1), tl.minimum(j2, j3))


# One compile per (logits dtype, vocab) whatever the batch, the split or the
# Sampler path: nothing that varies with them is specialized on (part_ptr's
# alignment varies with the row count, the strides with the path), and
# per_split is always a multiple of BLOCK >= 16 (so its specialization is fixed).
_NO_SPECIALIZE = ["inv_t_ptr", "seeds_ptr", "part_ptr", "stride_inv_t", "stride_seed", "num_splits"]


@triton.jit(do_not_specialize=_NO_SPECIALIZE)
def _gumbel_argmax_kernel(
    logits_ptr, inv_t_ptr, seeds_ptr, out_ptr, part_ptr,
    stride_row, stride_inv_t, stride_seed, vocab, quarter, per_split, num_splits,
    BLOCK: tl.constexpr, FAST_LOG: tl.constexpr,
):  # fmt: skip
    """Grid (rows, num_splits): counters [split * per_split, +per_split) of one
    row. With one split the program owns the row and stores its token; else it
    stores (max, column) packed in int64 (fp32 bits high, column low)."""
    row = tl.program_id(0)
    split = tl.program_id(1)
    row_ptr = logits_ptr + row.to(tl.int64) * stride_row
    lo = split * per_split
    hi = tl.minimum(lo + per_split, quarter)
    inv_t = tl.load(inv_t_ptr + row * stride_inv_t)
    if inv_t > 0:
        seed = tl.load(seeds_ptr + row * stride_seed)
        best, col = _scan(row_ptr, seed, inv_t * 1.4426950408889634, lo, hi, vocab, quarter,
                          BLOCK, True, FAST_LOG)  # fmt: skip
    else:
        best, col = _scan(row_ptr, 0, inv_t, lo, hi, vocab, quarter, BLOCK, False, FAST_LOG)
    if num_splits > 1:
        packed = (best.to(tl.int32, bitcast=True).to(tl.int64) << 32) | col.to(tl.int64)
        tl.store(part_ptr + row * num_splits + split, packed)
    else:
        tl.store(out_ptr + row, tl.where(col == 2147483647, 0, col).to(tl.int64))


@triton.jit(do_not_specialize=["part_ptr", "num_splits"])
def _reduce_splits_kernel(part_ptr, out_ptr, num_splits, BLOCK_S: tl.constexpr):
    """Grid (rows,): the best of a row's splits; ties to the lowest column."""
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK_S)
    ok = offs < num_splits
    packed = tl.load(part_ptr + row * num_splits + offs, mask=ok, other=0)
    best = tl.where(ok, (packed >> 32).to(tl.int32).to(tl.float32, bitcast=True), float("-inf"))
    col = tl.where(ok, packed.to(tl.int32), 2147483647)
    m = tl.max(best, 0)
    c = tl.min(tl.where(best == m, col, 2147483647), 0)
    tl.store(out_ptr + row, tl.where(c == 2147483647, 0, c).to(tl.int64))


def _fast_log() -> bool:
    """The GPU's approximate log2, except under the interpreter (no libdevice)."""
    return not interpreting()


def _plan(rows: int, vocab: int, device: torch.device, num_splits: int | None, block: int | None):
    """(quarter, BLOCK, counters per split, splits), from host ints only. BLOCK
    depends on the vocab alone; a split is a whole number of chunks."""
    quarter = _quarter(vocab)
    if block is None:
        block = min(_MAX_BLOCK, max(16, triton.next_power_of_2(quarter)))
    chunks = -(-quarter // block)
    if num_splits is None:
        programs = _PROGRAMS_PER_SM * num_sms(device, off_gpu=1)
        num_splits = 1 if rows >= programs else -(-programs // max(rows, 1))
    num_splits = max(1, min(num_splits, chunks, _MAX_SPLITS))
    per_split = -(-chunks // num_splits) * block
    return quarter, block, per_split, -(-quarter // per_split)


def gumbel_argmax_triton(
    logits: torch.Tensor, inv_temperature: torch.Tensor, seeds: torch.Tensor
) -> torch.Tensor:
    """The draw (module docstring), its launch shape chosen from the shapes."""
    return launch_gumbel_argmax(logits, inv_temperature, seeds)


def launch_gumbel_argmax(
    logits: torch.Tensor,
    inv_temperature: torch.Tensor,
    seeds: torch.Tensor,
    *,
    num_splits: int | None = None,
    block: int | None = None,
) -> torch.Tensor:
    """`num_splits` (at most 64) and `block` (Philox counters per chunk, a power
    of two >= 16) force the launch shape, for tests: the tokens never depend on them."""
    if logits.dim() != 2 or logits.stride(-1) != 1:
        raise ValueError("gumbel_argmax: logits must be [rows, vocab] with a contiguous last dim")
    rows, vocab = logits.shape
    if inv_temperature.shape != (rows,) or seeds.shape != (rows,):
        raise ValueError(
            f"gumbel_argmax: {rows} rows of logits need inv_temperature and seeds of shape "
            f"({rows},), got {tuple(inv_temperature.shape)} and {tuple(seeds.shape)}"
        )
    if inv_temperature.dtype != torch.float32 or seeds.dtype != torch.int64:
        raise ValueError("gumbel_argmax: inv_temperature must be float32 and seeds int64")
    if rows == 0 or vocab == 0:
        return torch.zeros(rows, dtype=torch.int64, device=logits.device)
    quarter, block, per_split, splits = _plan(rows, vocab, logits.device, num_splits, block)
    # One allocation: the tokens, then (split path) the splits' packed partials.
    out = torch.empty(rows * (1 + splits) if splits > 1 else rows, dtype=torch.int64,
                      device=logits.device)  # fmt: skip
    tokens, part = out[:rows], out[rows:]  # part is empty (and unused) without splits
    # Four lanes of BLOCK counters: 16 columns (4 per lane) per thread and chunk.
    num_warps = max(1, min(8, block // 128))
    _gumbel_argmax_kernel[(rows, splits)](
        logits, inv_temperature, seeds, tokens, part,
        logits.stride(0), inv_temperature.stride(0), seeds.stride(0), vocab, quarter, per_split,
        splits,
        BLOCK=block, FAST_LOG=_fast_log(), num_warps=num_warps,
    )  # fmt: skip
    if splits > 1:
        _reduce_splits_kernel[(rows,)](part, tokens, splits, BLOCK_S=_MAX_SPLITS, num_warps=1)
    return tokens


@triton.jit
def _noise_kernel(
    seeds_ptr, out_ptr, vocab, quarter,
    BLOCK: tl.constexpr, NOISE: tl.constexpr, FAST_LOG: tl.constexpr,
):  # fmt: skip
    """Grid (rows, cdiv(quarter, BLOCK)): the uniforms, or the noise, of the
    sampling kernel, laid out [rows, vocab]."""
    row = tl.program_id(0)
    ctr = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    w0, w1, w2, w3 = tl.randint4x(tl.load(seeds_ptr + row), ctr)
    base = out_ptr + row.to(tl.int64) * vocab
    ok = ctr < quarter
    tl.store(base + ctr, _from_word(w0, NOISE, FAST_LOG), mask=ok & (ctr < vocab))
    c = ctr + quarter
    tl.store(base + c, _from_word(w1, NOISE, FAST_LOG), mask=ok & (c < vocab))
    c += quarter
    tl.store(base + c, _from_word(w2, NOISE, FAST_LOG), mask=ok & (c < vocab))
    c += quarter
    tl.store(base + c, _from_word(w3, NOISE, FAST_LOG), mask=ok & (c < vocab))


@device_fn
def _from_word(word, NOISE: tl.constexpr, FAST: tl.constexpr):
    if NOISE:
        return _noise(word, FAST)
    else:
        return _uniform(word)


def _draws_triton(seeds: torch.Tensor, vocab: int, noise: bool) -> torch.Tensor:
    rows, quarter = seeds.shape[0], _quarter(vocab)
    out = torch.empty(rows, vocab, dtype=torch.float32, device=seeds.device)
    block = min(_MAX_BLOCK, triton.next_power_of_2(quarter))
    if rows and vocab:
        _noise_kernel[(rows, triton.cdiv(quarter, block))](
            seeds.contiguous(), out, vocab, quarter, BLOCK=block, NOISE=noise, FAST_LOG=_fast_log()
        )
    return out


def gumbel_uniforms_triton(seeds: torch.Tensor, vocab: int) -> torch.Tensor:
    """The sampling kernel's uniforms u [R, V] (fp32), for tests: they must
    equal gumbel_uniforms_torch bit for bit."""
    return _draws_triton(seeds, vocab, noise=False)


def gumbel_noise_triton(seeds: torch.Tensor, vocab: int) -> torch.Tensor:
    """The sampling kernel's noise [R, V] (fp32, log2 units), for tests: it
    equals gumbel_noise_torch up to log2's error (last bits under the
    interpreter, ~1e-5 on the GPU)."""
    return _draws_triton(seeds, vocab, noise=True)
