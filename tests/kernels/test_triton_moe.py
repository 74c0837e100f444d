"""Triton fused MoE (tinyengine/kernels/moe/triton.py) vs the torch reference
(tinyengine/kernels/moe/reference.py).

CPU runs go through the Triton interpreter (~2 ms per program instance), so
shapes stay tiny (T <= 48 mostly, D = 48/64, I = 24/32, E = 4-16, K = 2-4).
Every size class's real tiles (config=CLASS_CONFIGS[c], 16- to 128-row
M-blocks, N-blocks up to 256 wide) run at these dims: wide N tiles wrap
around the small N, K tails mask, experts' segments cross block borders.
One test reaches the largest class without an override (T=256, E=8, K=2).
The TMA modes (tensor-descriptor loads) run in the interpreter too.
"""

from __future__ import annotations

import itertools

import pytest
import torch

import tinyengine.kernels.moe.reference as moe_ref
import tinyengine.kernels.moe.triton as triton_moe
from tinyengine.kernels.workspace import Workspace

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# Relative Frobenius. bf16: the interpreter truncates fp32->bf16 casts (the
# reference rounds to nearest), which roughly triples the rounding error.
TOL = {torch.float32: 1e-4 if DEVICE == "cuda" else 1e-5, torch.bfloat16: 4e-2}
CLASSES = range(len(triton_moe.CLASS_CONFIGS))


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


def _tma_config(mode: int) -> dict:
    return {g: dict(c, tma=mode) for g, c in triton_moe.CLASS_CONFIGS[-1].items()}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mode", [triton_moe.TMA_W, triton_moe.TMA_AW])
@pytest.mark.parametrize("case", list(TMA_CASES))
def test_tma_modes_match_reference(case: str, mode: int, dtype: torch.dtype) -> None:
    t, d, i, e, k, ids = TMA_CASES[case]
    args = make(t, d, i, e, k, dtype, seed=11, ids=ids)
    cfg = _tma_config(mode)
    out = triton_moe.launch_fused_moe(*args, workspace=Workspace(DEVICE), config=cfg)
    assert rel_err(out, moe_ref.fused_moe(*args)) < TOL[dtype]
    # Same tiles through pointers: the same products in the same order.
    plain = triton_moe.launch_fused_moe(*args, config=_tma_config(triton_moe.TMA_OFF))
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
    cfg = _tma_config(triton_moe.TMA_AW)
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
    cfg = _tma_config(triton_moe.TMA_AW)
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


def _ids_with_counts(counts: list[int]) -> torch.Tensor:
    """K=1 routing, tokens shuffled, expert e receiving counts[e] tokens."""
    ids = torch.cat([torch.full((c,), e) for e, c in enumerate(counts)])
    return ids[torch.randperm(len(ids), generator=torch.Generator().manual_seed(5))][:, None]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tails_cover_every_segment_shape(dtype: torch.dtype) -> None:
    # Tails (an expert's last M-block also computes up to tail_m rows past its
    # block_m main rows) with block_m = tail_m = 16, segments of every shape:
    # empty; one partial block; exactly one block (no tail); one block + a
    # 1-row / full tail; two blocks + a 1-row / full tail; three blocks + tail.
    counts = [0, 5, 16, 17, 32, 33, 48, 49, 70]
    args = make(sum(counts), 32, 16, len(counts), 1, dtype, seed=14, ids=_ids_with_counts(counts))
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
    args = make(40, 64, 20, 2, 1, torch.bfloat16, seed=15, ids=_ids_with_counts([27, 13]))
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
                               config=_tma_config(mode))  # fmt: skip
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
    cfg = _tma_config(triton_moe.TMA_AW) if cls == "tma" else triton_moe.CLASS_CONFIGS[cls]
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
                                    ids=_ids_with_counts([160, 0]))  # fmt: skip
    cfg = {g: dict(c, group_m=1) for g, c in triton_moe.CLASS_CONFIGS[-1].items()}
    assert cfg["gate_up"]["tail_m"] == cfg["down"]["tail_m"] == 64
    ws = Workspace("cuda")
    graph, graph_out = _captured(x, w13, w2, weights, ids, ws, cfg)
    for counts in ([160, 0], [100, 60], [130, 30]):
        ids.copy_(_ids_with_counts(counts).to(ids))
        graph.replay()
        torch.cuda.synchronize()
        assert rel_err(graph_out, moe_ref.fused_moe(x, w13, w2, weights, ids)) < 2e-2, counts
