"""Fused-MoE tile choice: which tiles, warps, stages, program order and load
mode (pointers or TMA) each of the two grouped GEMMs of kernels/moe/triton.py
uses, by size class of the step's token count. Pure host arithmetic, no
triton import: the engine's warmup asks it which token counts to run
(`moe_token_classes`) without loading any kernel.
"""

from __future__ import annotations

from typing import Any

GEMMS = ("gate_up", "down")
_FIELDS = ("block_m", "block_n", "block_k", "num_warps", "num_stages", "group_m", "tma", "tail_m")
# "tma": how a GEMM loads its operands (Hopper's tensor memory accelerator,
# through host-built tensor descriptors, vs pointer loads / cp.async):
TMA_OFF = 0  # both operands through pointers
TMA_W = 1  # the weight tiles through a descriptor, the activations through pointers
TMA_AW = 2  # both through descriptors; gate_up first copies x into sorted-row
#             order (a workspace buffer [M, D], _gather_kernel) so its A tiles
#             are contiguous row blocks; down's A (act) already is.
TMA_MODES = (TMA_OFF, TMA_W, TMA_AW)


# "tail_m": with TMA activation loads, an expert's last M-block also computes up
# to tail_m rows past its block_m main rows, reusing each loaded weight tile
# (kernels/moe/triton.py, "Tails"); 0 = off (every block is block_m rows).


def _gemm(bm: int, bn: int, bk: int, warps: int, stages: int, group_m: int,
          tma: int = TMA_OFF, tail_m: int = 0) -> dict[str, int]:  # fmt: skip
    return dict(zip(_FIELDS, (bm, bn, bk, warps, stages, group_m, tma, tail_m), strict=True))


# Size classes by the mean rows per expert, M / E (M = T*K pairs): class c
# starts at M >= CLASS_ROWS[c - 1] * E. DeepSeek-V3 (E=256, K=8): class 0 is
# T < 512 (decode and small prefill: weight-bandwidth bound, 16-row blocks,
# each expert's weights read once), class 1 is 512 <= T < 2048, class 2 is
# T >= 2048 (compute matters: 128-row tiles, grouped program order).
# gate_up holds two accumulators (gate and up), so its BLOCK_N is half the
# effective tile width. The tiles and group_m are the sweep's picks
# (benchmarks/sweep_moe.py, DeepSeek-V3 dims), which stream the touched
# weights near the copy bandwidth at T=1 and T=16. Class 2 loads both
# operands by TMA (tma=2: both GEMMs beat pointer loads at T=4096) and runs
# tails (tail_m=64): an expert's last block takes up to 64 rows past its 128,
# so ~128 rows per expert need one block, not two, which also makes a short
# program order best (group_m 2 and 4, from order runs at T=2048/4096/8192).
# docs/benchmarks.md has the figures.
CLASS_ROWS = (16, 64)
CLASS_CONFIGS: tuple[dict[str, dict[str, int]], ...] = (
    {"gate_up": _gemm(16, 128, 128, 4, 3, 0), "down": _gemm(16, 128, 128, 4, 4, 0)},
    {"gate_up": _gemm(32, 64, 64, 4, 4, 1), "down": _gemm(32, 128, 64, 4, 3, 1)},
    {
        "gate_up": _gemm(128, 128, 64, 8, 4, 2, tma=2, tail_m=64),
        "down": _gemm(128, 256, 64, 8, 4, 4, tma=2, tail_m=64),
    },
)


def moe_size_class(num_tokens: int, top_k: int, num_experts: int) -> int:
    """0, 1 or 2: which CLASS_CONFIGS entry serves T tokens."""
    pairs = num_tokens * top_k
    return sum(pairs >= rows * num_experts for rows in CLASS_ROWS)


def moe_config(num_tokens: int, top_k: int, num_experts: int, hidden: int,
               inter: int, elem_bytes: int = 2) -> dict[str, dict[str, int]]:  # fmt: skip
    """Tiles for both GEMMs, from host ints only: {"gate_up": {...}, "down":
    {...}}, each with block_m/n/k, num_warps, num_stages, group_m, tma. The class's
    tiles, with BLOCK_N and BLOCK_K cut to the (power-of-two-rounded) matrix
    sizes for small models (and half the stages for 4-byte elements); for a
    given model that is still one variant per class, so at most
    len(CLASS_CONFIGS) compiled variants per kernel."""
    cls = CLASS_CONFIGS[moe_size_class(num_tokens, top_k, num_experts)]
    sizes = {"gate_up": (inter, hidden), "down": (hidden, inter)}  # (N, K)
    out = {}
    for gemm in GEMMS:
        n, k = sizes[gemm]
        c = dict(cls[gemm])
        c["block_n"] = min(c["block_n"], max(16, _next_power_of_2(n)))
        c["block_k"] = min(c["block_k"], max(16, _next_power_of_2(k)))
        if elem_bytes > 2:
            # fp32 (tests, references): half the pipeline stages keep the
            # shared memory at or below the bf16 tiles' (which fit); e.g.
            # class 0's gate_up ring is ~204 KB in bf16, ~408 KB in fp32.
            c["num_stages"] = max(1, c["num_stages"] // 2)
            # ...and no tails: class 2's fp32 ring with the tail tile needs
            # 240 KB of shared memory, past the 227 KB a block may use on sm_90.
            c["tail_m"] = 0
        out[gemm] = c
    return out


def moe_token_classes(max_num_tokens: int, top_k: int, num_experts: int) -> list[int]:
    """One token count per size class reachable with at most max_num_tokens
    tokens (the smallest of each class), for the engine's warmup: running
    fused_moe once at each compiles every variant a later step can pick."""
    firsts = [1] + [-(-rows * num_experts // top_k) for rows in CLASS_ROWS]
    return sorted({t for t in firsts if t <= max_num_tokens})


def _resolve(base: dict[str, dict[str, int]], override: dict[str, Any] | None) -> dict:
    """base with override's fields laid over it (override may name one GEMM
    and only some fields); unknown names raise."""
    out = {gemm: dict(base[gemm]) for gemm in GEMMS}
    for gemm, fields in (override or {}).items():
        if gemm not in out:
            raise ValueError(f"fused_moe config: unknown GEMM {gemm!r}; use {list(GEMMS)}")
        unknown = set(fields) - set(_FIELDS)
        if unknown:
            raise ValueError(f"fused_moe config[{gemm!r}]: unknown fields {sorted(unknown)}")
        out[gemm].update(fields)
    for gemm, c in out.items():
        if c["tma"] not in TMA_MODES:
            raise ValueError(f"fused_moe config[{gemm!r}]['tma']={c['tma']!r}: one of {TMA_MODES}")
        tail = c["tail_m"]
        if tail and (tail < 16 or tail & (tail - 1) or tail > c["block_m"]):
            raise ValueError(f"fused_moe config[{gemm!r}]['tail_m']={tail}: 0 or a power of "
                             f"two >= 16 and <= block_m ({c['block_m']})")  # fmt: skip
        for name in ("block_m", "block_n", "block_k"):
            v = c[name]
            if v < 16 or v & (v - 1):
                raise ValueError(f"fused_moe config[{gemm!r}][{name!r}]={v}: "
                                 "a power of two >= 16 (tl.dot's minimum)")  # fmt: skip
    return out


def max_m_blocks(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Upper bound on sum_e cdiv(count_e, block_m) over any routing: at most
    min(E, M) experts are non-empty and each wastes < block_m rows."""
    return (num_pairs + min(num_experts, num_pairs) * (block_m - 1)) // block_m


def _next_power_of_2(n: int) -> int:
    return 1 << (n - 1).bit_length() if n > 1 else 1
