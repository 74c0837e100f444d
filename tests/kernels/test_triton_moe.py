"""Triton fused MoE (kernels/triton_moe.py) vs the torch reference (kernels/moe.py).

CPU runs go through the Triton interpreter (~2 ms per program instance), so
shapes stay tiny (T <= 8, D = 32/48, I = 16/32, E = 4-8, K = 2-3) with 16-row
M-blocks and 16/32-wide N/K tiles, enough to cross expert segments, padded
block tails, and several K-loop iterations.
"""

from __future__ import annotations

import pytest
import torch

from kernels import moe as moe_ref
from kernels import triton_moe
from kernels.workspace import Workspace

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# Relative Frobenius. bf16: the interpreter truncates fp32->bf16 casts (the
# reference rounds to nearest), which roughly triples the rounding error.
TOL = {torch.float32: 2e-3 if DEVICE == "cuda" else 1e-5, torch.bfloat16: 4e-2}


def make(num_tokens: int, hidden: int, inter: int, experts: int, top_k: int,
         dtype: torch.dtype, seed: int = 0, ids: torch.Tensor | None = None) -> tuple:  # fmt: skip
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, hidden, generator=g).to(dtype)
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=g) * hidden**-0.5).to(dtype)
    w2 = (torch.randn(experts, hidden, inter, generator=g) * inter**-0.5).to(dtype)
    if ids is None:
        # Distinct experts per token, as a router's top-k gives.
        ids = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(num_tokens)])
    weights = torch.rand(num_tokens, top_k, generator=g)
    return tuple(t.to(DEVICE) for t in (x, w13, w2, weights, ids.long()))


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double().cpu(), ref.double().cpu()
    assert not out.isnan().any()
    return ((out - ref).norm() / ref.norm().clamp_min(1e-12)).item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("num_tokens", "hidden", "inter", "experts", "top_k"),
    [(8, 32, 16, 8, 2), (1, 32, 32, 4, 2), (5, 48, 24, 6, 3)],
)
def test_matches_reference(num_tokens: int, hidden: int, inter: int, experts: int, top_k: int,
                           dtype: torch.dtype) -> None:  # fmt: skip
    # D=48 / I=24 with 16/32-wide tiles: masked K and N tails in both GEMMs.
    args = make(num_tokens, hidden, inter, experts, top_k, dtype)
    out = triton_moe.fused_moe(*args, block_m=16, block_n=16, block_k=32)
    assert out.shape == args[0].shape and out.dtype == dtype
    assert rel_err(out, moe_ref.fused_moe(*args)) < TOL[dtype]


def test_skewed_routing_empty_experts_and_multi_block_segments() -> None:
    # Expert 1 gets 18 of the 24 pairs (a segment of two 16-row blocks, the
    # second partial), experts 0 and 4-7 none; duplicate ids in a row (a token
    # choosing one expert twice) must sum both weights.
    ids = torch.tensor([[1, 3, 1], [1, 2, 1], [1, 1, 1], [1, 1, 2], [1, 2, 1], [2, 1, 1],
                        [1, 3, 1], [1, 1, 1]])  # fmt: skip
    assert (ids == 1).sum() == 18
    args = make(8, 32, 16, 8, 3, torch.float32, ids=ids)
    ref = moe_ref.fused_moe(*args)
    out = triton_moe.fused_moe(*args, block_m=16, block_n=16, block_k=16)
    assert rel_err(out, ref) < TOL[torch.float32]


def test_workspace_path_matches_allocating_path() -> None:
    args = make(6, 32, 32, 4, 2, torch.float32, seed=3)
    ws = Workspace(DEVICE)
    out_ws = triton_moe.fused_moe(*args, workspace=ws, block_n=32, block_k=32)
    assert ws.stats.num_growths == 1
    ws.lock()  # a second call of the same shape must fit without growing
    again = triton_moe.fused_moe(*args, workspace=ws, block_n=32, block_k=32)
    out_none = triton_moe.fused_moe(*args, block_n=32, block_k=32)
    assert torch.equal(out_ws, out_none) and torch.equal(again, out_ws)
    assert rel_err(out_ws, moe_ref.fused_moe(*args)) < TOL[torch.float32]


def test_strided_routing_tensors_and_int32_ids() -> None:
    # Routing tensors sliced from wider ones (every other column) are strided
    # views whose reshape(-1) is still a view: the kernel must use the strides.
    x, w13, w2, _, _ = make(5, 32, 16, 4, 2, torch.float32, seed=4)
    g = torch.Generator().manual_seed(5)
    wide_w = torch.rand(5, 4, generator=g).to(DEVICE)
    wide_ids = torch.stack([torch.randperm(4, generator=g) for _ in range(5)]).to(DEVICE)
    weights, ids = wide_w[:, ::2], wide_ids[:, ::2]
    ref = moe_ref.fused_moe(x, w13, w2, weights.contiguous(), ids.contiguous())
    out = triton_moe.fused_moe(x, w13, w2, weights, ids, block_n=16, block_k=32)
    assert rel_err(out, ref) < TOL[torch.float32]
    out32 = triton_moe.fused_moe(x, w13, w2, weights, ids.int(), block_n=16, block_k=32)
    assert torch.equal(out32, out)


def test_zero_tokens() -> None:
    x, w13, w2, weights, ids = make(1, 32, 16, 4, 2, torch.float32)
    out = triton_moe.fused_moe(x[:0], w13, w2, weights[:0], ids[:0])
    assert out.shape == (0, 32)


def test_block_bound_covers_any_routing() -> None:
    # The grid's M extent must cover sum_e cdiv(count_e, block_m) for every
    # split of the pairs over the experts: random splits plus the adversarial
    # one (one pair on each of E-1 experts, the rest on the last).
    g = torch.Generator().manual_seed(0)
    for pairs, experts, bm in [(16, 8, 16), (3, 8, 16), (2048, 256, 64), (64, 4, 16), (17, 2, 16)]:
        bound = triton_moe.max_m_blocks(pairs, experts, bm)
        splits = [torch.bincount(torch.randint(0, experts, (pairs,), generator=g),
                                 minlength=experts).tolist() for _ in range(50)]  # fmt: skip
        n = min(experts, pairs)
        splits.append([1] * (n - 1) + [pairs - n + 1])
        for counts in splits:
            assert sum(-(-c // bm) for c in counts) <= bound


# ----------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [256, 1])
def test_gpu_deepseek_v3_dims(num_tokens: int) -> None:
    # D=7168, I=2048, K=8 as in DeepSeek-V3; E=64 instead of 256 keeps the
    # weights at ~5.6 GB bf16 (256 experts would be 22.5 GB plus the reference's).
    g = torch.Generator(device="cuda").manual_seed(0)
    t, d, i, e, k = num_tokens, 7168, 2048, 64, 8
    x = torch.randn(t, d, device="cuda", generator=g).bfloat16()
    w13 = (torch.randn(e, 2 * i, d, device="cuda", generator=g) * d**-0.5).bfloat16()
    w2 = (torch.randn(e, d, i, device="cuda", generator=g) * i**-0.5).bfloat16()
    scores = torch.rand(t, e, device="cuda", generator=g)
    weights, ids = torch.topk(scores, k, dim=-1)
    ref = moe_ref.fused_moe(x, w13, w2, weights, ids)
    out = triton_moe.fused_moe(x, w13, w2, weights, ids, workspace=Workspace("cuda"))
    assert rel_err(out, ref) < 2e-2


@pytest.mark.gpu
def test_gpu_cuda_graph_replay() -> None:
    t, d, i, e, k = 16, 1024, 256, 32, 8
    g = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(t, d, device="cuda", generator=g).bfloat16()
    w13 = (torch.randn(e, 2 * i, d, device="cuda", generator=g) * d**-0.5).bfloat16()
    w2 = (torch.randn(e, d, i, device="cuda", generator=g) * i**-0.5).bfloat16()
    weights, ids = torch.topk(torch.rand(t, e, device="cuda", generator=g), k, dim=-1)
    ws = Workspace("cuda")
    step = lambda: triton_moe.fused_moe(x, w13, w2, weights, ids, workspace=ws)  # noqa: E731
    step()
    torch.cuda.synchronize()
    ws.lock()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graph_out = step()
    for seed in range(3):  # new routing each replay, incl. everything on one expert
        new_w, new_ids = torch.topk(torch.rand(t, e, device="cuda"), k, dim=-1)
        if seed == 2:
            new_ids[:, 0] = 5
            new_ids[:, 1:] = torch.arange(6, 6 + k - 1, device="cuda")
        weights.copy_(new_w)
        ids.copy_(new_ids)
        graph.replay()
        torch.cuda.synchronize()
        assert rel_err(graph_out, moe_ref.fused_moe(x, w13, w2, weights, ids)) < 2e-2
