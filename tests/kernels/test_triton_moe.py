"""Triton fused MoE (tinyengine/kernels/moe/triton.py) vs the torch reference
(tinyengine/kernels/moe/reference.py).

CPU runs go through the Triton interpreter (~2 ms per program instance), so
shapes stay tiny (T <= 48 mostly, D = 48/64, I = 24/32, E = 4-16, K = 2-4).
Every size class's real tiles (config=CLASS_CONFIGS[c], 16- to 128-row
M-blocks, N-blocks up to 256 wide) run at these dims: wide N tiles wrap
around the small N, K tails mask, experts' segments cross block borders.
One test reaches the largest class without an override (T=256, E=8, K=2).
The TMA modes (tensor-descriptor loads) run in the interpreter too.

The TMA modes and M-tails are tested in test_triton_moe_tma.py, the GPU runs in
test_triton_moe_gpu.py; the problems they share come from moe_cases.py.
"""

from __future__ import annotations

import itertools

import pytest
import torch

import tinyengine.kernels.moe.reference as moe_ref
import tinyengine.kernels.moe.triton as triton_moe
from tests.kernels.moe_cases import CLASSES, DEVICE, TOL, make, rel_err
from tinyengine.kernels.workspace import Workspace

# ----------------------------------------------------------------------------- every class


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cls", CLASSES)
@pytest.mark.parametrize(
    ("num_tokens", "hidden", "inter", "experts", "top_k"),
    [(12, 64, 32, 8, 2), (1, 64, 32, 16, 4), (5, 48, 24, 6, 3)],
)
def test_each_class_matches_reference(num_tokens: int, hidden: int, inter: int,
                                      experts: int, top_k: int, cls: int,
                                      dtype: torch.dtype) -> None:  # fmt: skip
    # T=1: one row in each of K blocks. D=48 / I=24: K tails (masked) and N
    # tails (wrapped) in both GEMMs; E=6: a non-power-of-two expert count.
    args = make(num_tokens, hidden, inter, experts, top_k, dtype)
    out = triton_moe.launch_fused_moe(*args, config=triton_moe.CLASS_CONFIGS[cls])
    assert out.shape == args[0].shape and out.dtype == dtype
    assert rel_err(out, moe_ref.fused_moe(*args)) < TOL[dtype]


@pytest.mark.parametrize("cls", CLASSES)
def test_skewed_routing_empty_experts_and_multi_block_segments(cls: int) -> None:
    # Expert 1 gets 36 of the 48 pairs (three 16-row blocks, the last partial;
    # part of one 32- or 128-row block), experts 0 and 4-7 none; duplicate ids in a
    # row (a token choosing one expert twice) must sum both weights.
    ids = torch.tensor([[1, 3, 1], [1, 2, 1], [1, 1, 1], [1, 1, 2], [1, 2, 1], [2, 1, 1],
                        [1, 3, 1], [1, 1, 1]] * 2)  # fmt: skip
    assert (ids == 1).sum() == 36
    args = make(16, 64, 32, 8, 3, torch.float32, ids=ids)
    out = triton_moe.launch_fused_moe(*args, config=triton_moe.CLASS_CONFIGS[cls])
    assert rel_err(out, moe_ref.fused_moe(*args)) < TOL[torch.float32]


@pytest.mark.parametrize("cls", CLASSES)
def test_one_expert_receives_everything(cls: int) -> None:
    # Every token's first slot is expert 5 (40 rows: blocks of one expert back
    # to back), the other slot spread over the rest; E=16, most experts empty.
    g = torch.Generator().manual_seed(7)
    ids = torch.stack([torch.tensor([5, int(torch.randint(6, 16, (1,), generator=g))])
                       for _ in range(40)])  # fmt: skip
    args = make(40, 64, 32, 16, 2, torch.float32, seed=2, ids=ids)
    out = triton_moe.launch_fused_moe(*args, config=triton_moe.CLASS_CONFIGS[cls])
    assert rel_err(out, moe_ref.fused_moe(*args)) < TOL[torch.float32]


def test_largest_class_without_override() -> None:
    # E=8, K=2: 256 tokens are 64 rows per expert on average, the first
    # token count of the largest class; the tiles come from moe_config.
    t, d, i, e, k = 256, 64, 32, 8, 2
    assert triton_moe.moe_size_class(t, k, e) == len(CLASSES) - 1
    assert triton_moe.moe_size_class(t - 1, k, e) == len(CLASSES) - 2
    args = make(t, d, i, e, k, torch.float32, seed=5)
    out = triton_moe.fused_moe(*args)
    assert rel_err(out, moe_ref.fused_moe(*args)) < TOL[torch.float32]


def test_middle_class_without_override() -> None:
    t, d, i, e, k = 64, 64, 32, 8, 2  # 16 rows per expert: the middle class starts
    assert triton_moe.moe_size_class(t, k, e) == 1
    args = make(t, d, i, e, k, torch.bfloat16, seed=6)
    assert rel_err(triton_moe.fused_moe(*args), moe_ref.fused_moe(*args)) < TOL[torch.bfloat16]


@pytest.mark.parametrize("group_m", [0, 1, 2, 3, 100])
def test_program_order_covers_every_tile_once(group_m: int) -> None:
    # 8 M-blocks x 2 (gate/up) or 4 (down) N-blocks; uneven runs of group_m
    # M-blocks must still visit every tile. Scratch starts as NaN bytes, so a
    # missed tile shows up. The tiles are the same whatever the order: the
    # output is bit-identical to the plain order's.
    args = make(40, 64, 32, 4, 2, torch.float32, seed=8)
    tiles = dict(block_m=16, block_n=16, block_k=32, num_warps=4, num_stages=2)
    ws = Workspace(DEVICE)
    cfg0 = {g: dict(tiles, group_m=0) for g in triton_moe.GEMMS}
    plain = triton_moe.launch_fused_moe(*args, workspace=ws, config=cfg0)
    ws.buffer.fill_(0xFF)
    cfg = {g: dict(tiles, group_m=group_m) for g in triton_moe.GEMMS}
    out = triton_moe.launch_fused_moe(*args, workspace=ws, config=cfg)
    assert torch.equal(out, plain)
    assert rel_err(out, moe_ref.fused_moe(*args)) < TOL[torch.float32]


def test_scratch_garbage_never_reaches_the_output() -> None:
    # Padded rows of a block read row 0 and are dropped; nothing reads a
    # scratch row that was not written in this call. NaN-filled scratch proves it.
    args = make(9, 48, 24, 6, 3, torch.bfloat16, seed=9)
    ws = Workspace(DEVICE)
    first = triton_moe.launch_fused_moe(*args, workspace=ws, config=triton_moe.CLASS_CONFIGS[2])
    ws.buffer.fill_(0xFF)
    again = triton_moe.launch_fused_moe(*args, workspace=ws, config=triton_moe.CLASS_CONFIGS[2])
    assert torch.equal(first, again)


# ----------------------------------------------------------------------------- host side


def test_configs_are_few_and_classes_have_representatives() -> None:
    for e, k, d, i in [(256, 8, 7168, 2048), (64, 6, 2048, 1408), (8, 2, 64, 32)]:
        seen = {}
        for t in itertools.chain(range(1, 4096), range(4096, 70000, 97)):
            cfg = triton_moe.moe_config(t, k, e, d, i)
            seen.setdefault(repr(cfg), triton_moe.moe_size_class(t, k, e))
        assert len(seen) <= len(CLASSES) <= 3
        reps = triton_moe.moe_token_classes(10**6, top_k=k, num_experts=e)
        assert [triton_moe.moe_size_class(t, k, e) for t in reps] == list(CLASSES)
        assert {repr(triton_moe.moe_config(t, k, e, d, i)) for t in reps} == set(seen)
        for t in reps[1:]:  # the smallest token count of its class
            assert triton_moe.moe_size_class(t - 1, k, e) < triton_moe.moe_size_class(t, k, e)
    # Capped by the largest step; T=1 always there.
    assert triton_moe.moe_token_classes(511, top_k=8, num_experts=256) == [1]
    assert triton_moe.moe_token_classes(512, top_k=8, num_experts=256) == [1, 512]
    assert triton_moe.moe_token_classes(8192, top_k=8, num_experts=256) == [1, 512, 2048]


def test_moe_config_cuts_tiles_to_small_matrices() -> None:
    cfg = triton_moe.moe_config(10**5, 2, 8, 64, 32)  # the largest class
    assert cfg["gate_up"]["block_n"] <= 32 and cfg["gate_up"]["block_k"] <= 64
    assert cfg["down"]["block_n"] <= 64 and cfg["down"]["block_k"] <= 32
    big = triton_moe.moe_config(10**5, 8, 256, 7168, 2048)
    assert big == {g: dict(c) for g, c in triton_moe.CLASS_CONFIGS[-1].items()}
    assert big["gate_up"]["tail_m"] == big["down"]["tail_m"] == 64
    # fp32: half the stages and no tails (their ring would not fit on Hopper).
    fp32 = triton_moe.moe_config(10**5, 8, 256, 7168, 2048, elem_bytes=4)
    for gemm in triton_moe.GEMMS:
        assert fp32[gemm]["tail_m"] == 0
        assert fp32[gemm]["num_stages"] == big[gemm]["num_stages"] // 2


def test_config_override_merges_and_validates() -> None:
    args = make(6, 32, 16, 4, 2, torch.float32, seed=1)
    ref = moe_ref.fused_moe(*args)
    out = triton_moe.launch_fused_moe(*args, config={"down": {"block_n": 16}})  # partial: one field
    assert rel_err(out, ref) < TOL[torch.float32]
    with pytest.raises(ValueError, match="unknown GEMM"):
        triton_moe.launch_fused_moe(*args, config={"up": {}})
    with pytest.raises(ValueError, match="unknown fields"):
        triton_moe.launch_fused_moe(*args, config={"down": {"blockn": 16}})
    with pytest.raises(ValueError, match="power of two"):
        triton_moe.launch_fused_moe(*args, config={"gate_up": {"block_m": 24}})
    with pytest.raises(ValueError, match="tma"):
        triton_moe.launch_fused_moe(*args, config={"down": {"tma": 3}})


def test_block_bound_covers_any_routing() -> None:
    # The grid's M extent must cover sum_e cdiv(count_e, block_m) for every
    # split of the pairs over the experts: random splits plus the adversarial
    # one (one pair on each of E-1 experts, the rest on the last).
    g = torch.Generator().manual_seed(0)
    for pairs, experts, bm in [(16, 8, 16), (3, 8, 16), (2048, 256, 64), (64, 4, 16), (17, 2, 16),
                               (32768, 256, 128)]:  # fmt: skip
        bound = triton_moe.max_m_blocks(pairs, experts, bm)
        splits = [torch.bincount(torch.randint(0, experts, (pairs,), generator=g),
                                 minlength=experts).tolist() for _ in range(50)]  # fmt: skip
        n = min(experts, pairs)
        splits.append([1] * (n - 1) + [pairs - n + 1])
        for counts in splits:
            assert sum(-(-c // bm) for c in counts) <= bound


# ----------------------------------------------------------------------------- plumbing


def test_workspace_path_matches_allocating_path() -> None:
    args = make(6, 32, 32, 4, 2, torch.float32, seed=3)
    cfg = {g: {"block_n": 32, "block_k": 32} for g in triton_moe.GEMMS}
    ws = Workspace(DEVICE)
    out_ws = triton_moe.launch_fused_moe(*args, workspace=ws, config=cfg)
    assert ws.stats.num_growths == 1
    ws.lock()  # a second call of the same shape must fit without growing
    again = triton_moe.launch_fused_moe(*args, workspace=ws, config=cfg)
    out_none = triton_moe.launch_fused_moe(*args, config=cfg)
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
    out = triton_moe.fused_moe(x, w13, w2, weights, ids)
    assert rel_err(out, ref) < TOL[torch.float32]
    out32 = triton_moe.fused_moe(x, w13, w2, weights, ids.int())
    assert torch.equal(out32, out)


@pytest.mark.parametrize("experts", [300, 40000])  # int16 keys (past int8's range); int32 keys
def test_grouping_with_narrowed_keys_is_the_stable_sort(experts: int) -> None:
    assert triton_moe._key_dtype(experts) == (torch.int16 if experts < 2**15 else torch.int32)
    g = torch.Generator().manual_seed(6)
    # Ids near the top of the range (a wrong narrowing wraps them) and repeats.
    ids = torch.randint(experts - 40, experts, (16, 4), generator=g).to(DEVICE)
    x, w13, w2 = (torch.zeros(16, 8, device=DEVICE), torch.zeros(experts, 2, 8, device=DEVICE),
                  torch.zeros(experts, 8, 1, device=DEVICE))  # fmt: skip
    s = triton_moe._scratch(x, w13, w2, ids, None)
    triton_moe._group(ids, s)
    flat = ids.reshape(-1).cpu()
    assert torch.equal(s.order.cpu(), torch.sort(flat, stable=True).indices)
    assert torch.equal(s.counts.cpu().long(), torch.bincount(flat, minlength=experts))


def test_zero_tokens() -> None:
    x, w13, w2, weights, ids = make(1, 32, 16, 4, 2, torch.float32)
    out = triton_moe.fused_moe(x[:0], w13, w2, weights[:0], ids[:0])
    assert out.shape == (0, 32)


@pytest.mark.parametrize("cls", CLASSES)
def test_swiglu_limit_clamps_like_the_reference(cls: int) -> None:
    """DeepSeek-V4's swiglu_limit: gate <= L and -L <= up <= L before the
    activation. The inputs are scaled so that most pre-activations pass L,
    and the clamped result must differ from the unclamped one."""
    x, w13, w2, weights, ids = make(12, 64, 32, 8, 2, torch.float32)
    x = x * 40
    ref = moe_ref.fused_moe(x, w13, w2, weights, ids, swiglu_limit=1.0)
    out = triton_moe.launch_fused_moe(x, w13, w2, weights, ids, swiglu_limit=1.0,
                                      config=triton_moe.CLASS_CONFIGS[cls])  # fmt: skip
    assert rel_err(out, ref) < TOL[torch.float32]
    assert rel_err(moe_ref.fused_moe(x, w13, w2, weights, ids), ref) > 0.1


def test_a_swiglu_limit_of_zero_still_clamps() -> None:
    """swiglu_limit = 0 clamps gate to <= 0 and up to 0 (as HF's clamp does),
    so every expert's output is 0; only None means no clamp."""
    x, w13, w2, weights, ids = make(6, 64, 32, 8, 2, torch.float32)
    ref = moe_ref.fused_moe(x, w13, w2, weights, ids, swiglu_limit=0.0)
    out = triton_moe.launch_fused_moe(x, w13, w2, weights, ids, swiglu_limit=0.0)
    assert not ref.any() and not out.any()
