"""Kernel benchmark: prints one markdown table of the Triton kernels' speed on
the current GPU against the ceilings measured in the same run (device copy
bandwidth, bf16 matmul rate) and against torch on the same problem.

    python benchmarks/bench_kernels.py            # everything (a few minutes)
    python benchmarks/bench_kernels.py --quick    # one shape per kernel

A script, not a test: it measures and prints, it asserts nothing. Owns no
kernel code; it must never change a kernel's defaults.

Byte counts are the fewest a kernel must move (each input read once, each
output written once): decode attention counts the K/V bytes of the context
(q and out are ~0.1% of it). Prefill FLOPs are causal: 2 matmuls x 2 FLOP x
T^2 / 2 x H x D. "vs torch" is the torch time over the Triton time (> 1 means
Triton is faster): for attention, torch SDPA on the same problem with K/V laid
out contiguously; for the elementwise ops, the torch reference in tinyengine/kernels/.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

ROWS: list[tuple[str, str, float, str, str, str]] = []


def bench(fn: Callable[[], object], graph: bool = False) -> float:
    """Median milliseconds. Eager: do_bench flushes L2 between runs and times
    each with events. graph=True: replays of a CUDA graph of back-to-back calls
    (how the runner runs decode), so host launch overhead is out of the number;
    L2 is not flushed, so problems under ~50 MB partly run from L2."""
    from triton.testing import do_bench, do_bench_cudagraph

    if graph:
        return do_bench_cudagraph(fn, rep=100, return_mode="median")
    return do_bench(fn, warmup=25, rep=100, return_mode="median")


def add(kernel: str, shape: str, ms: float, rate: str, pct: str, vs: str) -> None:
    ROWS.append((kernel, shape, ms, rate, pct, vs))
    print(f"  {kernel:<14} {shape:<34} {ms * 1e3:9.1f} us  {rate:>14}  {pct:>6}  {vs}", flush=True)


def measure_ceilings() -> tuple[float, float]:
    """(copy TB/s counting read + write, bf16 matmul TFLOP/s) on this device."""
    src = torch.randn(1 << 30, device="cuda", dtype=torch.bfloat16)  # 2 GiB
    dst = torch.empty_like(src)
    copy_tbs = 2 * src.numel() * 2 / (bench(partial(dst.copy_, src)) * 1e-3) / 1e12
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    mm_tflops = 2 * 8192**3 / (bench(partial(torch.matmul, a, b)) * 1e-3) / 1e12
    return copy_tbs, mm_tflops


class Problem:
    """One attention problem, its K/V in one [num_seqs, ctx, Hkv, D] buffer
    seen two ways: as the paged cache [blocks, block_size, Hkv, D] behind a
    shuffled block table (Triton), and as contiguous per-sequence
    [num_seqs, Hkv, ctx, D] (SDPA). Same bytes, so the largest shapes fit."""

    def __init__(self, num_seqs: int, q_len: int, ctx: int, hq: int, hkv: int, d: int) -> None:
        bf16, block_size = torch.bfloat16, 16
        self.k = torch.randn(num_seqs, ctx, hkv, d, device="cuda", dtype=bf16)
        self.v = torch.randn_like(self.k)
        nb = ctx // block_size
        self.k_cache = self.k.view(num_seqs * nb, block_size, hkv, d)
        self.v_cache = self.v.view(num_seqs * nb, block_size, hkv, d)
        perm = torch.randperm(num_seqs * nb, device="cuda", dtype=torch.int32)
        self.tables = perm.view(num_seqs, nb)
        self.q = torch.randn(num_seqs * q_len, hq, d, device="cuda", dtype=bf16)
        self.out = torch.empty_like(self.q)
        self.qsl_cpu = [i * q_len for i in range(num_seqs + 1)]
        self.qsl = torch.tensor(self.qsl_cpu, device="cuda", dtype=torch.int32)
        self.lens = torch.full((num_seqs,), ctx, device="cuda", dtype=torch.int32)
        self.num_seqs, self.q_len, self.ctx, self.hq, self.hkv, self.d = (
            num_seqs,
            q_len,
            ctx,
            hq,
            hkv,
            d,
        )
        self.kv_bytes = 2 * self.k.numel() * 2

    def triton(self, workspace: object = None) -> torch.Tensor:
        import tinyengine.kernels.attention.triton as ta

        return ta.paged_attention(
            self.q, self.k_cache, self.v_cache, self.tables, self.qsl, self.lens, self.d**-0.5,
            max_query_len=self.q_len, max_seq_len=self.ctx, query_start_loc_cpu=self.qsl_cpu,
            workspace=workspace,
        )  # fmt: skip

    def triton_prefill(self) -> torch.Tensor:
        """The Triton prefill kernel with its own default tiles, passed
        explicitly (which keeps the call off the Gluon kernel on Hopper)."""
        import tinyengine.kernels.attention.triton as ta
        from tinyengine.kernels.attention.tiles import prefill_config

        m, n, warps, stages = prefill_config(self.d, self.q_len, self.hq // self.hkv)
        ta.prefill_attention(
            self.q, self.k_cache, self.v_cache, self.out, self.tables, self.qsl, self.lens,
            self.d**-0.5, max_query_len=self.q_len, block_m=m, block_n=n, num_warps=warps,
            num_stages=stages,
        )  # fmt: skip
        return self.out

    def sdpa(self) -> torch.Tensor:
        q = self.q.view(self.num_seqs, self.q_len, self.hq, self.d).transpose(1, 2)
        return torch.nn.functional.scaled_dot_product_attention(
            q, self.k.transpose(1, 2), self.v.transpose(1, 2),
            is_causal=self.q_len > 1, enable_gqa=self.hq != self.hkv,
        )  # fmt: skip

    def args(self) -> tuple:
        return (self.q, self.k_cache, self.v_cache, self.out, self.tables, self.qsl, self.lens,
                self.d**-0.5)  # fmt: skip


def bench_decode_shape(batch: int, ctx: int, copy_tbs: float, workspace: object) -> None:
    import tinyengine.kernels.attention.triton as ta

    p = Problem(batch, 1, ctx, 32, 8, 128)
    splits = ta.decode_num_splits(batch, p.hkv, ctx, ta._num_sms(p.q.device))
    ms, ms_sdpa = bench(partial(p.triton, workspace), graph=True), bench(p.sdpa, graph=True)
    tbs, sdpa_tbs = p.kv_bytes / (ms * 1e-3) / 1e12, p.kv_bytes / (ms_sdpa * 1e-3) / 1e12
    vs = f"{ms_sdpa / ms:.2f} (SDPA {sdpa_tbs:.2f} TB/s)"
    add("decode", f"B={batch} ctx={ctx} S={splits}", ms, f"{tbs:.2f} TB/s",
        f"{100 * tbs / copy_tbs:.0f}%", vs)  # fmt: skip


def bench_decode(copy_tbs: float, quick: bool) -> None:
    """32 query / 8 KV heads, d128, block_size 16; skips shapes over 40 GB of K/V."""
    from tinyengine.kernels.workspace import Workspace

    workspace = Workspace("cuda")
    shapes = [(64, 4096)] if quick else [(b, c) for b in (1, 64, 256) for c in (512, 4096, 32768)]
    for batch, ctx in shapes:
        if 2 * batch * ctx * 8 * 128 * 2 <= 40e9:
            bench_decode_shape(batch, ctx, copy_tbs, workspace)
            torch.cuda.empty_cache()


def bench_prefill(mm_tflops: float, quick: bool) -> None:
    """One causal prompt; FLOPs = 2 matmuls x 2 x T^2 / 2 x Hq x D."""
    shapes = [(8192, 32, 32)] if quick else [(8192, 32, 32), (8192, 32, 8), (2048, 32, 32)]
    for tokens, hq, hkv in shapes:
        p = Problem(1, tokens, tokens, hq, hkv, 128)
        flops = 2 * tokens * tokens * hq * p.d
        ms, ms_sdpa, ms_tk = bench(p.triton), bench(p.sdpa), bench(p.triton_prefill)
        tf, sdpa_tf = flops / (ms * 1e-3) / 1e12, flops / (ms_sdpa * 1e-3) / 1e12
        # On Hopper paged_attention runs the Gluon kernel: the Triton one beside it.
        tk_tf = flops / (ms_tk * 1e-3) / 1e12
        vs = f"{ms_sdpa / ms:.2f} (SDPA {sdpa_tf:.0f} TFLOP/s; Triton kernel {tk_tf:.0f})"
        add("prefill", f"T={tokens} Hq={hq} Hkv={hkv} causal", ms, f"{tf:.0f} TFLOP/s",
            f"{100 * tf / mm_tflops:.0f}%", vs)  # fmt: skip


def bench_elementwise(copy_tbs: float) -> None:
    """16k tokens x 4096 hidden, bf16; bytes = inputs read once + outputs written once."""
    from tinyengine.kernels.activation.reference import silu_and_mul_torch
    from tinyengine.kernels.activation.triton import silu_and_mul_triton
    from tinyengine.kernels.attention.cache_write import write_kv_cache_triton
    from tinyengine.kernels.norm.reference import rms_norm_torch
    from tinyengine.kernels.norm.triton import rms_norm_triton
    from tinyengine.kernels.rope.rotary import (
        apply_rotary_torch,
        apply_rotary_triton,
        build_cos_sin_cache,
    )

    tokens, hidden, bf16 = 16384, 4096, torch.bfloat16
    el = tokens * hidden * 2  # bytes of one [tokens, hidden] bf16 tensor
    x = torch.randn(tokens, hidden, device="cuda", dtype=bf16)
    r = torch.randn_like(x)
    w = torch.rand(hidden, device="cuda", dtype=bf16)
    gate_up = torch.randn(tokens, 2 * hidden, device="cuda", dtype=bf16)
    q = torch.randn(tokens, 32, 128, device="cuda", dtype=bf16)
    k = torch.randn(tokens, 8, 128, device="cuda", dtype=bf16)
    pos = torch.randint(0, 32768, (tokens,), device="cuda")
    inv_freq = 1.0 / 10000 ** (torch.arange(0, 128, 2, device="cuda", dtype=torch.float64) / 128)
    cache = build_cos_sin_cache(inv_freq, 32768)
    rot_bytes = 2 * (q.numel() + k.numel()) * 2 + tokens * 128 * 4
    kv = torch.randn(2, tokens, 32, 128, device="cuda", dtype=bf16)
    kc = torch.empty(tokens // 16 + 1, 16, 32, 128, device="cuda", dtype=bf16)
    vc = torch.empty_like(kc)
    blocks = torch.randperm(tokens // 16, device="cuda")
    slots = (blocks[:, None] * 16 + torch.arange(16, device="cuda")).flatten()

    def torch_write() -> None:
        kc.view(-1, 32, 128)[slots] = kv[0]
        vc.view(-1, 32, 128)[slots] = kv[1]

    cases: list[tuple[str, str, int, Callable[[], object], Callable[[], object]]] = [
        ("rms_norm", "16k x 4096", 2 * el,
         partial(rms_norm_triton, x, w, 1e-6), partial(rms_norm_torch, x, w, 1e-6)),
        ("rms_norm+add", "16k x 4096, residual", 4 * el,
         partial(rms_norm_triton, x, w, 1e-6, r), partial(rms_norm_torch, x, w, 1e-6, r)),
        ("silu_and_mul", "16k x 2*4096 -> 4096", 3 * el,
         partial(silu_and_mul_triton, gate_up), partial(silu_and_mul_torch, gate_up)),
        ("rotary neox", "16k x (32+8) x 128", rot_bytes,
         partial(apply_rotary_triton, q, k, pos, cache, True),
         partial(apply_rotary_torch, q, k, pos, cache, True)),
        ("rotary gptj", "16k x (32+8) x 128", rot_bytes,
         partial(apply_rotary_triton, q, k, pos, cache, False),
         partial(apply_rotary_torch, q, k, pos, cache, False)),
        ("cache write", "16k x 4096 (k and v)", 4 * el,
         partial(write_kv_cache_triton, kv[0], kv[1], kc, vc, slots), torch_write),
    ]  # fmt: skip
    for name, shape, nbytes, fn, ref in cases:
        ms, ms_ref = bench(fn), bench(ref)
        tbs = nbytes / (ms * 1e-3) / 1e12
        add(name, shape, ms, f"{tbs:.2f} TB/s", f"{100 * tbs / copy_tbs:.0f}%",
            f"{ms_ref / ms:.2f} (torch {nbytes / (ms_ref * 1e-3) / 1e12:.2f} TB/s)")  # fmt: skip


def _try(label: str, fn: Callable[[], object], work: float, unit: str, graph: bool) -> None:
    try:
        ms = bench(fn, graph)
    except Exception as e:  # a config may not fit shared memory or registers
        print(f"  {label}: failed {e!r}"[:200], flush=True)
        return
    print(f"  {label}: {ms * 1e3:.1f} us  {work / (ms * 1e-3) / 1e12:.2f} {unit}", flush=True)


def sweep() -> None:
    """Try tile configs for the two attention kernels (for choosing defaults)."""
    import tinyengine.kernels.attention.triton as ta
    from tinyengine.kernels.workspace import Workspace

    workspace = Workspace("cuda")
    for batch, ctx, split_list, configs in [
        (64, 4096, [1, 2], [(64, 4, 2), (64, 4, 3)]),
        (16, 4096, [1, 2, 4], [(64, 4, 3)]),
    ]:
        p = Problem(batch, 1, ctx, 32, 8, 128)
        for s in split_list:
            for bn, nw, ns in configs:
                fn = partial(ta.decode_attention, *p.args(), max_seq_len=ctx, workspace=workspace,
                             num_splits=s, block_n=bn, num_warps=nw, num_stages=ns)  # fmt: skip
                label = f"decode B={batch} ctx={ctx} S={s} bn={bn} w={nw} st={ns}"
                _try(label, fn, p.kv_bytes, "TB/s", graph=True)
    configs = [(256, 64, 8, 2), (256, 64, 8, 3), (256, 64, 8, 4), (256, 32, 8, 3),
               (128, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 2), (128, 128, 8, 3)]  # fmt: skip
    for tokens, hkv in [(8192, 32), (8192, 8), (2048, 32)]:
        p = Problem(1, tokens, tokens, 32, hkv, 128)
        flops = 2 * tokens * tokens * 32 * 128
        for bm, bn, nw, ns in configs:
            fn = partial(ta.prefill_attention, *p.args(), max_query_len=tokens, block_m=bm,
                         block_n=bn, num_warps=nw, num_stages=ns)  # fmt: skip
            label = f"prefill T={tokens} Hkv={hkv} bm={bm} bn={bn} w={nw} st={ns}"
            _try(label, fn, flops, "TFLOP/s", graph=False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="one shape per kernel")
    parser.add_argument("--only", choices=["decode", "prefill", "elementwise"], default=None)
    parser.add_argument("--sweep", action="store_true", help="try attention tile configs")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench_kernels: needs a CUDA GPU (the interpreter would time numpy, not kernels)")
        return
    if args.sweep:
        sweep()
        return
    torch.manual_seed(0)
    copy_tbs, mm_tflops = measure_ceilings()
    print(f"{torch.cuda.get_device_name()}: copy {copy_tbs:.2f} TB/s (read+write), "
          f"bf16 matmul {mm_tflops:.0f} TFLOP/s", flush=True)  # fmt: skip
    if args.only in (None, "decode"):
        bench_decode(copy_tbs, args.quick)
    if args.only in (None, "prefill"):
        bench_prefill(mm_tflops, args.quick)
    if args.only in (None, "elementwise"):
        bench_elementwise(copy_tbs)
    print("\n| kernel | shape | time (us) | achieved | % of ceiling | vs torch |")
    print("| --- | --- | ---: | ---: | ---: | --- |")
    for kernel, shape, ms, rate, pct, vs in ROWS:
        print(f"| {kernel} | {shape} | {ms * 1e3:.1f} | {rate} | {pct} | {vs} |")
    print(f"\nceilings: copy {copy_tbs:.2f} TB/s, bf16 matmul {mm_tflops:.0f} TFLOP/s "
          "(decode and elementwise % are of copy; prefill % of matmul)")  # fmt: skip


if __name__ == "__main__":
    main()
