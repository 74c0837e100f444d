"""The fused-MoE sweep's tile grid (benchmarks/sweep_moe.py): which tiles each
GEMM of each size class times, which are pruned (shared memory, accumulator
registers) and why, how a tile prints; the --dry-run listing and its --check
of every listed tile against the torch reference; and the parallel compile
workers that fill Triton's on-disk cache before the timing starts.
"""

from __future__ import annotations

import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root

import torch  # noqa: E402
from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: E402

import tinyengine.kernels.moe.reference as moe_ref  # noqa: E402
import tinyengine.kernels.moe.triton as tm  # noqa: E402

SMEM_LIMIT = 232448  # bytes of shared memory one block may use on Hopper (227 KB)
ACC_REGS_LIMIT = 128  # fp32 accumulator registers per thread beyond which spills loom
GROUP_MS = (0, 1, 2, 4, 8, 16, 32, 64)

# ----------------------------------------------------------------------------- the grid


def _tile(bm: int, bn: int, bk: int, warps: int, stages: int, group_m: int,
          tma: int = 0, tail_m: int = 0) -> dict[str, int]:  # fmt: skip
    return dict(block_m=bm, block_n=bn, block_k=bk, num_warps=warps, num_stages=stages,
                group_m=group_m, tma=tma, tail_m=tail_m)  # fmt: skip


def smem_bytes(gemm: str, c: dict[str, int]) -> int:
    """The software pipeline's buffers, bf16: (x/act tile + weight tile(s)) per
    buffer; num_stages buffers where Hopper's wgmma runs (BLOCK_M >= 64),
    num_stages - 1 for mma.sync (as Triton 3.9 compiles them for sm_90)."""
    n_w = 2 if gemm == "gate_up" else 1  # gate_up loads a gate and an up tile
    rows = c["block_m"] + c["tail_m"]  # a tail's activation tile is loaded too
    per_stage = rows * c["block_k"] + n_w * c["block_k"] * c["block_n"]
    bufs = c["num_stages"] if c["block_m"] >= 64 else c["num_stages"] - 1
    return bufs * per_stage * 2


def acc_regs(gemm: str, c: dict[str, int]) -> int:
    n_acc = 2 if gemm == "gate_up" else 1
    return n_acc * c["block_m"] * c["block_n"] // (32 * c["num_warps"])


def candidates(cls: int, gemm: str, heur: dict[str, int]) -> tuple[list[dict], list]:
    """(tiles to time, [(pruned tile, why)]) for one GEMM of one size class.
    The heuristic's own tile (moe_config's pick) comes first."""
    if cls == 0:  # few rows per expert: weight streaming; 16-row blocks
        tiles = [_tile(16, bn, bk, 4, st, 0) for bn in (32, 64, 128) for bk in (64, 128)
                 for st in (3, 4)]  # fmt: skip
    elif cls == 1:
        tiles = [_tile(bm, bn, 64, 4, st, 8) for bm in (16, 32, 64) for bn in (64, 128)
                 for st in (3, 4)]  # fmt: skip
    else:
        if gemm == "gate_up":  # two accumulators: BLOCK_N is half the tile width
            shapes = [(64, 64, 4), (64, 128, 4), (64, 128, 8), (128, 64, 4), (128, 64, 8),
                      (128, 128, 8), (64, 256, 8)]  # fmt: skip
        else:
            shapes = [(64, 128, 4), (64, 256, 4), (64, 256, 8), (128, 128, 4), (128, 128, 8),
                      (128, 256, 8)]  # fmt: skip
        tiles = [_tile(bm, bn, 64, w, st, 8) for bm, bn, w in shapes for st in (3, 4)]
        # TMA (tinyengine/kernels/moe/triton.py's "tma"): 1 = weight tiles through tensor
        # descriptors, 2 = activations too (gate_up then gathers x into sorted
        # order first; its timing includes that gather). Around the pointer
        # path's best 128-row tiles.
        tma_bns = (128, 256)  # gate_up bn256 = 256 acc regs/thread: listed, pruned
        tiles += [_tile(128, bn, 64, 8, st, 8, tma) for tma in (1, 2) for bn in tma_bns
                  for st in (3, 4)]  # fmt: skip
        # Tails (tail_m: an expert's last block also computes up to 64 rows
        # past its 128, reusing the weight tiles): TMA activations only.
        tiles += [_tile(128, bn, 64, 8, st, 8, 2, 64) for bn in tma_bns for st in (3, 4)]
        # 64-row TMA tiles: at ~128 rows per expert (T=4096) a 128-row tile
        # pads about half the experts to a second, nearly empty tile; 64-row
        # tiles halve that padding (more weight re-reads, from L2 when grouped).
        tiles += [_tile(64, bn, 64, w, st, 8, 2) for bn, w in ((128, 4), (128, 8), (256, 4),
                  (256, 8)) for st in (3, 4, 5)]  # fmt: skip
    keep, pruned = [dict(heur)], []
    for c in tiles:
        if tile_key(c) == tile_key(heur):
            continue
        if smem_bytes(gemm, c) > SMEM_LIMIT:
            pruned.append((c, f"smem {smem_bytes(gemm, c) // 1024} KB"))
        elif acc_regs(gemm, c) > ACC_REGS_LIMIT:
            pruned.append((c, f"{acc_regs(gemm, c)} acc regs/thread"))
        else:
            keep.append(c)
    return keep, pruned


def tile_key(c: dict[str, int]) -> tuple[int, ...]:
    """What a compiled variant depends on (group_m is a runtime argument)."""
    return (c["block_m"], c["block_n"], c["block_k"], c["num_warps"], c["num_stages"],
            c["tma"], c["tail_m"])  # fmt: skip


def fmt(c: dict[str, int]) -> str:
    return (f"bm{c['block_m']:<3} bn{c['block_n']:<3} bk{c['block_k']:<3} "
            f"w{c['num_warps']} s{c['num_stages']} g{c['group_m']:<2} "
            f"{'tma' + str(c['tma']) if c['tma'] else 'ptr '}"
            f"{' t' + str(c['tail_m']) if c['tail_m'] else ''}")  # fmt: skip


def as_code(c: dict[str, int]) -> str:
    fields = ("block_m", "block_n", "block_k", "num_warps", "num_stages", "group_m")
    tma = f", tma={c['tma']}" if c["tma"] else ""
    tail = f", tail_m={c['tail_m']}" if c["tail_m"] else ""
    return f"_gemm({', '.join(str(c[f]) for f in fields)}{tma}{tail})"


# ----------------------------------------------------------------------------- dry run


def dry_run(tokens: list[int], check: bool, e: int, k: int, d: int, i: int) -> None:
    """List, per token count, the tiles each GEMM would time (and the pruned
    ones, with why) at E=e experts, top-k, hidden d, expert width i."""
    variants: dict[tuple, dict] = {}
    n_meas = 0
    for t in tokens:
        cls = tm.moe_size_class(t, k, e)
        heur = tm.moe_config(t, k, e, d, i)
        print(f"\n## T={t}  class {cls}  M={t * k}  rows/expert {t * k / e:.1f}")
        for gemm in tm.GEMMS:
            keep, pruned = candidates(cls, gemm, heur[gemm])
            print(f"  {gemm:7s} heuristic {fmt(heur[gemm])}  -> {len(keep)} tiles, "
                  f"+{len(GROUP_MS) - 1 if cls else 0} group_m runs")  # fmt: skip
            for c in keep:
                variants.setdefault((gemm, tile_key(c)), c)
                print(f"      {fmt(c)}  smem {smem_bytes(gemm, c) // 1024:3d} KB  "
                      f"acc regs {acc_regs(gemm, c)}")  # fmt: skip
            for c, why in pruned:
                print(f"    - {fmt(c)}  pruned: {why}")
            n_meas += len(keep) + (len(GROUP_MS) - 1 if cls else 0)
        n_meas += 4  # heuristic full, best full, grouping, reduction
    firsts = tm.moe_token_classes(1 << 30, k, e)
    print(f"\nclass boundaries checked at T = "
          f"{sorted({t for f in firsts[1:] for t in (f // 2, f, 2 * f)})}")  # fmt: skip
    n_meas += 6 * (len(firsts) - 1)
    est = 15 + 0.4 * n_meas + 1.5 * len(variants) / 12
    print(f"\n{len(variants)} compiled GEMM variants, ~{n_meas} timings: "
          f"~{est:.0f} s on an H200 with --jobs 12 (budget cuts at --budget)")  # fmt: skip
    if check:
        check_configs(list(variants.items()))


def check_configs(variants: list) -> None:
    """Each variant at tiny dims (D=256, I=128, E=8, K=2, T=24) vs the torch
    reference: the interpreter on CPU (TRITON_INTERPRET=1), the GPU otherwise."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    if dev == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("--check on CPU needs TRITON_INTERPRET=1 in the environment")
    g = torch.Generator().manual_seed(0)
    t, d, i, e, k = 24, 256, 128, 8, 2
    x = torch.randn(t, d, generator=g).to(dev)
    w13 = (torch.randn(e, 2 * i, d, generator=g) * d**-0.5).to(dev)
    w2 = (torch.randn(e, d, i, generator=g) * i**-0.5).to(dev)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)]).to(dev)
    ids[: t // 2, 0] = 3  # one expert with several blocks, others empty-ish
    ids[: t // 2, 1] = 5
    weights = torch.rand(t, k, generator=g).to(dev)
    ref = moe_ref.fused_moe(x, w13, w2, weights, ids)
    bad = 0
    for (gemm, _), c in variants:
        out = tm.launch_fused_moe(x, w13, w2, weights, ids, config={gemm: c})
        err = ((out - ref).norm() / ref.norm()).item()
        ok = err < 1e-4 and not out.isnan().any()
        bad += not ok
        print(f"check {gemm:7s} {fmt(c)}  rel err {err:.1e}  {'ok' if ok else 'BAD'}")
    print(f"checked {len(variants)} variants: {bad} bad")
    if bad:
        sys.exit(1)


# ----------------------------------------------------------------------------- compile workers


class _DescSpec(tuple):
    """A picklable stand-in for a TensorDescriptor: (dtype, shape, strides, block)."""


def _plain(a):
    """A launch argument as a spawned compile worker can take it."""
    if isinstance(a, torch.Tensor):
        return a.dtype
    if isinstance(a, TensorDescriptor):
        return _DescSpec((a.base.dtype, list(a.shape), list(a.strides), list(a.block_shape)))
    return a


def _compile_worker(name: str, args: tuple, kwargs: dict) -> str | None:
    """In a spawned process: compile one variant into Triton's on-disk cache
    (kernel.warmup takes dtypes for tensors and launches nothing; a descriptor
    only needs its dtype and block shape, so it is rebuilt over a MockTensor)."""
    try:
        from triton.runtime.jit import MockTensor

        args = tuple(TensorDescriptor(MockTensor(a[0], a[1]), *a[1:])
                     if isinstance(a, _DescSpec) else a for a in args)  # fmt: skip
        getattr(tm, name).warmup(*args, grid=(1,), **kwargs)
        return None
    except Exception as err:  # noqa: BLE001 - reported, then retried (and reported) at launch
        return f"{type(err).__name__}: {str(err).splitlines()[0][:160] if str(err) else ''}"


def precompile(launches: list[tuple[str, list]], jobs: int) -> None:
    """launches: [(label, [(kernel, grid, args, kwargs), ...])]."""
    t0 = time.time()
    specs = []
    for label, group in launches:
        for kernel, _grid, args, kwargs in group:
            specs.append((f"{label} [{kernel.__name__}]", kernel.__name__,
                          tuple(_plain(a) for a in args), kwargs))  # fmt: skip
    failed = 0
    try:
        import multiprocessing

        ctx = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(jobs, mp_context=ctx) as pool:
            futs = {pool.submit(_compile_worker, name, a, kw): lbl for lbl, name, a, kw in specs}
            for fut in as_completed(futs):
                err = fut.result()
                if err:
                    failed += 1
                    print(f"  compile FAILED {futs[fut]}: {err}")
    except Exception as err:  # noqa: BLE001 - the sweep still runs, compiling lazily
        print(f"# precompile unavailable ({type(err).__name__}: {err}); compiling lazily")
        return
    print(f"# precompiled {len(specs)} variants in {time.time() - t0:.1f} s "
          f"({jobs} processes, {failed} failed)", flush=True)  # fmt: skip
