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

The tile grid, the dry run (--check included) and the compile workers are in
benchmarks/moe_grid.py; the summary tables in benchmarks/moe_report.py.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # moe_grid, moe_report

import torch  # noqa: E402
from moe_grid import GROUP_MS, candidates, dry_run, fmt, precompile, tile_key  # noqa: E402
from moe_report import report_modes, summary  # noqa: E402

import tinyengine.kernels.moe.reference as moe_ref  # noqa: E402
import tinyengine.kernels.moe.triton as tm  # noqa: E402
from tinyengine.kernels.workspace import Workspace  # noqa: E402

E, K, D, I = 256, 8, 7168, 2048
DEV = "cuda"  # --smoke: "cpu" (and tiny E, K, D, I)
TOKENS = (4096, 8192, 512, 1, 16, 64)
START = time.time()


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
        r["by_mode"] = report_modes(r)

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
    global E, K, D, I, DEV  # --smoke rebinds them (tiny dims, the CPU)
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
        dry_run(tokens, a.check, E, K, D, I)
        return
    import triton

    if a.smoke:  # a CPU self-test of the GPU path: tiny dims, the interpreter
        if os.environ.get("TRITON_INTERPRET") != "1":
            sys.exit("--smoke needs TRITON_INTERPRET=1 in the environment")
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
    snippet = summary(sweep.results, sweep.skipped, copy_tbs, K, D, I)
    if not a.no_boundaries:
        sweep.boundaries(snippet)
    print(f"# total {time.time() - START:.0f} s")


if __name__ == "__main__":
    main()
