"""Decode-attention tile sweep for the shapes a serving batch has: many
sequences with short contexts (a few hundred tokens), where each program has
only a few K/V tiles and the kernel is bound by latency, not bandwidth.

    python benchmarks/sweep_decode.py [--budget 100]

For each shape prints TB/s (K/V bytes of the context / time, CUDA-graph
replay) for (BLOCK_N, num_warps, num_stages) configs, the current default's
figure, and the best. A script: it measures and prints, asserts nothing, and
never changes a kernel default (edit tinyengine/kernels/attention/triton.py after).
"""

from __future__ import annotations

import argparse
import sys
import time
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_kernels import Problem, bench  # noqa: E402

SHAPES = [  # (batch, context, Hq, Hkv, D)
    (256, 128, 16, 8, 128),  # Qwen3-0.6B, the 256-sequence throughput workload
    (256, 512, 16, 8, 128),
    (256, 1024, 16, 8, 128),
    (64, 512, 32, 8, 128),  # Llama-3-8B
    (1, 256, 32, 8, 128),
    (64, 4096, 32, 8, 128),
]
CONFIGS = [  # (BLOCK_N, num_warps, num_stages)
    (64, 4, 3), (64, 4, 2), (64, 4, 1), (64, 2, 2), (64, 8, 2),
    (32, 4, 3), (32, 4, 2), (32, 2, 2), (32, 2, 3), (32, 1, 2),
    (16, 2, 2), (16, 1, 2), (16, 2, 3), (128, 4, 2), (128, 8, 2),
]  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--budget", type=float, default=100.0, help="seconds, then stop")
    args = parser.parse_args()
    import tinyengine.kernels.attention.triton as ta
    from tinyengine.kernels.workspace import Workspace

    workspace, t0 = Workspace("cuda"), time.perf_counter()
    for batch, ctx, hq, hkv, d in SHAPES:
        p = Problem(batch, 1, ctx, hq, hkv, d)
        splits = ta.decode_num_splits(batch, hkv, ctx, ta._num_sms(p.q.device))
        results = []
        for bn, nw, ns in CONFIGS:
            if time.perf_counter() - t0 > args.budget:
                print("budget spent", flush=True)
                return
            fn = partial(ta.decode_attention, *p.args(), max_seq_len=ctx, workspace=workspace,
                         num_splits=splits, block_n=bn, num_warps=nw, num_stages=ns)  # fmt: skip
            try:
                ms = bench(fn, graph=True)
            except Exception as e:  # a config may not fit shared memory
                print(f"  B={batch} ctx={ctx} bn={bn} w={nw} st={ns}: failed {e!r}"[:160])
                continue
            results.append((p.kv_bytes / (ms * 1e-3) / 1e12, bn, nw, ns, ms))
        default = ta.decode_config(batch, hq, hkv, d)
        by_cfg = {(bn, nw, ns): tbs for tbs, bn, nw, ns, _ in results}
        best = max(results)
        line = " ".join(f"{bn}/{nw}/{ns}:{tbs:.2f}" for tbs, bn, nw, ns, _ in results)
        print(f"B={batch} ctx={ctx} Hq={hq} Hkv={hkv} S={splits}  {line}")
        print(f"  default {default}: {by_cfg.get(default, float('nan')):.2f} TB/s; best "
              f"{best[1:4]}: {best[0]:.2f} TB/s ({best[4] * 1e3:.1f} us)", flush=True)  # fmt: skip
        del p
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
