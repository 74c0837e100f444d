"""Triton fused MoE on a CUDA GPU at DeepSeek-V3 dims (bf16 and fp32, every
size class, both TMA modes) vs the torch reference, and under CUDA-graph
replay with new routings. Skipped without a GPU."""

from __future__ import annotations

import pytest
import torch

import tinyengine.kernels.moe.reference as moe_ref
import tinyengine.kernels.moe.triton as triton_moe
from tests.kernels.moe_cases import CLASSES, ids_with_counts, make, rel_err, tma_config
from tinyengine.kernels.workspace import Workspace

# ----------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [2048, 256, 1])
def test_gpu_deepseek_v3_dims(num_tokens: int) -> None:
    # D=7168, I=2048, K=8 as in DeepSeek-V3; E=64 instead of 256 keeps the
    # weights at ~5.6 GB bf16 (256 experts would be 22.5 GB plus the reference's).
    # With E=64 the three token counts land in the three size classes.
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
@pytest.mark.parametrize("num_tokens", [1024, 128, 1])
def test_gpu_fp32_every_class_fits(num_tokens: int) -> None:
    """fp32 halves the pipeline stages (moe_config): class 0's bf16 ring in
    fp32 would be ~408 KB of shared memory. E=16, K=4: the three token
    counts land in the three size classes."""
    t, d, i, e, k = num_tokens, 1024, 512, 16, 4
    assert triton_moe.moe_size_class(t, k, e) == {1024: 2, 128: 1, 1: 0}[t]
    x, w13, w2, weights, ids = make(t, d, i, e, k, torch.float32)
    ref = moe_ref.fused_moe(x, w13, w2, weights, ids)
    out = triton_moe.fused_moe(x, w13, w2, weights, ids, workspace=Workspace("cuda"))
    # fp32 dots run 3xTF32 (dot_precision); Triton's default single TF32 pass
    # gives ~2e-3 here, far past the bound.
    assert rel_err(out, ref) < 1e-4


@pytest.mark.gpu
@pytest.mark.parametrize("mode", [1, 2])
def test_gpu_tma_modes_deepseek_v3_dims(mode: int) -> None:
    # The largest class's tiles with weight (1) or all (2) loads through TMA.
    g = torch.Generator(device="cuda").manual_seed(3)
    t, d, i, e, k = 2048, 7168, 2048, 64, 8
    x = torch.randn(t, d, device="cuda", generator=g).bfloat16()
    w13 = (torch.randn(e, 2 * i, d, device="cuda", generator=g) * d**-0.5).bfloat16()
    w2 = (torch.randn(e, d, i, device="cuda", generator=g) * i**-0.5).bfloat16()
    weights, ids = torch.topk(torch.rand(t, e, device="cuda", generator=g), k, dim=-1)
    ref = moe_ref.fused_moe(x, w13, w2, weights, ids)
    out = triton_moe.launch_fused_moe(x, w13, w2, weights, ids, workspace=Workspace("cuda"),
                                      config=tma_config(mode))  # fmt: skip
    assert rel_err(out, ref) < 2e-2


def _captured(x, w13, w2, weights, ids, ws: Workspace, cfg: dict) -> tuple:
    """(graph, its output): fused_moe run once eagerly (compiles), the
    workspace locked, then captured; replays read the tensors' new contents."""
    step = lambda: triton_moe.launch_fused_moe(x, w13, w2, weights, ids, workspace=ws, config=cfg)  # noqa: E731
    step()
    torch.cuda.synchronize()
    ws.lock()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    return graph, out


@pytest.mark.gpu
@pytest.mark.parametrize("cls", [*CLASSES, "tma"])
def test_gpu_cuda_graph_replay(cls: int | str) -> None:
    t, d, i, e, k = 16, 1024, 256, 32, 8
    g = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(t, d, device="cuda", generator=g).bfloat16()
    w13 = (torch.randn(e, 2 * i, d, device="cuda", generator=g) * d**-0.5).bfloat16()
    w2 = (torch.randn(e, d, i, device="cuda", generator=g) * i**-0.5).bfloat16()
    weights, ids = torch.topk(torch.rand(t, e, device="cuda", generator=g), k, dim=-1)
    ws = Workspace("cuda")
    # "tma": host-built descriptors are recorded by value with the launch.
    cfg = tma_config(triton_moe.TMA_AW) if cls == "tma" else triton_moe.CLASS_CONFIGS[cls]
    graph, graph_out = _captured(x, w13, w2, weights, ids, ws, cfg)
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


@pytest.mark.gpu
def test_gpu_tails_under_graph_replay() -> None:
    # The largest class's tiles (128-row blocks, 64-row tails) captured once
    # and replayed with routings that add and remove tails: 160 rows on one
    # expert (a 32-row tail), 100 / 60 (none), 130 / 30 (a 2-row tail).
    t, d, i, e, k = 160, 1024, 256, 2, 1
    x, w13, w2, weights, ids = make(t, d, i, e, k, torch.bfloat16, seed=16,
                                    ids=ids_with_counts([160, 0]))  # fmt: skip
    cfg = {g: dict(c, group_m=1) for g, c in triton_moe.CLASS_CONFIGS[-1].items()}
    assert cfg["gate_up"]["tail_m"] == cfg["down"]["tail_m"] == 64
    ws = Workspace("cuda")
    graph, graph_out = _captured(x, w13, w2, weights, ids, ws, cfg)
    for counts in ([160, 0], [100, 60], [130, 30]):
        ids.copy_(ids_with_counts(counts).to(ids))
        graph.replay()
        torch.cuda.synchronize()
        assert rel_err(graph_out, moe_ref.fused_moe(x, w13, w2, weights, ids)) < 2e-2, counts
