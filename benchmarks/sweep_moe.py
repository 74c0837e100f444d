"""Fused-MoE tile sweep at DeepSeek-V3 dims on one GPU (prints figures; not a test).

    python benchmarks/sweep_moe.py             # the GPU run, a few minutes
    python benchmarks/sweep_moe.py --dry-run   # anywhere: list what would run

CPU self-checks (the Triton interpreter, tiny dims E=8 K=2 D=64 I=32 or so):
    TRITON_INTERPRET=1 python benchmarks/sweep_moe.py --dry-run --check
        every listed config vs the torch reference;
    TRITON_INTERPRET=1 python benchmarks/sweep_moe.py --smoke --tokens 4,64,256
        the GPU path end to end (timings are one interpreted call: meaningless).

256 experts, top-8, hidden D=7168, expert width I=2048, bf16 (the weights,
22.5 GB, are allocated once and shared by every token count). For each token
count T (default 4096, 8192, 512, 1, 16, 64: the target first, so a budget
cut drops the least important ones) it prints

  - the full fused_moe with the heuristic tiles (tinyengine/kernels/moe/tiles.py: moe_config),
    checked against the torch reference: us, TB/s of touched expert weights,
    TFLOP/s (2*T*K*3*I*D);
  - the grouping (sort + histogram) and the per-token reduction alone;
  - each GEMM alone for a pruned grid of tiles of T's size class, checked
    against the heuristic's output; then program-order runs (group_m) for the
    best tile; then the full op with both best tiles. Class 2 (large T) also
    times TMA variants of the 128-row tiles ("tma": 1 = weights through
    tensor descriptors, 2 = activations too, gate_up's time including the
    gather of x into sorted order), and prints per GEMM the best of each load
    mode ("TMA vs pointers");

and a summary: per T heuristic vs best, a TMA-vs-pointers table (class 2),
and per size class the tiles that
are best across the class's token counts, as a CLASS_CONFIGS snippet; last,
around each class boundary (CLASS_ROWS) the full op with either side's
suggested tiles.

Timing: triton.testing.do_bench_cudagraph (CUDA-graph replays), median.
Every tile variant is compiled first in parallel worker processes (Triton's
on-disk cache; the measuring process then only loads the binaries).
Compile/launch failures are caught and printed. A time budget (--budget)
skips what is left once it is spent; the summary still prints.

Uses tinyengine/kernels/moe/triton.py's private launch helpers (_scratch, _group,
_gate_up_launch, _down_launch, _sum_topk) to time one GEMM at a time.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root

import torch  # noqa: E402
from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: E402

import tinyengine.kernels.moe.reference as moe_ref  # noqa: E402
import tinyengine.kernels.moe.triton as tm  # noqa: E402
from tinyengine.kernels.workspace import Workspace  # noqa: E402

E, K, D, I = 256, 8, 7168, 2048
DEV = "cuda"  # --smoke: "cpu" (and tiny E, K, D, I)
TOKENS = (4096, 8192, 512, 1, 16, 64)
SMEM_LIMIT = 232448  # bytes of shared memory one block may use on Hopper (227 KB)
ACC_REGS_LIMIT = 128  # fp32 accumulator registers per thread beyond which spills loom
GROUP_MS = (0, 1, 2, 4, 8, 16, 32, 64)
START = time.time()

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


def dry_run(tokens: list[int], check: bool) -> None:
    variants: dict[tuple, dict] = {}
    n_meas = 0
    for t in tokens:
        cls = tm.moe_size_class(t, K, E)
        heur = tm.moe_config(t, K, E, D, I)
        print(f"\n## T={t}  class {cls}  M={t * K}  rows/expert {t * K / E:.1f}")
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
    firsts = tm.moe_token_classes(1 << 30, K, E)
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


# ----------------------------------------------------------------------------- GPU


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


class Sweep:
    def __init__(self, rep: int, budget: float) -> None:
        if DEV == "cuda":
            from triton.testing import do_bench_cudagraph

            self._bench = do_bench_cudagraph
        else:  # --smoke: one call, wall clock
            self._bench = _one_call
        self.rep = rep
        self.budget = budget
        self.skipped = 0
        torch.manual_seed(0)
        t0 = time.time()
        self.w13 = torch.empty(E, 2 * I, D, device=DEV, dtype=torch.bfloat16).normal_(0, 0.02)
        self.w2 = torch.empty(E, D, I, device=DEV, dtype=torch.bfloat16).normal_(0, 0.02)
        _sync()
        print(f"# weights {2 * (self.w13.numel() + self.w2.numel()) / 1e9:.1f} GB "
              f"in {time.time() - t0:.1f} s", flush=True)  # fmt: skip
        self.ws = Workspace(DEV)
        # results[t] = dict(cls, heur_ms, best_ms, group_ms, sum_ms, gemm={gemm: {key: (ms, cfg)}},
        #                   group_m={gemm: {g: ms}}, touched)
        self.results: dict[int, dict] = {}

    def out_of_time(self) -> bool:
        return time.time() - START > self.budget

    def bench(self, fn) -> float:
        return self._bench(fn, rep=self.rep, return_mode="median")

    def routing(self, t: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        g = torch.Generator(device=DEV).manual_seed(t)
        x = torch.randn(t, D, device=DEV, generator=g).bfloat16()
        weights, ids = torch.rand(t, E, device=DEV, generator=g).topk(K, dim=-1)
        return x, weights, ids

    def gemm_launch(self, gemm: str, x, s, c: dict[str, int]):
        if gemm == "gate_up":
            return tm._gate_up_launch(x, self.w13, s, K, c)
        return tm._down_launch(self.w2, s, c)

    def all_launches(self, tokens: list[int]) -> list:
        x, _, ids = self.routing(1)
        s = tm._scratch(x, self.w13, self.w2, ids, None, sorted_x=True)
        seen, out = set(), []
        for t in tokens:
            cls = tm.moe_size_class(t, K, E)
            heur = tm.moe_config(t, K, E, D, I)
            for gemm in tm.GEMMS:
                for c in candidates(cls, gemm, heur[gemm])[0]:
                    if (gemm, tile_key(c)) not in seen:
                        seen.add((gemm, tile_key(c)))
                        out.append((f"{gemm} {fmt(c)}", self.gemm_launch(gemm, x, s, c)))
        return out

    def run_tokens(self, t: int) -> None:
        cls = tm.moe_size_class(t, K, E)
        x, weights, ids = self.routing(t)
        touched = ids.unique().numel()
        heur = tm.moe_config(t, K, E, D, I)
        r = self.results[t] = dict(cls=cls, touched=touched, gemm={g: {} for g in tm.GEMMS},
                                   group_m={g: {} for g in tm.GEMMS})  # fmt: skip
        flops = {"gate_up": 2 * t * K * 2 * I * D, "down": 2 * t * K * D * I}
        wbytes = {"gate_up": touched * 2 * I * D * 2, "down": touched * D * I * 2}
        print(f"\n## T={t}  class {cls}  M={t * K}  rows/expert {t * K / E:.1f}  "
              f"experts touched {touched}", flush=True)  # fmt: skip

        def line(label: str, ms: float, gemm: str | None = None, extra: str = "") -> None:
            fl = flops[gemm] if gemm else sum(flops.values())
            by = wbytes[gemm] if gemm else sum(wbytes.values())
            print(f"  {label:44s} {ms * 1e3:9.1f} us  {by / ms / 1e9:5.2f} TB/s  "
                  f"{fl / ms / 1e9:6.1f} TFLOP/s {extra}", flush=True)  # fmt: skip

        ref = moe_ref.fused_moe(x, self.w13, self.w2, weights, ids)

        def full(cfg=None) -> torch.Tensor:
            return tm.launch_fused_moe(
                x, self.w13, self.w2, weights, ids, workspace=self.ws, config=cfg
            )

        def err_of(out: torch.Tensor, want: torch.Tensor) -> float:
            return ((out.float() - want.float()).norm() / want.float().norm()).item()

        err = err_of(full(), ref)
        r["heur_ms"] = self.bench(full)
        line("fused_moe, heuristic tiles", r["heur_ms"], extra=f" rel err vs torch {err:.1e}")

        # Grouping and reduction alone, then each GEMM alone on fixed scratch.
        s = tm._scratch(x, self.w13, self.w2, ids, None, sorted_x=True)
        out = torch.empty(t, D, device=DEV, dtype=torch.bfloat16)
        tm._group(ids, s)
        r["group_ms"] = self.bench(lambda s=s: tm._group(ids, s))
        tm._run(self.gemm_launch("gate_up", x, s, heur["gate_up"]))
        act_ref = s.act.clone()
        tm._run(self.gemm_launch("down", x, s, heur["down"]))
        y_ref = s.y.clone()
        r["sum_ms"] = self.bench(lambda s=s: tm._sum_topk(s.y, weights, out))
        share = (r["group_ms"] + r["sum_ms"]) / r["heur_ms"]
        print(f"  grouping (sort+histogram) {r['group_ms'] * 1e3:7.1f} us, reduction "
              f"{r['sum_ms'] * 1e3:7.1f} us: {100 * share:4.1f}% of the heuristic "
              "total")  # fmt: skip

        for gemm in tm.GEMMS:
            want = act_ref if gemm == "gate_up" else y_ref
            got = s.act if gemm == "gate_up" else s.y
            s.act.copy_(act_ref)
            keep, _ = candidates(cls, gemm, heur[gemm])
            for c in keep:
                if self.out_of_time():
                    self.skipped += 1
                    continue
                launch = self.gemm_launch(gemm, x, s, c)
                t_first = time.time()
                try:
                    tm._run(launch)
                    _sync()
                    t_first = time.time() - t_first
                except Exception as exc:  # noqa: BLE001 - compile/launch failure: report, go on
                    print(f"  {gemm:7s} {fmt(c)}  FAILED {type(exc).__name__}: "
                          f"{str(exc).splitlines()[0][:120] if str(exc) else ''}")  # fmt: skip
                    continue
                rel = err_of(got, want)
                ms = self.bench(lambda launch=launch: tm._run(launch))
                mark = " <- heuristic" if c == heur[gemm] else ""
                if t_first > 0.5:  # not found in the precompiled cache
                    mark += f" (first launch {t_first:.1f} s)"
                if rel > 1e-2:
                    mark += f"  MISMATCH rel err {rel:.1e} (excluded)"
                else:
                    r["gemm"][gemm][tile_key(c)] = (ms, c)
                line(f"{gemm:7s} {fmt(c)}", ms, gemm, mark)
            if not r["gemm"][gemm] or cls == 0:
                continue  # decode: one block per expert, the order hardly matters
            best_ms, best = min(r["gemm"][gemm].values(), key=lambda v: v[0])
            r["group_m"][gemm][best["group_m"]] = best_ms
            for gm in GROUP_MS:
                if gm == best["group_m"] or self.out_of_time():
                    continue
                c = dict(best, group_m=gm)
                launch = self.gemm_launch(gemm, x, s, c)
                ms = self.bench(lambda launch=launch: tm._run(launch))
                r["group_m"][gemm][gm] = ms
                line(f"{gemm:7s} {fmt(c)}", ms, gemm, " (order)")
        s.act.copy_(act_ref)
        r["by_mode"] = self.report_modes(r)

        best_cfg = {}
        for gemm in tm.GEMMS:
            if not r["gemm"][gemm]:
                best_cfg[gemm] = heur[gemm]
                continue
            _, c = min(r["gemm"][gemm].values(), key=lambda v: v[0])
            orders = r["group_m"][gemm]
            best_cfg[gemm] = dict(c, group_m=min(orders, key=orders.get)) if orders else c
        err = err_of(full(best_cfg), ref)
        r["best_ms"] = self.bench(lambda: full(best_cfg))
        r["best_cfg"] = best_cfg
        line("fused_moe, best tiles", r["best_ms"], extra=f" rel err vs torch {err:.1e}")
        print(f"    best gate_up {fmt(best_cfg['gate_up'])} | down {fmt(best_cfg['down'])}")

    @staticmethod
    def report_modes(r: dict) -> dict:
        """Per GEMM, the best tile of each load mode (pointers, tma1, tma2):
        {gemm: {mode: (ms, cfg)}}; printed with the pointer path as baseline."""
        by_mode: dict = {}
        for gemm in tm.GEMMS:
            modes: dict = {}
            for ms, c in r["gemm"][gemm].values():
                m = c.get("tma", 0)
                if m not in modes or ms < modes[m][0]:
                    modes[m] = (ms, c)
            # The group_m runs of the overall best tile count for its mode.
            if modes and r["group_m"][gemm]:
                best_ms, best_c = min(r["gemm"][gemm].values(), key=lambda v: v[0])
                gm = min(r["group_m"][gemm], key=r["group_m"][gemm].get)
                m = best_c.get("tma", 0)
                if r["group_m"][gemm][gm] < modes[m][0]:
                    modes[m] = (r["group_m"][gemm][gm], dict(best_c, group_m=gm))
            by_mode[gemm] = modes
            if len(modes) < 2:
                continue
            base = modes.get(0, (None, None))[0]
            parts = []
            for m in sorted(modes):
                ms, c = modes[m]
                rel = f" ({base / ms:4.2f}x)" if base and m else ""
                parts.append(f"{'tma' + str(m) if m else 'pointers'} {ms * 1e3:.1f} us{rel}")
            win = min(modes, key=lambda m: modes[m][0])
            print(f"  TMA vs pointers, {gemm:7s}: {' | '.join(parts)}  -> "
                  f"{'tma' + str(win) if win else 'pointers'} fastest: "
                  f"{fmt(modes[win][1])}")  # fmt: skip
        return by_mode

    def summary(self, copy_tbs: float) -> dict:
        print(f"\n## summary (copy bandwidth {copy_tbs:.2f} TB/s read+write)")
        print(f"{'T':>6} {'cls':>3} {'heuristic us':>13} {'TFLOP/s':>8} {'TB/s':>6} "
              f"{'best us':>10} {'TFLOP/s':>8} {'TB/s':>6} {'gain':>6} "
              f"{'group+sum us':>13}")  # fmt: skip
        for t in sorted(self.results):
            r = self.results[t]
            if "best_ms" not in r:
                continue
            fl = 2 * t * K * 3 * I * D
            by = r["touched"] * 3 * I * D * 2
            h, b = r["heur_ms"], r["best_ms"]
            print(f"{t:6d} {r['cls']:3d} {h * 1e3:13.1f} {fl / h / 1e9:8.1f} {by / h / 1e9:6.2f} "
                  f"{b * 1e3:10.1f} {fl / b / 1e9:8.1f} {by / b / 1e9:6.2f} {h / b:6.2f}x "
                  f"{(r['group_ms'] + r['sum_ms']) * 1e3:13.1f}")  # fmt: skip
        rows = [(t, r) for t, r in sorted(self.results.items())
                if any(len(m) > 1 for m in r.get("by_mode", {}).values())]  # fmt: skip
        if rows:
            print("\n## TMA vs pointer loads: best time of each mode per GEMM, us (tma1: "
                  "weights by TMA; tma2: activations too, gate_up incl. its gather)")  # fmt: skip
            for t, r in rows:
                for gemm in tm.GEMMS:
                    modes = r["by_mode"][gemm]
                    cells = "  ".join(f"{'tma' + str(m) if m else 'ptr'} {modes[m][0] * 1e3:8.1f}"
                                      for m in sorted(modes))  # fmt: skip
                    win = min(modes, key=lambda m: modes[m][0])
                    gain = modes[0][0] / modes[win][0] if 0 in modes else float("nan")
                    print(f"  T={t:<6d} {gemm:7s} {cells}   -> {'tma' + str(win) if win else 'ptr'}"
                          f" ({gain:4.2f}x vs ptr)")  # fmt: skip
        print("\n## per size class: tile with the best mean (time / best time) over the class's T")
        snippet = {}
        for cls in range(len(tm.CLASS_CONFIGS)):
            ts = [t for t, r in self.results.items() if r["cls"] == cls and "best_ms" in r]
            if not ts:
                snippet[cls] = tm.CLASS_CONFIGS[cls]
                continue
            snippet[cls] = {}
            for gemm in tm.GEMMS:
                common = set.intersection(*(set(self.results[t]["gemm"][gemm]) for t in ts))
                if not common:
                    snippet[cls][gemm] = tm.CLASS_CONFIGS[cls][gemm]
                    continue

                def score(key, gemm=gemm, ts=ts):
                    return sum(
                        self.results[t]["gemm"][gemm][key][0]
                        / min(v[0] for v in self.results[t]["gemm"][gemm].values())
                        for t in ts
                    ) / len(ts)

                ranked = sorted(common, key=score)
                heur_key = tile_key(tm.CLASS_CONFIGS[cls][gemm])
                for rank, key in enumerate(ranked[:3]):
                    c = self.results[ts[0]]["gemm"][gemm][key][1]
                    print(f"  class {cls} {gemm:7s} #{rank + 1} {fmt(c)} score {score(key):.3f}")
                if heur_key in common:
                    print(f"  class {cls} {gemm:7s} heuristic score {score(heur_key):.3f}")
                best = dict(self.results[ts[0]]["gemm"][gemm][ranked[0]][1])
                # group_m: the order that won most often where this tile was the per-T best.
                wins = []
                for t in ts:
                    orders = self.results[t]["group_m"][gemm]
                    if orders and tile_key(self.results[t]["best_cfg"][gemm]) == ranked[0]:
                        wins.append(min(orders, key=orders.get))
                if wins:
                    best["group_m"] = max(set(wins), key=wins.count)
                snippet[cls][gemm] = best
        print("\nCLASS_CONFIGS = (")
        for cls in range(len(tm.CLASS_CONFIGS)):
            c = snippet[cls]
            print(f'    {{"gate_up": {as_code(c["gate_up"])}, "down": {as_code(c["down"])}}},')
        print(")")
        if self.skipped:
            print(f"# budget: {self.skipped} timings skipped "
                  "(raise --budget or pass fewer --tokens)")  # fmt: skip
        return snippet

    def boundaries(self, snippet: dict) -> None:
        """Around each class boundary (the first T of class c), the full op with
        class c-1's and class c's suggested tiles: is the boundary well placed?"""
        print("\n## class boundaries (CLASS_ROWS): full fused_moe, us, with either side's tiles")
        firsts = tm.moe_token_classes(1 << 30, K, E)
        for c in range(1, len(firsts)):
            for t in (firsts[c] // 2, firsts[c], firsts[c] * 2):
                if self.out_of_time():
                    print("  skipped (budget)")
                    return
                x, weights, ids = self.routing(t)
                ms = []
                for side in (c - 1, c):
                    run = functools.partial(tm.launch_fused_moe, x, self.w13, self.w2, weights, ids,
                                            workspace=self.ws, config=snippet[side])  # fmt: skip
                    ms.append(self.bench(run))
                win = c - 1 if ms[0] < ms[1] else c
                print(f"  T={t:<6d} (class {tm.moe_size_class(t, K, E)})  class {c - 1} "
                      f"tiles {ms[0] * 1e3:9.1f}  class {c} tiles {ms[1] * 1e3:9.1f}  "
                      f"-> class {win}'s")  # fmt: skip


def _sync() -> None:
    if DEV == "cuda":
        torch.cuda.synchronize()


def _one_call(fn, rep: int, return_mode: str) -> float:
    del rep, return_mode
    t0 = time.perf_counter()
    fn()
    return max(time.perf_counter() - t0, 1e-9) * 1e3


def copy_bandwidth(bench) -> float:
    x = torch.empty(2**30 if DEV == "cuda" else 2**20, dtype=torch.uint8, device=DEV)
    y = torch.empty_like(x)
    ms = bench(lambda: y.copy_(x))
    return 2 * x.numel() / ms / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dry-run", action="store_true", help="list configs and timings; run nothing")
    ap.add_argument("--check", action="store_true",
                    help="with --dry-run: every config at tiny dims vs the reference")  # fmt: skip
    ap.add_argument("--tokens", default=",".join(map(str, TOKENS)), help="comma-separated T")
    ap.add_argument("--rep", type=int, default=30, help="do_bench_cudagraph rep (ms)")
    ap.add_argument("--budget", type=float, default=140.0, help="seconds before skipping timings")
    ap.add_argument("--smoke", action="store_true",
                    help="CPU self-test of the GPU path (TRITON_INTERPRET=1)")  # fmt: skip
    ap.add_argument("--no-boundaries", action="store_true",
                    help="skip the class-boundary check at the end")  # fmt: skip
    ap.add_argument("--jobs", type=int, default=min(12, os.cpu_count() or 1),
                    help="compile processes (0: compile lazily)")  # fmt: skip
    a = ap.parse_args()
    tokens = [int(t) for t in a.tokens.split(",") if t]
    if a.dry_run:
        dry_run(tokens, a.check)
        return
    import triton

    if a.smoke:  # a CPU self-test of the GPU path: tiny dims, the interpreter
        if os.environ.get("TRITON_INTERPRET") != "1":
            sys.exit("--smoke needs TRITON_INTERPRET=1 in the environment")
        global E, K, D, I, DEV
        E, K, D, I, DEV = 8, 2, 64, 32, "cpu"
        a.jobs = 0
    name = torch.cuda.get_device_name() if DEV == "cuda" else "cpu (smoke)"
    print(f"# {name}  torch {torch.__version__}  "
          f"triton {triton.__version__}")  # fmt: skip
    print(f"# E={E} K={K} D={D} I={I} bf16; tokens {tokens}; rep {a.rep} ms; budget {a.budget} s")
    sweep = Sweep(a.rep, a.budget)
    if a.jobs > 0:
        precompile(sweep.all_launches(tokens), a.jobs)
    copy_tbs = copy_bandwidth(sweep.bench)
    for t in tokens:
        if sweep.out_of_time():
            print(f"\n## T={t}: skipped (budget)")
            continue
        sweep.run_tokens(t)
    snippet = sweep.summary(copy_tbs)
    if not a.no_boundaries:
        sweep.boundaries(snippet)
    print(f"# total {time.time() - START:.0f} s")


if __name__ == "__main__":
    main()
