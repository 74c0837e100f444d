"""DeepSeek-V4 lightning indexer benchmark, decode (prints figures; not a test).

    python benchmarks/bench_v4_indexer.py [--sweep]

V4-Flash's indexer: 64 heads, Di 128, bf16 keys, ratio 4, top 512, 64-token
cache blocks (17 entry rows each), one decode query per sequence, every
sequence at the full context, a graph-shaped step (no host lengths). Times
CUDA-graph replays (medians) of the Triton op (kernels/indexer/triton.py), its
scoring kernel alone, its radix select alone, torch.topk on the same keys
(what the select replaces), and the torch reference (the peer). Bandwidth:
key bytes read (visible entries x Di x 2 bytes x rows) / time, next to the
GPU's read bandwidth measured in the same run (a 4 GB bf16 tensor's .sum()).
--sweep times the scoring kernel over tile shapes and chunking and the
select over its chunk, warps and radix digit, at 64k context, to tune the
defaults in kernels/indexer/triton.py and select.py.
"""

from __future__ import annotations

import itertools
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root

from triton.testing import do_bench, do_bench_cudagraph  # noqa: E402

import tinyengine.kernels.indexer.reference as reference  # noqa: E402
import tinyengine.kernels.indexer.select as sel  # noqa: E402
import tinyengine.kernels.indexer.triton as indexer  # noqa: E402
from tinyengine.kernels.workspace import Workspace  # noqa: E402
from tinyengine.models.context import AttentionMetadata  # noqa: E402

DEV = "cuda"
HEADS, DIM, RATIO, TOPK, BLOCK = 64, 128, 4, 512, 64
ROWS = BLOCK // RATIO + 1
# (chunk, warps) of the select kernel that --sweep times
# (tests/kernels/test_triton_indexer.py checks the same ones on the GPU).
SELECT_CONFIGS = ((1024, 4), (2048, 4), (2048, 8), (4096, 8), (4096, 16), (8192, 16))


def read_bandwidth() -> tuple[float, float]:
    """TB/s: bytes read / time of a 4 GB bf16 .sum(), and of a 4 GB copy
    (the copy also writes 4 GB, not counted)."""
    x = torch.ones(2**31, dtype=torch.bfloat16, device=DEV)
    total = do_bench(lambda: x.sum(), rep=200, return_mode="median")
    y = torch.empty_like(x)
    copy = do_bench(lambda: y.copy_(x), rep=200, return_mode="median")
    return 2**32 / total / 1e9, 2**32 / copy / 1e9


class Case:
    def __init__(self, batch: int, ctx: int) -> None:
        blocks = ctx // BLOCK
        self.batch, self.ctx = batch, ctx
        self.cache = torch.randn(batch * blocks, ROWS, DIM, device=DEV, dtype=torch.bfloat16)
        table = torch.randperm(batch * blocks, device=DEV, dtype=torch.int32).view(batch, blocks)
        self.attn = AttentionMetadata(
            num_tokens=batch, num_seqs=batch, max_query_len=1, max_seq_len=ctx,
            query_start_loc=torch.arange(batch + 1, dtype=torch.int32, device=DEV),
            seq_lens=torch.full((batch,), ctx, dtype=torch.int32, device=DEV),
            block_tables=table, slot_mapping=torch.zeros(batch, dtype=torch.long, device=DEV),
            query_start_loc_cpu=None, seq_lens_cpu=None,
        )  # fmt: skip
        self.q = torch.randn(batch, HEADS, DIM, device=DEV, dtype=torch.bfloat16)
        self.weights = torch.randn(batch, HEADS, device=DEV) * HEADS**-0.5
        self.ws = Workspace(DEV)
        self.key_bytes = (ctx // RATIO) * DIM * 2 * batch

    def op(self, impl) -> torch.Tensor:
        return impl.indexer_topk(
            self.q, self.weights, self.cache, self.attn, ratio=RATIO, topk=TOPK,
            scale=DIM**-0.5, block_size=BLOCK, workspace=self.ws,
        )  # fmt: skip

    def scores(self, **overrides: int) -> torch.Tensor:
        return indexer.score_entries(
            self.q, self.weights, self.cache, self.attn.seq_lens, self.attn.block_tables,
            ratio=RATIO, scale=DIM**-0.5, block_size=BLOCK, num_entries=self.ctx // RATIO,
            workspace=self.ws, **overrides,
        )  # fmt: skip


def timed(fn, rep: int = 100) -> float:
    """Median microseconds of a CUDA-graph replay of fn (plain launches where
    capture fails)."""
    fn()
    try:
        return do_bench_cudagraph(fn, rep=rep, return_mode="median") * 1e3
    except Exception as exc:  # noqa: BLE001 - report and fall back
        print(f"    (graph capture failed: {type(exc).__name__}; timing plain launches)")
        return do_bench(fn, rep=rep, return_mode="median") * 1e3


def bench(case: Case, read_tbs: float) -> None:
    op = timed(lambda: case.op(indexer))
    score = timed(case.scores)
    keys = case.scores()
    buffers = [
        torch.empty(shape, dtype=dtype, device=DEV)
        for shape, dtype in sel.select_scratch(case.batch, keys.shape[1], TOPK)
    ]
    select = timed(lambda: sel.select_topk(keys, TOPK, buffers))
    top = timed(lambda: torch.topk(keys, TOPK, dim=1))
    peer = timed(lambda: case.op(reference), rep=50)
    label = f"B={case.batch:<3} ctx={case.ctx:<6}"
    for name, us in (("triton op", op), ("scoring", score), ("select", select),
                     ("torch.topk", top), ("torch ref", peer)):  # fmt: skip
        tbs = case.key_bytes / us / 1e6
        print(f"{label} {name:<11} {us:9.1f} us  {tbs:6.2f} TB/s  "
              f"{100 * tbs / read_tbs:5.1f}% of read")  # fmt: skip


def _best(case: Case, read_tbs: float, what: str, configs, fn) -> None:
    """Time fn(**cfg) for each config; print each and the fastest."""
    best = None
    for cfg in configs:
        try:
            us = timed(lambda cfg=cfg: fn(**cfg), rep=20)
        except Exception as exc:  # noqa: BLE001 - a config that does not compile
            print(f"  sweep {what} {cfg}: {type(exc).__name__}")
            continue
        tbs = case.key_bytes / us / 1e6
        print(f"  sweep {what} B={case.batch} ctx={case.ctx} {cfg} {us:8.1f} us {tbs:5.2f} TB/s "
              f"{100 * tbs / read_tbs:5.1f}%")  # fmt: skip
        if best is None or us < best[0]:
            best = (us, cfg)
    print(f"  best {what} B={case.batch} ctx={case.ctx}: {best}")


def sweep(case: Case, read_tbs: float) -> None:
    warps, tiles = ((4,), (1, 2)) if case.batch == 1 else ((4, 8), (4, 8, 16, 32))
    configs = [
        dict(block_e=b, num_warps=w, num_stages=s, tiles_per_program=t)
        for b, w, s, t in itertools.product((64, 128), warps, (2, 3, 4), tiles)
    ]
    _best(case, read_tbs, "scoring", configs, case.scores)
    keys = case.scores()
    configs = [dict(chunk=c, num_warps=w, digit=d) for (c, w), d in
               itertools.product(SELECT_CONFIGS, (4, 5, 8))]  # fmt: skip
    _best(case, read_tbs, "select", configs,
          lambda **cfg: sel.select_topk(keys, TOPK, **cfg))  # fmt: skip


def main() -> None:
    read_tbs, copy_tbs = read_bandwidth()
    torch.cuda.empty_cache()
    print(f"read bandwidth: {read_tbs:.2f} TB/s (4 GB .sum()); copy reads {copy_tbs:.2f} TB/s")
    print(f"indexer decode: {HEADS} heads, Di {DIM}, bf16, ratio {RATIO}, top {TOPK}, "
          f"block {BLOCK}; % of the .sum() read bandwidth")  # fmt: skip
    for batch, ctx in ((1, 4096), (1, 65536), (64, 4096), (64, 65536)):
        case = Case(batch, ctx)
        bench(case, read_tbs)
        if "--sweep" in sys.argv and ctx == 65536:
            sweep(case, read_tbs)
        del case
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
