"""Exact top-k of packed indexer keys on the GPU: the select step of the
Triton lightning indexer (kernels/indexer/triton.py scores, this picks).

Input: int64 keys [n, E], reference.pack_scores's packing (the fp32 score in
the high half, the entry id inverted in the low half), so keys are distinct
and order by (score descending, id ascending). Output: the ids of each row's
k largest keys, largest first, -1 for -inf scores and past E: exactly what
unpack_picks(torch.topk(keys, k).values) gives, at ~1/3 of its cost.

A tree of selects. Each level's programs take a chunk of 4096 keys of a row
(the last level's, 2048) into registers and keep its k largest, so 16k
entries go 4 x 4096 -> 4 x 512 -> 512 in two launches; the global top k is
inside the union of every chunk's top k. A chunk's picks come from a radix
select on the 32-bit score field, 5 bits a pass from the top: a histogram
(tl.histogram) of the next digit over the keys whose higher digits match
the prefix found so far, then the bin where the count from the top reaches
`need`; it stops as soon as the group at the k-th place is needed whole, or
all 32 bits are resolved (the group is then one score). One scan then
compacts the keys above the group and the group's first `need` in slot
order. Slots are in id order at every level (chunks keep their order and
compact in order), so ties go to the lower id, the reference's stable
choice. The last level sorts its k picks (bitonic, in registers).

Why this shape. The select is bound by its passes' arithmetic and block-wide
reductions, not by memory (64 rows of 16k keys are 8 MB): holding a chunk in
registers replaces re-reading the row every pass, chunks spread one row over
several SMs, and each pass does one scan and one reduction besides the
histogram. 5-bit digits beat 8-bit ones (a histogram's cost grows with its
bins faster than the passes it saves) and 4-bit ones (more passes). On an
H200 (benchmarks/bench_v4_indexer.py): ~32 us for 64 rows of 16k entries,
~21 us for one.

Graph safety: launches and buffer sizes come from host ints (rows, E, k).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tinyengine.kernels.device_fn import device_fn
from tinyengine.kernels.indexer.reference import NEG_INF_HI

_NEG_INF_HI = tl.constexpr(NEG_INF_HI)
_PAD = tl.constexpr(-(2**63))  # below every packed key: an empty slot of a level's input

# From benchmarks/bench_v4_indexer.py --sweep on an H200 (B=1, 64, 256 at 64k
# context): chunks of 4096 keys, the last level's of 2048, 8 warps, 5-bit digits.
_SELECT_CHUNK = 4096
_FINAL_CHUNK = 2048
_SELECT_WARPS = 8
_DIGIT = 5


@device_fn
def _score_field(key):
    """The score field of packed keys as a uint32, in the same order (the
    signed high half with its sign bit flipped)."""
    high = (key >> 32).to(tl.int32)
    return (high ^ -2147483648).to(tl.uint32, bitcast=True)


@triton.jit(do_not_specialize=["length", "k"])
def _select_kernel(
    keys_ptr, out_ptr, chosen_ptr, length, k, stride_kt, stride_ot, stride_ct,
    TOPK: tl.constexpr, K_POW2: tl.constexpr, CHUNK: tl.constexpr, DIGIT: tl.constexpr,
    FINAL: tl.constexpr,
):  # fmt: skip
    """Grid (chunks, rows). Program (c, row) takes the row's keys
    [c * CHUNK, (c + 1) * CHUNK) below `length`, less _PAD slots, and picks
    the min(k, count) largest, all in registers:

    radix select on the 32-bit score field u, DIGIT bits a pass from the top:
    a histogram of the next digit over the keys whose higher digits match
    the prefix found so far, then the bin where the count from the top
    reaches `need`. It stops once every key of the prefix's group is needed
    or all 32 bits are resolved (the group is then one score). Keys above
    the group are in; of the group the `need` first in slot order, which is
    id order (the packed order of equal scores): within a chunk slots are
    ids, and a level's output keeps its chunks in order, each compacted in
    order.

    FINAL (one chunk per row): the picks, sorted (bitonic, in registers via
    `chosen`), as ids into out[row, :TOPK]; -1 for -inf scores and past
    the picks. Else: the picks compacted into out[row, c * K_POW2 + ...],
    the rest of the chunk's K_POW2 slots _PAD: the next level's input."""
    row = tl.program_id(1)
    c = tl.program_id(0)
    offs = tl.arange(0, CHUNK)
    e = c * CHUNK + offs
    key = tl.load(keys_ptr + row.to(tl.int64) * stride_kt + e, mask=e < length, other=_PAD)
    valid = key != _PAD
    u = _score_field(key)
    bins = tl.arange(0, 1 << DIGIT)
    group = tl.sum(valid.to(tl.int32), 0)
    need = tl.minimum(k, group)
    prefix = (row * 0).to(tl.uint32)
    shift = row * 0 + 32
    while (shift > 0) & (need < group) & (need > 0):
        bits = tl.minimum(shift, DIGIT)  # the last digit is short when DIGIT does not divide 32
        shift -= bits
        top = u >> shift
        inside = valid & ((top >> bits) == prefix)
        hist = tl.histogram((top & ((1 << bits) - 1)).to(tl.int32), 1 << DIGIT, mask=inside)
        from_top = tl.cumsum(hist, 0, reverse=True)  # keys in this bin or higher ones
        hit = (from_top - hist < need) & (from_top >= need)  # exactly one bin
        # The bin, the keys above it and its count in one reduction (each < 2^20).
        fields = (bins.to(tl.int64) << 40) | ((from_top - hist).to(tl.int64) << 20) | hist
        pick = tl.sum(tl.where(hit, fields, 0), 0)
        b = pick >> 40
        need -= ((pick >> 20) & 0xFFFFF).to(tl.int32)
        group = (pick & 0xFFFFF).to(tl.int32)
        prefix = (prefix << bits) + b.to(tl.uint32)
    # u >> shift in two halves: a shift by 32 (no pass ran) is undefined.
    level = (u >> (shift // 2)) >> (shift - shift // 2)
    tie = valid & (level == prefix)
    higher = valid & (level > prefix)
    # One scan for both counts: ties in the low 16 bits, higher keys above.
    counts = tl.cumsum(tie.to(tl.int32) + (higher.to(tl.int32) << 16), 0)
    ties_before = (counts & 0xFFFF) - tie.to(tl.int32)
    sel = higher | (tie & (ties_before < need))
    pos = (counts >> 16) - higher.to(tl.int32) + tl.minimum(ties_before, need)
    taken = tl.sum(sel.to(tl.int32), 0)
    kk = tl.arange(0, K_POW2)
    if FINAL:
        chosen_row = chosen_ptr + row.to(tl.int64) * stride_ct
        tl.store(chosen_row + pos, key, mask=sel)
        tl.debug_barrier()  # the compacted keys, stored by all threads, are read back
        best = tl.sort(tl.load(chosen_row + kk, mask=kk < taken, other=_PAD), descending=True)
        low = best - ((best >> 32) << 32)
        ids = 4294967296 - (low + 1)
        ids = tl.where(((best >> 32) == _NEG_INF_HI) | (kk >= taken), -1, ids)
        tl.store(out_ptr + row.to(tl.int64) * stride_ot + kk, ids, mask=kk < TOPK)
    else:
        out_chunk = out_ptr + row.to(tl.int64) * stride_ot + c * K_POW2
        tl.store(out_chunk + pos, key, mask=sel)
        tl.store(out_chunk + kk, tl.full([K_POW2], _PAD, tl.int64), mask=kk >= taken)


def _select_chunks(topk: int, chunk: int | None) -> tuple[int, int]:
    """(chunk, final): keys per program of the levels that keep k per chunk
    (each at least halves its input) and of the last level."""
    least = 2 * triton.next_power_of_2(topk)
    chunk = max(chunk or _SELECT_CHUNK, least)
    return chunk, max(min(_FINAL_CHUNK, chunk), least)


def _select_lengths(num_entries: int, topk: int, chunk: int | None) -> list[int]:
    """Keys per row of each select level's input: the entries, then
    K_POW2 slots per chunk of the level before, until the last level's
    chunk holds them."""
    chunk, final = _select_chunks(topk, chunk)
    lengths = [num_entries]
    while lengths[-1] > final:
        lengths.append(triton.cdiv(lengths[-1], chunk) * triton.next_power_of_2(topk))
    return lengths


def select_scratch(n: int, num_entries: int, topk: int, chunk: int | None = None) -> list:
    """(shape, dtype) of select_topk's scratch for n rows of num_entries
    keys: the final level's sort buffer, then each later level's input."""
    return [((n, triton.next_power_of_2(topk)), torch.int64)] + [
        ((n, length), torch.int64) for length in _select_lengths(num_entries, topk, chunk)[1:]
    ]


def select_topk(
    keys: torch.Tensor,
    topk: int,
    buffers: list[torch.Tensor] | None = None,
    *,
    out: torch.Tensor | None = None,
    chunk: int | None = None,
    num_warps: int | None = None,
    digit: int | None = None,
) -> torch.Tensor:
    """int64 [n, topk] entry ids of the min(topk, E) largest packed keys
    [n, E >= 1] per row, largest first, -1 for -inf scores and past E: what
    unpack_picks(torch.topk(keys, ...).values) gives; into `out` (rows of
    contiguous ids) when given. buffers: tensors of select_scratch's specs
    (allocated when None). chunk / num_warps / digit override the defaults
    (tests, benchmarks).

    A tree of selects (module docstring): each level keeps the top k of
    every chunk of its input, so the next level's input is k slots per chunk,
    until one chunk holds the row and the last level sorts its picks."""
    n, num_entries = keys.shape
    if buffers is None:
        buffers = [torch.empty(shape, dtype=dtype, device=keys.device)
                   for shape, dtype in select_scratch(n, num_entries, topk, chunk)]  # fmt: skip
    if out is None:
        out = torch.empty(n, topk, dtype=torch.int64, device=keys.device)
    elif out.shape != (n, topk) or out.stride(1) != 1:
        raise ValueError(f"indexer: out {tuple(out.shape)} must be [{n}, {topk}], rows contiguous")
    if not n:
        return out
    chosen, *levels = buffers
    lengths = _select_lengths(num_entries, topk, chunk)
    chunk, final = _select_chunks(topk, chunk)
    meta = dict(TOPK=topk, K_POW2=triton.next_power_of_2(topk), DIGIT=digit or _DIGIT,
                num_warps=num_warps or _SELECT_WARPS)  # fmt: skip
    k = min(topk, num_entries)
    src = keys
    for length, dst in zip(lengths[:-1], levels, strict=True):  # every level but the last
        _select_kernel[(triton.cdiv(length, chunk), n)](
            src, dst, chosen, length, k, src.stride(0), dst.stride(0), chosen.stride(0),
            CHUNK=chunk, FINAL=False, **meta,
        )  # fmt: skip
        src = dst
    _select_kernel[(1, n)](
        src, out, chosen, lengths[-1], k, src.stride(0), out.stride(0), chosen.stride(0),
        CHUNK=final, FINAL=True, **meta,
    )  # fmt: skip
    return out
