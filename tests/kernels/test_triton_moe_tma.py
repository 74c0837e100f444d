"""Triton fused MoE's TMA modes (tensor-descriptor loads of the weights, or of
the activations too) and M-tails (an expert's last block computing rows past
block_m) vs the torch reference, on CPU through the Triton interpreter; see
test_triton_moe.py for the dims and why they stay tiny."""

from __future__ import annotations

import pytest
import torch

import tinyengine.kernels.moe.reference as moe_ref
import tinyengine.kernels.moe.triton as triton_moe
from tests.kernels.moe_cases import DEVICE, TOL, ids_with_counts, make, rel_err, tma_config
from tinyengine.kernels.workspace import Workspace

# ----------------------------------------------------------------------------- TMA
# The interpreter (Triton 3.9) runs tensor-descriptor loads itself (zero fill
# past the tensor's bounds included), so these run the TMA code path on CPU.

SKEWED_IDS = torch.tensor([[1, 3, 1], [1, 2, 1], [1, 1, 1], [1, 1, 2], [1, 2, 1], [2, 1, 1],
                           [1, 3, 1], [1, 1, 1]] * 2)  # fmt: skip
TMA_CASES = {
    # (T, D, I, E, K, ids): D=48 / I=24 under 64-wide K blocks: K tails that
    # TMA zero-fills; I=24 / D=48 under 128/256-wide N blocks: N tails that
    # read the next expert's weight rows (dropped at the store).
    "k_tails": (5, 48, 24, 6, 3, None),
    "plain": (12, 64, 32, 8, 2, None),
    # Expert 1 gets 36 of 48 pairs, experts 0 and 4-7 none (empty experts).
    "skewed": (16, 64, 32, 8, 3, SKEWED_IDS),
    # Every pair on expert 6 of 16: one hot expert (its blocks back to back, the
    # last block's rows running past M), 15 empty.
    "one_hot_expert": (40, 48, 32, 16, 1, torch.full((40, 1), 6)),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mode", [triton_moe.TMA_W, triton_moe.TMA_AW])
@pytest.mark.parametrize("case", list(TMA_CASES))
def test_tma_modes_match_reference(case: str, mode: int, dtype: torch.dtype) -> None:
    t, d, i, e, k, ids = TMA_CASES[case]
    args = make(t, d, i, e, k, dtype, seed=11, ids=ids)
    cfg = tma_config(mode)
    out = triton_moe.launch_fused_moe(*args, workspace=Workspace(DEVICE), config=cfg)
    assert rel_err(out, moe_ref.fused_moe(*args)) < TOL[dtype]
    # Same tiles through pointers: the same products in the same order.
    plain = triton_moe.launch_fused_moe(*args, config=tma_config(triton_moe.TMA_OFF))
    if DEVICE == "cpu":
        assert torch.equal(out, plain)
    # The descriptors were really used (no silent fallback at these dims).
    x, w13, w2, _, topk_ids = args
    s = triton_moe._scratch(x, w13, w2, topk_ids, None, sorted_x=mode >= triton_moe.TMA_AW)
    gate_up = triton_moe._gate_up_launch(x, w13, s, k, cfg["gate_up"])
    down = triton_moe._down_launch(w2, s, cfg["down"])
    assert len(gate_up) == (2 if mode == triton_moe.TMA_AW else 1)  # the gather first
    for launches in (gate_up, down):
        kwargs = launches[-1][3]
        assert kwargs["TMA_W"] and kwargs["TMA_A"] == (mode == triton_moe.TMA_AW)


def test_tma_sorted_copy_and_scratch_garbage() -> None:
    # TMA_AW: xs (x in sorted-row order) lives in the workspace; rows a block
    # reads past its expert's segment come from xs / act rows written in this
    # call (or TMA's zeros past M): NaN-filled scratch must not matter.
    t, d, i, e, k, ids = TMA_CASES["skewed"]
    args = make(t, d, i, e, k, torch.bfloat16, seed=12, ids=ids)
    ws = Workspace(DEVICE)
    cfg = tma_config(triton_moe.TMA_AW)
    first = triton_moe.launch_fused_moe(*args, workspace=ws, config=cfg)
    ws.buffer.fill_(0xFF)
    again = triton_moe.launch_fused_moe(*args, workspace=ws, config=cfg)
    assert torch.equal(first, again)
    x, w13, w2, _, topk_ids = args
    s = triton_moe._scratch(x, w13, w2, topk_ids, None, sorted_x=True)
    triton_moe._group(topk_ids, s)
    triton_moe._run(triton_moe._gate_up_launch(x, w13, s, k, cfg["gate_up"])[:1])  # the gather
    assert torch.equal(s.xs, x[s.order // k].to(w13.dtype))


def test_tma_falls_back_where_alignment_rules_it_out() -> None:
    # I=20 bf16: act rows and w2 rows are 40 bytes, not a multiple of TMA's
    # 16: those operands go through pointers; w13's (D=64) still through TMA.
    t, d, i, e, k = 9, 64, 20, 4, 2
    args = make(t, d, i, e, k, torch.bfloat16, seed=13)
    cfg = tma_config(triton_moe.TMA_AW)
    out = triton_moe.launch_fused_moe(*args, config=cfg)
    assert rel_err(out, moe_ref.fused_moe(*args)) < TOL[torch.bfloat16]
    x, w13, w2, _, topk_ids = args
    s = triton_moe._scratch(x, w13, w2, topk_ids, None, sorted_x=True)
    assert triton_moe._gate_up_launch(x, w13, s, k, cfg["gate_up"])[-1][3]["TMA_W"]
    down = triton_moe._down_launch(w2, s, cfg["down"])[-1][3]
    assert not down["TMA_W"] and not down["TMA_A"]


def _tail_config(block_m: int, tail_m: int) -> dict:
    return {g: dict(c, block_m=block_m, tail_m=tail_m, tma=triton_moe.TMA_AW)
            for g, c in triton_moe.CLASS_CONFIGS[-1].items()}  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tails_cover_every_segment_shape(dtype: torch.dtype) -> None:
    # Tails (an expert's last M-block also computes up to tail_m rows past its
    # block_m main rows) with block_m = tail_m = 16, segments of every shape:
    # empty; one partial block; exactly one block (no tail); one block + a
    # 1-row / full tail; two blocks + a 1-row / full tail; three blocks + tail.
    counts = [0, 5, 16, 17, 32, 33, 48, 49, 70]
    args = make(sum(counts), 32, 16, len(counts), 1, dtype, seed=14, ids=ids_with_counts(counts))
    cfg = _tail_config(16, 16)
    ws = Workspace(DEVICE)
    out = triton_moe.launch_fused_moe(*args, workspace=ws, config=cfg)
    assert rel_err(out, moe_ref.fused_moe(*args)) < TOL[dtype]
    # Tails really ran, and garbage in the scratch never reaches the output.
    x, w13, w2, _, topk_ids = args
    s = triton_moe._scratch(x, w13, w2, topk_ids, None, sorted_x=True)
    assert triton_moe._gate_up_launch(x, w13, s, 1, cfg["gate_up"])[-1][3]["TAIL_M"] == 16
    assert triton_moe._down_launch(w2, s, cfg["down"])[-1][3]["TAIL_M"] == 16
    ws.buffer.fill_(0xFF)
    assert torch.equal(triton_moe.launch_fused_moe(*args, workspace=ws, config=cfg), out)
    no_tail = triton_moe.launch_fused_moe(*args, config=_tail_config(16, 0))
    assert rel_err(out, no_tail) < TOL[dtype]


def test_tails_need_tma_and_a_valid_size() -> None:
    # I=20 bf16: act rows are 40 bytes, so down's activations go through
    # pointers and its tail is off; gate_up (D=64) keeps TMA and its tail.
    args = make(40, 64, 20, 2, 1, torch.bfloat16, seed=15, ids=ids_with_counts([27, 13]))
    cfg = _tail_config(16, 16)
    out = triton_moe.launch_fused_moe(*args, config=cfg)
    assert rel_err(out, moe_ref.fused_moe(*args)) < TOL[torch.bfloat16]
    x, w13, w2, _, topk_ids = args
    s = triton_moe._scratch(x, w13, w2, topk_ids, None, sorted_x=True)
    assert triton_moe._gate_up_launch(x, w13, s, 1, cfg["gate_up"])[-1][3]["TAIL_M"] == 16
    assert triton_moe._down_launch(w2, s, cfg["down"])[-1][3]["TAIL_M"] == 0
    for bad in (24, 8, 32):  # not a power of two; below 16; above block_m
        with pytest.raises(ValueError, match="tail_m"):
            triton_moe.launch_fused_moe(*args, config={"down": {"block_m": 16, "tail_m": bad}})
