"""DeepSeek-V4 sparse attention decode benchmark (prints figures; not a test).

    python benchmarks/bench_v4_attention.py [--sweep] [--gather] [--splits]

V4-Flash decode shapes: H=64 query heads over one shared KV row of D=512,
bf16, 64-token cache blocks, a 128-token window, CSA layers (ratio 4, the
indexer's top 512 entries) and HCA layers (ratio 128, every complete entry),
at contexts 4096 and 65536 and batch 1 and 64. The caches are paged as the
engine pages them with two cache groups: the window's raw rows through the
sliding group's table (older blocks at a null block), the entries through
the full-history group's own table, block ids randomly permuted.

Each line: the op as the engine runs it (kernels/sparse_attention/triton.py:
on Hopper the Gluon split kernel of kernels/sparse_attention/gluon.py), the
same op with the Triton split kernel forced (gluon=False), and the torch
reference (kernels/sparse_attention/reference.py), all timed as CUDA-graph
replays (triton.testing.do_bench_cudagraph, median; L2 is not
flushed between replays). keys = window + entries attended per row;
FLOPs = 4 * H * D * keys per row (QK and PV); bytes = the key rows read
(keys * D * 2 per row) plus q and out. The run starts with the measured
bf16 MMA peak (torch.mm, 8192^3), and the op's TFLOP/s is also given
as a share of it. At 64 heads the op does 2 * H = 128 FLOP per byte it
reads, under the MMA peak / read bandwidth ridge of Hopper GPUs, so its
roofline is max(FLOPs / peak, bytes / read bandwidth) (the read bandwidth
measured in the run, tinyengine.bench.membw) and `roof` is that time over
the op's. --gather also times a kernel that only gathers the same key
rows in the op's grid of programs (what a gather of random 1 KB rows
reaches here); --sweep times tile and split variants at B=64; --splits
times the op as the engine runs it at batch sizes 8-128 with 1-4 splits
and with the split count sparse_config chooses.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.testing import do_bench_cudagraph  # noqa: E402

import tinyengine.kernels.sparse_attention.reference as ref  # noqa: E402
import tinyengine.kernels.sparse_attention.triton as tri  # noqa: E402
from tinyengine.bench.membw import measure_read_bandwidth  # noqa: E402
from tinyengine.kernels.workspace import Workspace  # noqa: E402
from tinyengine.models.context import AttentionMetadata  # noqa: E402

DEV = "cuda"
H, D, BS, WINDOW, TOPK = 64, 512, 64, 128, 512


def mma_peak_tflops() -> float:
    a = torch.randn(8192, 8192, device=DEV, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=DEV, dtype=torch.bfloat16)
    ms = do_bench_cudagraph(lambda: torch.mm(a, b), rep=200, return_mode="median")
    return 2 * 8192**3 / ms / 1e9


class Case:
    """A graph-shaped decode step of `batch` rows at context `ctx`."""

    def __init__(self, batch: int, ctx: int, csa: bool) -> None:
        self.batch, self.ctx, self.csa = batch, ctx, csa
        self.ratio = 4 if csa else 128
        width = ctx // BS
        # Sliding group: the blocks the window reaches, the rest at block 0 (null).
        kept = -(-WINDOW // BS) + 1
        kv_ids = 1 + torch.randperm(batch * kept, device=DEV, dtype=torch.int32)
        table = torch.zeros(batch, width, dtype=torch.int32, device=DEV)
        table[:, width - kept :] = kv_ids.view(batch, kept)
        self.kv_cache = torch.randn(1 + batch * kept, BS, D, device=DEV, dtype=torch.bfloat16)
        # Full-history group: every block, its own ids; rows = entries per block.
        rows = -(-BS // self.ratio)
        entry_ids = torch.randperm(batch * width, device=DEV, dtype=torch.int32)
        self.entry_cache = torch.randn(batch * width, rows, D, device=DEV, dtype=torch.bfloat16)
        self.q = torch.randn(batch, H, D, device=DEV, dtype=torch.bfloat16)
        self.sinks = torch.randn(H, device=DEV)
        entries = ctx // self.ratio
        self.topk = None
        if csa:  # distinct complete entries per row, in no order
            self.topk = torch.rand(batch, entries, device=DEV).topk(TOPK, dim=-1).indices
        self.attn = AttentionMetadata(
            num_tokens=batch, num_seqs=batch, max_query_len=1, max_seq_len=ctx,
            query_start_loc=torch.arange(batch + 1, dtype=torch.int32, device=DEV),
            seq_lens=torch.full((batch,), ctx, dtype=torch.int32, device=DEV),
            block_tables=table, slot_mapping=torch.zeros(batch, dtype=torch.long, device=DEV),
            query_start_loc_cpu=[], seq_lens_cpu=None,
            entry_block_tables=entry_ids.view(batch, width),
        )  # fmt: skip
        self.keys = min(WINDOW, ctx) + (TOPK if csa else entries)
        self.ws = Workspace(DEV)

    def kwargs(self) -> dict:
        return dict(
            window=WINDOW, sinks=self.sinks, scale=D**-0.5, entry_cache=self.entry_cache,
            ratio=self.ratio, topk_indices=self.topk, workspace=self.ws,
        )  # fmt: skip

    def time(self, fn) -> float:
        fn()
        return do_bench_cudagraph(fn, rep=100, return_mode="median")

    def run_triton(self, **tiles) -> torch.Tensor:
        return tri.launch_sparse_attention(self.q, self.kv_cache, self.attn, **self.kwargs(),
                                           **tiles)  # fmt: skip

    def run_reference(self) -> torch.Tensor:
        return ref.sparse_attention(self.q, self.kv_cache, self.attn, **self.kwargs())

    @property
    def work(self) -> tuple[int, int]:
        """(FLOPs, bytes) of the op: QK and PV over every key, and the key
        rows read plus q and out."""
        return 4 * H * D * self.keys * self.batch, (self.keys * D + 2 * H * D) * 2 * self.batch

    def figures(self, ms: float) -> tuple[float, float]:
        flops, nbytes = self.work
        return flops / ms / 1e9, nbytes / ms / 1e9

    def roofline_ms(self, peak_tflops: float, read_bytes_per_s: float) -> float:
        """The op's least time: its FLOPs at the MMA peak or its bytes at
        the read bandwidth, whichever is longer."""
        flops, nbytes = self.work
        return max(flops / (peak_tflops * 1e12), nbytes / read_bytes_per_s) * 1e3

    @property
    def name(self) -> str:
        kind = f"CSA r4 top{TOPK}" if self.csa else "HCA r128"
        return f"{kind:<13} B={self.batch:<3} ctx={self.ctx:<6} keys={self.keys:<4}"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sweep", action="store_true", help="also time tile / split variants")
    parser.add_argument("--gather", action="store_true", help="also time a gather-only kernel")
    parser.add_argument("--splits", action="store_true", help="also time 1-4 splits by batch")
    args = parser.parse_args()
    peak = mma_peak_tflops()
    read = measure_read_bandwidth(DEV).bytes_per_s
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(
        f"bf16 MMA peak (torch.mm 8192^3): {peak:.0f} TFLOP/s; read bandwidth "
        f"(tinyengine.bench.membw): {read / 1e12:.2f} TB/s   [{torch.cuda.get_device_name()}]"
    )
    print(f"{'case':<40} {'op us':>7} {'TFLOP/s':>8} {'%peak':>6} {'TB/s':>6} {'roof':>5} "
          f"{'splits':>6} | {'triton us':>9} {'%peak':>6} | {'torch us':>9} "
          f"{'TFLOP/s':>8}")  # fmt: skip
    for csa in (True, False):
        for ctx in (4096, 65536):
            for batch in (1, 64, 256):
                case = Case(batch, ctx, csa)
                expected = case.run_reference().float()
                for kw in ({}, {"gluon": False}):
                    err = (case.run_triton(**kw).float() - expected).abs().max()
                    assert err < 0.05, f"{case.name}: the op and torch differ by {err}"
                ms = case.time(case.run_triton)
                tf, tb = case.figures(ms)
                ms_tri = case.time(lambda case=case: case.run_triton(gluon=False))
                tf_tri, _ = case.figures(ms_tri)
                splits = tri.sparse_config(batch, H, D, case.keys, sms, 2, not csa).num_splits
                ms_ref = case.time(case.run_reference)
                tf_ref, _ = case.figures(ms_ref)
                roof = case.roofline_ms(peak, read) / ms
                print(f"{case.name:<40} {ms * 1e3:7.1f} {tf:8.1f} {100 * tf / peak:5.1f}% "
                      f"{tb:6.2f} {100 * roof:4.0f}% {splits:>6} | {ms_tri * 1e3:9.1f} "
                      f"{100 * tf_tri / peak:5.1f}% | {ms_ref * 1e3:9.1f} "
                      f"{tf_ref:8.1f}")  # fmt: skip
                del case
    compiled_kernels()
    if args.gather:
        gather_rates(read)
    if args.splits:
        split_counts(sms)
    if args.sweep:
        sweep(peak)


@triton.jit
def _gather_sum(rows_ptr, idx_ptr, out_ptr, PER_PROGRAM: tl.constexpr, BLOCK: tl.constexpr,
                D: tl.constexpr):  # fmt: skip
    """Program p reads rows idx[p * PER_PROGRAM ...] of a [*, D] matrix and
    writes their column sums: a gather and nothing else."""
    p = tl.program_id(0)
    cols = tl.arange(0, D)
    acc = tl.zeros([BLOCK, D], tl.float32)
    for t in range(0, PER_PROGRAM, BLOCK):
        rows = tl.load(idx_ptr + p * PER_PROGRAM + t + tl.arange(0, BLOCK)).to(tl.int64)
        acc += tl.load(rows_ptr + rows[:, None] * D + cols[None, :]).to(tl.float32)
    tl.store(out_ptr + p * D + cols, tl.sum(acc, 0))


def gather_rate(rows: torch.Tensor, programs: int, per_program: int) -> tuple[float, str]:
    """(bytes / s, config) of the fastest of a few _gather_sum configs over
    programs x per_program random rows of `rows`."""
    idx = torch.randint(0, rows.shape[0], (programs * per_program,), device=rows.device,
                        dtype=torch.int32)  # fmt: skip
    out = torch.empty(programs, rows.shape[1], device=rows.device)
    best = (0.0, "")
    for block, warps, stages in [(32, 4, 3), (32, 8, 2), (32, 8, 3), (16, 4, 4), (64, 8, 2)]:
        if per_program % block:
            continue
        run = functools.partial(
            _gather_sum[(programs,)], rows, idx, out, PER_PROGRAM=per_program, BLOCK=block,
            D=rows.shape[1], num_warps=warps, num_stages=stages,
        )  # fmt: skip
        run()
        rate = idx.numel() * rows.shape[1] * rows.element_size() / do_bench_cudagraph(run) * 1e3
        if rate > best[0]:
            best = (rate, f"{block} rows a step, {warps} warps, {stages} stages")
    return best


def gather_rates(read: float) -> None:
    """The rate at which random 1 KB key rows can be gathered at all, in
    the op's grid at B=64 (one program per row and split): the op's bytes
    cannot move faster than this."""
    rows = torch.randn(4 << 20, D, device=DEV, dtype=torch.bfloat16)  # 4 GiB: past L2
    keys = WINDOW + TOPK
    for splits in (1, 2, 4):
        rate, config = gather_rate(rows, 64 * splits, keys // splits)
        print(
            f"gather only, {64 * splits} programs x {keys // splits} rows: "
            f"{rate / 1e12:.2f} TB/s, {100 * rate / read:.0f}% of the read bandwidth ({config})"
        )


def compiled_kernels() -> None:
    """Registers, spills and shared memory of each split kernel compiled so
    far (where this Triton exposes its kernel cache)."""
    try:
        for caches in tri._sparse_split_kernel.device_caches.values():
            for kernel in caches[0].values():
                meta = kernel.metadata
                print(f"split kernel: {kernel.n_regs} regs, {kernel.n_spills} spills, "
                      f"{meta.shared} B shared, {meta.num_warps} warps, "
                      f"{meta.num_stages} stages")  # fmt: skip
    except Exception as err:  # the cache's layout differs between Triton versions
        print(f"(no kernel cache figures: {type(err).__name__}: {err})")


def split_counts(sms: int) -> None:
    """The op (as the engine runs it) with 1-4 splits and with the count
    sparse_config picks (num_splits_for) at several batch sizes, CSA and
    HCA, 4k and 64k: whether that pick is the fastest."""
    for csa in (True, False):
        for ctx in (4096, 65536):
            for batch in (8, 16, 32, 48, 64, 96, 128):
                case = Case(batch, ctx, csa)
                chosen = tri.sparse_config(batch, H, D, case.keys, sms, 2, not csa).num_splits
                times = {}
                for splits in sorted({1, 2, 3, 4, chosen}):
                    run = functools.partial(case.run_triton, num_splits=splits)
                    times[splits] = case.time(run) * 1e3
                best = min(times, key=times.__getitem__)
                line = "  ".join(f"{n}: {t:.1f}" for n, t in times.items())
                print(f"splits {case.name}: {line} (us); best {best}, chosen {chosen}")
                del case


def sweep(peak: float) -> None:
    """Tile and split variants (block_h, block_n, warps, stages, rescale,
    splits), each checked against the reference first."""
    base = dict(num_stages=2, lazy_rescale=False)
    variants = [
        dict(block_h=64, block_n=64, num_warps=8, num_splits=2, **base),
        dict(block_h=64, block_n=64, num_warps=8, num_splits=2, num_stages=2, lazy_rescale=True),
        dict(block_h=64, block_n=32, num_warps=8, num_splits=2, num_stages=3, lazy_rescale=False),
        dict(block_h=32, block_n=32, num_warps=4, num_splits=1, **base),
        dict(block_h=32, block_n=32, num_warps=4, num_splits=2, **base),
        dict(block_h=32, block_n=32, num_warps=4, num_splits=4, **base),
        dict(block_h=32, block_n=32, num_warps=4, num_splits=2, num_stages=3, lazy_rescale=False),
        dict(block_h=16, block_n=32, num_warps=4, num_splits=1, **base),
        dict(block_h=16, block_n=32, num_warps=4, num_splits=2, **base),
    ]
    cases = [(64, 65536, True), (64, 65536, False), (64, 4096, False), (1, 65536, True)]
    for batch, ctx, csa in cases:
        case = Case(batch, ctx, csa)
        expected = case.run_reference().float()
        run = case.run_triton
        for v in variants if batch > 1 else [dict(v, num_splits=None) for v in variants[::3]]:
            try:
                err = (run(**v).float() - expected).abs().max().item()
                tf, _ = case.figures(case.time(lambda v=v, run=run: run(**v)))
                print(f"sweep {case.name} {v}: {tf:6.1f} TFLOP/s ({100 * tf / peak:4.1f}%) "
                      f"max err {err:.4f}")  # fmt: skip
            except Exception as err:  # a variant that does not compile or fit
                print(f"sweep {case.name} {v}: failed ({type(err).__name__}: {err})"[:300])


if __name__ == "__main__":
    main()
