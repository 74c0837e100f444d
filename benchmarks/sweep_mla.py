"""MLA decode tuning sweep for tinyengine/kernels/mla/triton.py on the GPU (prints figures;
not a test). It times a grid of tile configurations and split counts per
DeepSeek-V3 decode shape and prints, per shape, the best configuration next to
mla_config's choice (the heuristic the engine uses) and the previous defaults.

    python benchmarks/sweep_mla.py                     # a few minutes
    python benchmarks/sweep_mla.py --dry-run           # list the grid; runs on CPU
    python benchmarks/sweep_mla.py --json $OUT/mla.json

Shapes: (B, H, ctx) with L=512 latent + R=64 rope, bf16, 16- or 64-row cache
blocks (each tile names its own: TMA tiles need 64),
every sequence at the full ctx (worst case of a captured graph). Timings are
medians of CUDA-graph replays (triton.testing.do_bench_cudagraph, L2 not
flushed). TB/s counts the latent cache bytes of the live context once
(B * ctx * (L + R) * 2); TFLOP/s counts 2*B*H*ctx*(L+R) for the scores plus
2*B*H*ctx*L for the weighted sum. `err` is the relative Frobenius error
against the torch reference (tinyengine/kernels/mla/reference.py); anything above 2e-2 is flagged.

Two stages, to stay inside the time budget:
  1. every tile configuration at the split count mla_config's cost model
     gives it (plus the old defaults: 16 heads x 32 rows, old split rule);
  2. the best two tiles of each shape again at the neighbouring split counts.
Every kernel variant is compiled up front in parallel worker processes (the
Triton disk cache then serves the timing process); a variant that fails to
compile or launch (out of shared memory, ...) prints `fail` and the sweep
goes on. Owns no kernel code: it only passes mla_decode's override kwargs.

Reading it: the `best per shape` table is what to set the defaults from:
_HEADS_PER_PROGRAM / _BLOCK_N / _NUM_STAGES / _warps_for in
tinyengine/kernels/mla/tiles.py (_NUM_STAGES_TMA: which head blocks load pages through TMA)
from the tile that wins (or is within a few % on) the H=128 shapes, and the
split cost model's constants in tinyengine/kernels/mla/tiles.py (_ASSUMED_TFLOPS,
_RESIDENT_PROGRAMS, ...) from whether `heur S` matches `best S`.

The tile grid (Tile, TILES_128 / TILES_16, describe, run_kwargs) is in
benchmarks/mla_grid.py.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root
sys.path.insert(0, str(Path(__file__).resolve().parent))  # mla_grid

import torch  # noqa: E402
import triton  # noqa: E402
from mla_grid import (  # noqa: E402
    CONFIG_BLOCK_SIZE,
    Tile,
    describe,
    old_num_splits,
    run_kwargs,
    tiles_for,
)

import tinyengine.kernels.mla.triton as triton_mla  # noqa: E402

L, R = 512, 64
DEV = "cuda"  # --smoke runs the whole flow on CPU under the Triton interpreter
SHAPES = [  # (B, H, ctx), most important first: a budget cut drops the tail
    (64, 128, 4096),
    (1, 128, 4096),
    (8, 128, 4096),
    (256, 128, 4096),
    (64, 16, 4096),
    (128, 128, 1024),
]


def heuristic_splits(tile: Tile, batch: int, heads: int, ctx: int, sms: int) -> int:
    if tile.old_splits:
        return old_num_splits(batch, heads, ctx, sms)
    return triton_mla._num_splits_for(batch, heads, tile.block_h, L, ctx, sms, tile.block_n)


def neighbour_splits(tile: Tile, batch: int, heads: int, ctx: int, sms: int) -> list[int]:
    """Stage 2 candidates: 1, and the powers of two around one full wave."""
    programs = batch * triton.cdiv(heads, tile.block_h)
    most = min(triton_mla.MAX_SPLITS, max(1, ctx // 64))
    fill = 1
    while programs * fill < sms and fill < most:
        fill *= 2
    cands = {fill // 4, fill // 2, fill, fill * 2, heuristic_splits(tile, batch, heads, ctx, sms)}
    if programs >= sms // 4:
        cands.add(1)
    return sorted(s for s in cands if 1 <= s <= most)


def stage1_jobs(sms: int) -> list[tuple[tuple[int, int, int], Tile, int]]:
    return [
        (shape, tile, heuristic_splits(tile, *shape, sms))
        for shape in SHAPES
        for tile in tiles_for(shape[1])
    ]


def compile_jobs(sms: int) -> list[tuple[int, int, Tile, bool]]:
    """(heads, ctx, tile, direct): every kernel variant stages 1-2 can launch."""
    jobs = {}
    for batch, heads, ctx in SHAPES:
        for tile in tiles_for(heads):
            splits = {heuristic_splits(tile, batch, heads, ctx, sms)}
            splits |= set(neighbour_splits(tile, batch, heads, ctx, sms))
            for direct in {s == 1 for s in splits}:
                # Specialization does not depend on B or on ctx (all table
                # widths here are multiples of 16), only on heads and the tile.
                jobs.setdefault((heads, tile, direct), (heads, ctx, tile, direct))
    return list(jobs.values())


# ----------------------------------------------------------------------------- inputs


def make_inputs(
    batch: int, heads: int, ctx: int, *, block_size: int, spare_blocks: int = 0, seed: int = 0
):
    dev = DEV
    g = torch.Generator(device=dev).manual_seed(seed)
    width = triton.cdiv(ctx, block_size)
    blocks = batch * width + spare_blocks
    cache = torch.randn(blocks, block_size, 1, L + R, device=dev, generator=g).to(torch.bfloat16)
    table = torch.randperm(blocks, device=dev, generator=g)[: batch * width]
    table = table.view(batch, width).to(torch.int32).contiguous()
    q_lat = torch.randn(batch, heads, L, device=dev, generator=g).to(torch.bfloat16)
    q_rope = torch.randn(batch, heads, R, device=dev, generator=g).to(torch.bfloat16)
    seq_lens = torch.full((batch,), ctx, device=dev, dtype=torch.int32)
    return q_lat, q_rope, cache, table, seq_lens, (L + R) ** -0.5


def _sync() -> None:
    if DEV == "cuda":
        torch.cuda.synchronize()


def _first_line(err: Exception) -> str:
    text = str(err).strip()
    return text.splitlines()[0][:100] if text else ""


def _compile_worker(job: tuple[int, int, Tile, bool]) -> tuple[str, str, float]:
    """Runs in a spawned process: one launch of the variant fills the disk cache."""
    heads, ctx, tile, direct = job
    t0 = time.time()
    try:
        args = make_inputs(2, heads, ctx, block_size=tile.block_size)
        triton_mla.launch_mla_decode(*args, max_seq_len=ctx, **run_kwargs(tile, 1 if direct else 2))
        _sync()
        status = "ok"
    except Exception as err:  # noqa: BLE001 - reported, the sweep goes on
        status = f"{type(err).__name__}: {_first_line(err)}"
    return f"H={heads} {tile.name} {'direct' if direct else 'split'}", status, time.time() - t0


def precompile(jobs: list, workers: int) -> None:
    import concurrent.futures as cf
    import multiprocessing as mp

    t0 = time.time()
    print(f"# compiling {len(jobs)} kernel variants in {workers} processes ...", flush=True)
    try:
        with cf.ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn")) as pool:
            for name, status, secs in pool.map(_compile_worker, jobs):
                if status != "ok":
                    print(f"#   {name}: {status} ({secs:.1f} s)", flush=True)
    except Exception as err:  # noqa: BLE001 - the timing process compiles lazily instead
        print(f"# precompile failed ({type(err).__name__}: {err}); compiling lazily", flush=True)
    print(f"# compiled in {time.time() - t0:.1f} s", flush=True)


# ----------------------------------------------------------------------------- timing


@dataclass
class Result:
    batch: int
    heads: int
    ctx: int
    tile: str
    splits: int
    us: float | None
    tbs: float | None
    tflops: float | None
    err: float | None
    note: str = ""


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    return ((out - ref).norm() / ref.norm().clamp_min(1e-12)).item()


class ShapeRunner:
    def __init__(self, shape: tuple[int, int, int], rep: int) -> None:
        import tinyengine.kernels.mla.reference as mla_ref
        from tinyengine.kernels.workspace import Workspace

        self.batch, self.heads, self.ctx = shape
        self.rep = rep
        self.ws = Workspace(DEV)
        self.inputs = {}  # block size -> (args, reference output)
        self.reference = mla_ref.mla_decode
        self.bytes = self.batch * self.ctx * (L + R) * 2
        self.flops = 2 * self.batch * self.heads * self.ctx * (2 * L + R)

    def run(self, tile: Tile, splits: int) -> Result:
        from triton.testing import do_bench_cudagraph

        kwargs = run_kwargs(tile, splits)
        if tile.block_size not in self.inputs:
            args = make_inputs(self.batch, self.heads, self.ctx, block_size=tile.block_size,
                               spare_blocks=1)  # fmt: skip
            self.inputs[tile.block_size] = args, self.reference(*args, max_seq_len=self.ctx)
        args, ref = self.inputs[tile.block_size]

        def fn() -> torch.Tensor:
            return triton_mla.launch_mla_decode(
                *args, max_seq_len=self.ctx, workspace=self.ws, **kwargs
            )

        res = Result(self.batch, self.heads, self.ctx, tile.name, splits, None, None, None, None)
        try:
            out = fn()
            _sync()
            res.err = rel_err(out, ref)
            if DEV == "cuda":
                ms = do_bench_cudagraph(fn, rep=self.rep, return_mode="median")
            else:  # --smoke: one interpreted call, timed on the host
                start = time.perf_counter()
                fn()
                ms = (time.perf_counter() - start) * 1e3
        except Exception as err:  # noqa: BLE001 - out of resources etc.: report, go on
            res.note = f"fail: {type(err).__name__}: {_first_line(err)}"
            _sync()
            return res
        res.us = ms * 1e3
        res.tbs = self.bytes / ms / 1e9
        res.tflops = self.flops / ms / 1e9
        if res.err > 2e-2:
            res.note = "BAD (error above 2e-2)"
        return res


def print_result(tile: Tile, res: Result, tag: str = "") -> None:
    shape = f"B={res.batch:<4}H={res.heads:<4}ctx={res.ctx:<5}"
    if res.us is None:
        print(f"{shape} {describe(tile)} S={res.splits:<3} {res.note}", flush=True)
        return
    print(
        f"{shape} {describe(tile)} S={res.splits:<3} {res.us:9.1f} us {res.tbs:6.2f} TB/s "
        f"{res.tflops:6.1f} TFLOP/s  err {res.err:.1e} {res.note}{tag}", flush=True,
    )  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="list the grid and exit (no GPU)")
    parser.add_argument("--rep", type=int, default=30, help="do_bench_cudagraph rep (ms)")
    parser.add_argument("--budget", type=float, default=140.0, help="seconds; later points skip")
    parser.add_argument("--top", type=int, default=2, help="tiles per shape refined in stage 2")
    parser.add_argument("--workers", type=int, default=0, help="compile processes (0: auto)")
    parser.add_argument("--json", help="also write every result to this file")
    parser.add_argument(
        "--smoke", action="store_true",
        help="run the whole flow on CPU (TRITON_INTERPRET=1) at toy sizes: checks the script",
    )  # fmt: skip
    args = parser.parse_args()
    t0 = time.time()

    global DEV, L, R, SHAPES
    if args.smoke:
        if os.environ.get("TRITON_INTERPRET") != "1":
            sys.exit("--smoke needs TRITON_INTERPRET=1 (set before triton is imported)")
        DEV, L, R, SHAPES = "cpu", 32, 16, [(2, 128, 160), (3, 16, 144)]
    dry = args.dry_run or (DEV == "cuda" and not torch.cuda.is_available())
    sms = (
        torch.cuda.get_device_properties(0).multi_processor_count
        if DEV == "cuda" and not dry
        else 132
    )
    if dry:
        print(f"# dry run (SMs taken as {sms}); shapes (B, H, ctx), L={L} R={R}")
        for batch, heads, ctx in SHAPES:
            cfg = triton_mla.mla_config(batch, heads, L, ctx, sms, 2, CONFIG_BLOCK_SIZE)
            print(f"B={batch} H={heads} ctx={ctx}: mla_config: {cfg}")
            for tile in tiles_for(heads):
                s1 = heuristic_splits(tile, batch, heads, ctx, sms)
                s2 = neighbour_splits(tile, batch, heads, ctx, sms)
                print(f"    {describe(tile)}  stage 1 S={s1:<3} stage 2 candidates {s2}")
        jobs = compile_jobs(sms)
        print(f"# {len(stage1_jobs(sms))} stage-1 points, {len(jobs)} kernel variants to compile:")
        for heads, _, tile, direct in jobs:
            print(f"    H={heads:<4} {describe(tile)} {'direct' if direct else 'split'}")
        return

    device = torch.cuda.get_device_name() if DEV == "cuda" else "CPU (interpreter smoke run)"
    print(f"# {device} ({sms} SMs), torch {torch.__version__}, triton {triton.__version__}, "
          f"rep={args.rep} ms, budget {args.budget:.0f} s")  # fmt: skip
    if DEV == "cuda":
        workers = args.workers or max(1, min(16, (os.cpu_count() or 2) - 1))
        precompile(compile_jobs(sms), workers)
    else:  # exercise the worker in-process
        print("# smoke: compile worker ->", _compile_worker(compile_jobs(sms)[0]))

    results: list[Result] = []
    by_shape: dict[tuple[int, int, int], list[tuple[Tile, Result]]] = {}
    runners: dict[tuple[int, int, int], ShapeRunner] = {}

    def timed(shape, tile, splits, tag="") -> None:
        if time.time() - t0 > args.budget:
            res = Result(*shape, tile.name, splits, None, None, None, None, "skipped: budget")
            print_result(tile, res)
        else:
            res = runners[shape].run(tile, splits)
            print_result(tile, res, tag)
        results.append(res)
        by_shape.setdefault(shape, []).append((tile, res))

    print("\n## stage 1: every tile at its heuristic split count", flush=True)
    for shape in SHAPES:
        runners[shape] = ShapeRunner(shape, args.rep)
        cfg = triton_mla.mla_config(shape[0], shape[1], L, shape[2], sms, 2, CONFIG_BLOCK_SIZE)
        for tile in tiles_for(shape[1]):
            tag = ""
            splits = heuristic_splits(tile, *shape, sms)
            if tile is tiles_for(shape[1])[0] and splits == cfg.num_splits:
                tag = "  <- mla_config"
            timed(shape, tile, splits, tag)
        # Stage 2 right away (the inputs are still on the GPU).
        done = {(t.name, r.splits) for t, r in by_shape[shape]}
        ranked = sorted((r.us, t.name, t) for t, r in by_shape[shape] if r.us is not None)
        top = []
        for _, name, tile in ranked:
            if name not in {t.name for t in top}:
                top.append(tile)
            if len(top) == args.top:
                break
        for tile in top:
            for splits in neighbour_splits(tile, *shape, sms):
                if (tile.name, splits) not in done:
                    timed(shape, tile, splits, "  (stage 2)")
        del runners[shape]
        if DEV == "cuda":
            torch.cuda.empty_cache()

    print("\n## best per shape", flush=True)
    print(f"{'shape':<22} {'mla_config':<28} {'best':<28} {'heur/best':>9} {'old':>9} "
          f"{'old/best':>8}")  # fmt: skip
    tile_ratios: dict[str, list[float]] = {}
    for shape in SHAPES:
        rows = [(t, r) for t, r in by_shape.get(shape, []) if r.us is not None]
        if not rows:
            continue
        best_t, best = min(rows, key=lambda tr: tr[1].us)
        cfg = triton_mla.mla_config(shape[0], shape[1], L, shape[2], sms, 2, CONFIG_BLOCK_SIZE)
        head = tiles_for(shape[1])[0]
        heur = next((r for t, r in rows if t is head and r.splits == cfg.num_splits), None)
        old = next((r for t, r in rows if t.old_splits), None)
        label = f"B={shape[0]} H={shape[1]} ctx={shape[2]}"
        heur_s = f"{head.name} S={cfg.num_splits} {heur.us:.1f}us" if heur else "n/a"
        best_s = f"{best_t.name} S={best.splits} {best.us:.1f}us"
        ratio = f"{heur.us / best.us:9.2f}" if heur else f"{'n/a':>9}"
        old_s = f"{old.us:8.1f}u" if old else f"{'n/a':>9}"
        old_ratio = f"{old.us / best.us:8.2f}" if old else f"{'n/a':>8}"
        print(f"{label:<22} {heur_s:<28} {best_s:<28} {ratio} {old_s} {old_ratio}")
        for name in {t.name for t, _ in rows}:
            fastest = min(r.us for t, r in rows if t.name == name)
            tile_ratios.setdefault(f"H{shape[1]}:{name}", []).append(fastest / best.us)

    print("\n## tiles ranked (geometric mean over shapes of best-time-of-tile / best-of-shape)")
    ranked = sorted(
        (math.exp(sum(map(math.log, v)) / len(v)), k, len(v)) for k, v in tile_ratios.items()
    )
    for score, key, n in ranked:
        print(f"{key:<16} {score:6.3f}  ({n} shapes)")
    print(f"\n# total {time.time() - t0:.1f} s")
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(r) for r in results], indent=1))
        print(f"# wrote {args.json}")


if __name__ == "__main__":
    main()
