"""Prefill/mixed attention kernel (tinyengine/kernels/attention/triton.py) at
every tile height it can take, on batches whose queries are short: mostly
decode rows beside one short chunk, short chunks over a long context, short
prompts. It is how `prefill_config`'s smallest tile (64 rows) was chosen:
taller tiles cost more on mostly-decode batches, and shorter ones were no
faster anywhere, while each tile class is one more compile of the kernel.

    python benchmarks/bench_prefill_tiles.py            # on a CUDA GPU
    python benchmarks/bench_prefill_tiles.py --dry-run  # list the cases (CPU ok)

Each row: the tile `prefill_config` picks ("auto"), then microseconds per
call at each height from that one up (triton.testing.do_bench). bf16, d128,
16-token KV blocks; the head counts of Qwen3-0.6B (16 q / 8 kv) and
Llama-3-8B (32 / 8). A script: asserts nothing.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tinyengine.kernels.attention.tiles import prefill_config  # noqa: E402

BLOCK_SIZE = 16
HEAD_DIM = 128
HEIGHTS = (16, 32, 64, 128, 256)
MODELS = (("qwen3-0.6b", 16, 8), ("llama3-8b", 32, 8))
# (name, query lengths, context lengths, counting the new tokens)
CASES = (
    ("255 decode rows + one 8-token chunk, 1k", [1] * 255 + [8], [1024] * 256),
    ("64 decode rows + one 16-token chunk, 4k", [1] * 64 + [16], [4096] * 65),
    ("64 chunks of 16 tokens, 2k", [16] * 64, [2048] * 64),
    ("8 chunks of 4 tokens, 512", [4] * 8, [512] * 8),
    ("one 64-token prompt", [64], [64]),
    ("16 prompts of 32 tokens", [32] * 16, [32] * 16),
    ("4 chunks of 100 tokens, 4k", [100] * 4, [4096] * 4),
)


def _tile(rows: int) -> dict:
    """prefill_config's bf16 tile of `rows` rows at d128 (its rule, below 64
    rows too, which it no longer picks)."""
    warps, stages = (8, 2) if rows >= 256 else (4, 3)
    return dict(block_m=rows, block_n=64, num_warps=warps, num_stages=stages)


def _problem(q_lens: list[int], ctx_lens: list[int], hq: int, hkv: int) -> dict:
    dev, dt = "cuda", torch.bfloat16
    blocks = [-(-c // BLOCK_SIZE) for c in ctx_lens]
    k = torch.randn(sum(blocks) + 1, BLOCK_SIZE, hkv, HEAD_DIM, device=dev, dtype=dt)
    tables = torch.zeros(len(q_lens), max(blocks), dtype=torch.int32, device=dev)
    first = 1
    for i, n in enumerate(blocks):
        tables[i, :n] = torch.arange(first, first + n)
        first += n
    starts = [0]
    for q in q_lens:
        starts.append(starts[-1] + q)
    return dict(
        q=torch.randn(starts[-1], hq, HEAD_DIM, device=dev, dtype=dt),
        k_cache=k, v_cache=torch.randn_like(k),
        out=torch.empty(starts[-1], hq, HEAD_DIM, device=dev, dtype=dt),
        block_tables=tables,
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=dev),
        seq_lens=torch.tensor(ctx_lens, dtype=torch.int32, device=dev),
    )  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="list the cases and exit")
    args = parser.parse_args()
    for model, hq, hkv in MODELS:
        for name, q_lens, ctx_lens in CASES:
            group, longest = hq // hkv, max(q_lens)
            auto = prefill_config(HEAD_DIM, longest, group)[0]
            heights = [m for m in HEIGHTS if m >= group]
            if args.dry_run:
                print(f"{model:11s} {name:42s} auto {auto:3d} rows; heights {heights}")
                continue
            from triton.testing import do_bench

            from tinyengine.kernels.attention.triton import prefill_attention

            p = _problem(q_lens, ctx_lens, hq, hkv)
            row = [f"{model:11s} {name:42s} auto {auto:3d}"]
            for m in heights:

                def call(m=m, p=p, longest=longest):
                    prefill_attention(**p, scale=HEAD_DIM**-0.5, max_query_len=longest, **_tile(m))

                call()
                row.append(f"{m}: {do_bench(call, warmup=20, rep=100) * 1e3:6.1f} us")
            print("  ".join(row), flush=True)


if __name__ == "__main__":
    main()
