"""Triton skinny GEMM (tinyengine/kernels/gemv/triton.py) vs fp32 math, and the dispatch
predicate that decides when the model layers use it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import triton

import tinyengine.kernels.gemv.tiles as gemv_tiles
import tinyengine.kernels.gemv.triton as gemv
from tinyengine.kernels import torch_ops, triton_ops
from tinyengine.kernels.gemv.reference import skinny_linear_torch
from tinyengine.kernels.gemv.tiles import GemvConfig, pick_config
from tinyengine.kernels.gemv.triton import skinny_linear
from tinyengine.kernels.workspace import Workspace

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 1e-5, torch.float16: 2**-9, torch.bfloat16: 2**-6}

FMA_SMALL = GemvConfig(block_n=4, block_k=64, num_warps=4, num_stages=2, use_dot=False)
FMA_R_SMALL = GemvConfig(8, 64, 4, 2, use_dot=False, reduce_each_step=True)
DOT_SMALL = GemvConfig(block_n=16, block_k=64, num_warps=4, num_stages=2, use_dot=True)


def _problem(m: int, n: int, k: int, dtype: torch.dtype, bias: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed * 1000 + m * 100 + n + k)
    x = torch.randn(m, k, generator=g).to(dtype).to(DEVICE)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(dtype).to(DEVICE)
    b = torch.randn(n, generator=g).to(dtype).to(DEVICE) if bias else None
    ref = x.float() @ w.float().T
    if b is not None:
        ref = ref + b.float()
    return x, w, b, ref


def _check(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    assert out.dtype == dtype and out.shape == ref.shape
    tol = TOL[dtype]
    err = (out.float() - ref).abs().max().item()
    assert torch.allclose(out.float(), ref, rtol=tol, atol=tol), f"max abs err {err}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("n,k", [(200, 256), (48, 64), (129, 100), (64, 250)])
@pytest.mark.parametrize("bias", [False, True])
def test_skinny_linear_default_config(
    dtype: torch.dtype, m: int, n: int, k: int, bias: bool
) -> None:
    x, w, b, ref = _problem(m, n, k, dtype, bias)
    _check(skinny_linear(x, w, b), ref, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [9, 16, 17, 33, 64])
@pytest.mark.parametrize("n,k", [(200, 256), (33, 96)])
def test_skinny_linear_up_to_64_rows(dtype: torch.dtype, m: int, n: int, k: int) -> None:
    """9-64 rows (the dispatcher's bound, MAX_M): the DOT loop with
    the rows padded to 16, 32 or 64, on the default config and split over K
    with a workspace, every row equal to the fp32 product."""
    x, w, b, ref = _problem(m, n, k, dtype, True)
    cfg = pick_config(m, n, k, 132)
    assert cfg.use_dot
    _check(skinny_linear(x, w, b, config=cfg), ref, dtype)
    split = GemvConfig(16, 32, 4, 2, use_dot=True, split_k=3)
    _check(skinny_linear(x, w, b, config=split, workspace=Workspace(x.device)), ref, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cfg", [FMA_SMALL, FMA_R_SMALL, DOT_SMALL], ids=str)
@pytest.mark.parametrize("n,k", [(200, 256), (77, 200), (48, 64)])  # tails in N and K
@pytest.mark.parametrize("bias", [False, True])
def test_skinny_linear_m1_configs(
    dtype: torch.dtype, cfg: GemvConfig, n: int, k: int, bias: bool
) -> None:
    """M == 1 through both inner loops, with several K steps and tails."""
    x, w, b, ref = _problem(1, n, k, dtype, bias)
    _check(skinny_linear(x, w, b, config=cfg), ref, dtype)


@pytest.mark.parametrize("m", [2, 7])
def test_skinny_linear_strided_x_and_out(m: int) -> None:
    """x rows with a stride (a slice of a wider buffer) and a caller-given out."""
    dtype = torch.bfloat16
    x_wide, w, b, _ = _problem(m, 96, 192, dtype, True)
    x = x_wide[:, :160]  # stride(0) 192, stride(1) 1
    w = w[:, :160].contiguous()
    ref = x.float() @ w.float().T + b.float()
    out_wide = torch.zeros(m, 128, dtype=dtype, device=DEVICE)
    out = out_wide[:, :96]
    res = skinny_linear(x, w, b, out=out, config=DOT_SMALL)
    assert res.data_ptr() == out.data_ptr()
    _check(out, ref, dtype)
    assert (out_wide[:, 96:] == 0).all()  # nothing written past N


def test_reference_matches_f_linear() -> None:
    x, w, b, _ = _problem(3, 40, 32, torch.float32, True)
    assert torch.allclose(skinny_linear_torch(x, w, b), F.linear(x, w, b), atol=1e-5)


def test_fma_config_rejects_rows_over_several_k_steps() -> None:
    x, w, _, _ = _problem(2, 32, 128, torch.float32, False)
    with pytest.raises(ValueError, match="more than one row in one K step"):
        skinny_linear(x, w, config=FMA_SMALL)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [2, 3, 8])
@pytest.mark.parametrize("n,k", [(200, 256), (77, 200), (48, 64)])  # tails in N and K
@pytest.mark.parametrize("bias", [False, True])
def test_fma_rows_equal_one_row_launches(
    dtype: torch.dtype, m: int, n: int, k: int, bias: bool
) -> None:
    """2-8 rows on the one-step FMA tile: each row's output is, bit for bit,
    the one-row launch of that row (the same sum in the same order)."""
    x, w, b, ref = _problem(m, n, k, dtype, bias)
    cfg = gemv_tiles.fma_config(m, n, k, 132)
    assert not cfg.use_dot and cfg.block_k >= k and cfg.block_n >= triton.next_power_of_2(m)
    out = skinny_linear(x, w, b, config=cfg)
    _check(out, ref, dtype)
    for i in range(m):
        assert torch.equal(out[i : i + 1], skinny_linear(x[i : i + 1], w, b, config=cfg))


@pytest.mark.parametrize("m", [0, gemv.MAX_M + 1])
def test_skinny_linear_rejects_bad_m(m: int) -> None:
    x = torch.randn(m, 64, device=DEVICE)
    with pytest.raises(ValueError):
        skinny_linear(x, torch.randn(32, 64, device=DEVICE))


def test_skinny_linear_rejects_a_bias_of_another_dtype() -> None:
    x, w, b, _ = _problem(1, 32, 64, torch.float32, True)
    with pytest.raises(ValueError, match="bias dtype"):
        skinny_linear(x, w, b.double())


def test_pick_config_host_only() -> None:
    """Llama-3-8B shapes on 132 SMs: enough programs per SM, BLOCK_N floors kept."""
    for n, k in [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (128256, 4096)]:
        for m in (1, 2, 8):
            cfg = pick_config(m, n, k, 132)
            assert cfg.block_n >= (16 if cfg.use_dot else 1)
            if m > 1:  # the FMA loop serves more rows in one K step only
                fma = k <= gemv_tiles.ONE_STEP_MAX_K and m <= gemv_tiles.FMA_MAX_M
                assert cfg.use_dot != fma
                assert pick_config(m, n, k, 132, tensor_cores=True).use_dot
            if not cfg.use_dot and cfg.block_n > gemv_tiles.MIN_BLOCK_N_FMA:
                assert -(-n // cfg.block_n) >= gemv_tiles.MIN_PROGRAMS_PER_SM * 132
            if cfg.use_dot:  # these matrices have enough tiles: no split
                assert cfg.split_k == 1


def test_one_row_with_short_k_gets_a_one_step_tile() -> None:
    """M == 1 and K <= ONE_STEP_MAX_K: the whole row width in one K step (no
    loop), at most ONE_STEP_ELEMS weight elements a program; up to FMA_MAX_M
    rows take the same tile, more rows (or tensor_cores) the MMA config, and
    longer K the pipelined loop."""
    for n, k in [(4096, 1024), (6144, 1024), (1024, 2048), (1024, 3072), (6144, 4096), (37, 100)]:
        cfg = pick_config(1, n, k, 132)
        assert not cfg.use_dot and cfg.num_stages == 1
        assert cfg.block_k >= k and cfg.block_k == triton.next_power_of_2(k)
        assert cfg.block_n * cfg.block_k <= max(
            gemv_tiles.ONE_STEP_ELEMS, gemv_tiles.MIN_BLOCK_N_FMA * cfg.block_k
        )
        rows = pick_config(gemv_tiles.FMA_MAX_M, n, k, 132)
        assert not rows.use_dot and rows.block_k == cfg.block_k
        assert pick_config(gemv_tiles.FMA_MAX_M + 1, n, k, 132).use_dot
        assert pick_config(2, n, k, 132, tensor_cores=True).use_dot
    cfg = pick_config(1, 4096, 14336, 132)
    assert cfg.block_k < 14336 and cfg == gemv_tiles.M1_CONFIG


def test_programmatic_launch_never_off_the_gpu() -> None:
    """The interpreter and CPU tensors never launch with PDL (the interpreter
    has no gdc_wait); the module switch turns it off everywhere."""
    from tinyengine.kernels import launch

    assert not launch.programmatic_launch(torch.device("cpu"))
    if torch.cuda.is_available():
        want = torch.cuda.get_device_capability()[0] >= 9 and not launch.interpreting()
        assert launch.programmatic_launch(torch.device("cuda")) == want


def test_triton_without_pdl_launches_without_it(monkeypatch) -> None:
    """Before Triton 3.4 there is no gdc_wait: kernels/gdc.py then gives None
    for the names (only dead USE_PDL branches mention them), and no launch
    asks for PDL or passes `launch_pdl`, which such a Triton would refuse."""
    import importlib
    import sys

    from tinyengine.kernels import gdc, launch

    had_pdl = gdc.AVAILABLE
    monkeypatch.setitem(sys.modules, "triton.language.extra.cuda", None)  # import fails
    old = importlib.reload(gdc)
    launch._gdc_available.cache_clear()
    try:
        assert not old.AVAILABLE and old.gdc_wait is None and old.gdc_launch_dependents is None
        monkeypatch.setattr(launch, "interpreting", lambda: False)
        monkeypatch.setattr(launch, "_pdl_capable", lambda device: True)  # a Hopper, say
        assert not launch.programmatic_launch(torch.device("cuda"))
        assert launch.pdl_kwargs(torch.device("cuda")) == {}
    finally:
        monkeypatch.undo()
        importlib.reload(gdc)
        launch._gdc_available.cache_clear()
    assert gdc.AVAILABLE == had_pdl and (gdc.gdc_wait is not None) == had_pdl


# --- dispatch ------------------------------------------------------------------


def _args(m=1, k=64, n=32, dtype=torch.bfloat16, bias=False):
    x = torch.randn(m, k, dtype=dtype)
    w = torch.randn(n, k, dtype=dtype)
    b = torch.randn(n, dtype=dtype) if bias else None
    return x, w, b


@pytest.mark.parametrize("m", [1, 4, 8, 16, 64])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bias", [False, True])
def test_eligible_accepts(m: int, dtype: torch.dtype, bias: bool) -> None:
    assert gemv._eligible(*_args(m=m, dtype=dtype, bias=bias))


def test_eligible_rejects() -> None:
    x, w, b = _args(bias=True)
    assert not gemv._eligible(*_args(m=gemv.MAX_M + 1))  # too many rows: cuBLAS
    assert not gemv._eligible(*_args(m=0))
    assert not gemv._eligible(*_args(dtype=torch.float32))  # only bf16/fp16 dispatch
    assert not gemv._eligible(x, w.half(), None)  # mixed dtypes
    assert not gemv._eligible(x.unsqueeze(0), w, None)  # 3-D x
    assert not gemv._eligible(x, w.t().contiguous().t(), None)  # non-contiguous weight
    assert not gemv._eligible(torch.randn(64, 2, dtype=x.dtype).t(), w, None)  # x.stride(1) != 1
    assert not gemv._eligible(x, w, b.float())  # bias dtype
    assert not gemv._eligible(x, w[:, :32].contiguous(), None)  # K mismatch


def test_dispatch_falls_back_on_cpu() -> None:
    """On CPU the predicate is False even for an eligible problem, and the layers
    never import the kernel module's path: they call F.linear directly."""
    x, w, b = _args(m=1, bias=True)
    assert gemv._eligible(x, w, b)
    assert not gemv.skinny_linear_ok(x, w, b)
    assert torch.equal(gemv.linear(x, w, b), F.linear(x, w, b))


def test_op_set_is_the_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    """The torch op set's linear is F.linear even where the kernel's predicate
    holds; the Triton set on CUDA dispatches through gemv.linear."""

    def boom(*a, **kw):
        raise AssertionError("the torch op set must not launch the kernel")

    monkeypatch.setattr(gemv, "skinny_linear", boom)
    monkeypatch.setattr(gemv, "skinny_linear_ok", lambda x, w, b=None: True)
    x, w, b = _args(bias=True)
    assert torch.equal(torch_ops().linear(x, w, b), F.linear(x, w, b))
    assert triton_ops("cuda").linear is gemv.linear


def test_dispatch_uses_kernel_when_predicate_holds(monkeypatch: pytest.MonkeyPatch) -> None:
    """linear() routes through skinny_linear exactly when the predicate holds."""
    calls: list[tuple[int, ...]] = []
    real = gemv.skinny_linear

    def spy(x, w, b=None, out=None, **kw):
        calls.append(tuple(x.shape))
        return real(x, w, b, out, **kw)

    monkeypatch.setattr(gemv, "skinny_linear", spy)
    monkeypatch.setattr(gemv, "skinny_linear_ok", lambda x, w, b=None: gemv._eligible(x, w, b))
    x, w, b = _args(m=3, k=64, n=48, bias=True)
    out = gemv.linear(x.to(DEVICE), w.to(DEVICE), b.to(DEVICE))
    assert calls == [(3, 64)]
    ref = x.float() @ w.float().T + b.float()
    _check(out, ref.to(DEVICE), torch.bfloat16)
    x9, w9, _ = _args(m=gemv.MAX_M + 1)
    gemv.linear(x9, w9)  # ineligible: F.linear, no kernel call
    assert calls == [(3, 64)]


def test_layers_use_f_linear_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """Both op sets a CPU engine can pick run linear layers as F.linear."""
    from tinyengine.models.parallel_layers import ParallelLMHead, QKVParallelLinear

    def boom(*a, **kw):
        raise AssertionError("kernel must not run on CPU")

    monkeypatch.setattr(gemv, "skinny_linear", boom)
    qkv = QKVParallelLinear(64, 16, 4, 2, bias=True)
    torch.nn.init.normal_(qkv.weight)
    torch.nn.init.normal_(qkv.bias)
    x = torch.randn(2, 64)
    head = ParallelLMHead(100, 64)
    torch.nn.init.normal_(head.weight)
    for ops in (torch_ops(), triton_ops("cpu")):
        assert torch.equal(qkv(x, ops), F.linear(x, qkv.weight, qkv.bias))
        assert torch.equal(head(x, ops), F.linear(x, head.weight))


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 2, 8])
@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 14336), (128256, 4096)])
def test_gpu_llama8b_shapes(m: int, n: int, k: int) -> None:
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
    # More than one row: these weights are past the multi-row size limit,
    # so F.linear (cuBLAS) serves them; the kernel still computes them right.
    assert gemv.skinny_linear_ok(x, w) == (m == 1)
    out = skinny_linear(x, w)
    ref = x.float() @ w.float().T
    assert torch.allclose(out.float(), ref, rtol=2**-6, atol=2**-6)


def test_pick_config_splits_k_for_few_output_tiles() -> None:
    """A small model's 1024-row o_proj / down at 2-16 rows has 32 DOT tiles on
    132 SMs: K splits until the programs cover the SMs (<= SPLIT_K_MAX, each
    slice >= 2 K steps); matrices with enough tiles are not split."""
    for n, k in [(1024, 2048), (1024, 3072)]:
        cfg = pick_config(8, n, k, 132, tensor_cores=True)
        assert 2 <= cfg.split_k <= gemv_tiles.SPLIT_K_MAX
        assert k // cfg.split_k >= 2 * cfg.block_k
    assert pick_config(8, 1024, 256, 132, tensor_cores=True).split_k == 1  # K too short
    assert pick_config(8, 6144, 1024, 132, tensor_cores=True).split_k == 1
    assert pick_config(1, 1024, 2048, 132).split_k == 1  # the FMA path never splits


def test_split_k_past_a_locked_arena_runs_unsplit() -> None:
    """After the lock only eager steps call the kernel (graphs replay): a
    split whose partials a locked arena cannot hold runs one program per
    tile instead of raising, and takes no ticket."""
    x, w, b, ref = _problem(4, 40, 300, torch.float32, True)
    cfg = GemvConfig(16, 32, 4, 2, use_dot=True, split_k=3)
    ws = Workspace(x.device)
    ws.lock()
    _check(skinny_linear(x, w, b, config=cfg, workspace=ws), ref, torch.float32)
    assert ws.size == 0 and ws.num_tickets == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [2, 5, 16, 40])
@pytest.mark.parametrize("n,k,split", [(48, 256, 2), (40, 300, 3), (64, 512, 4), (33, 96, 8)])
def test_split_k_matches_reference_and_resets_tickets(
    dtype: torch.dtype, m: int, n: int, k: int, split: int
) -> None:
    """Split over K with the last program of a tile adding the partials in
    slice order: the partials come from the workspace's arena and the
    tickets from its persistent counters; close to the fp32 reference,
    equal bit for bit from run to run, and every ticket back at 0 for the
    next launch (a graph replays the same launch). Without a workspace the
    same config runs unsplit."""
    x, w, b, ref = _problem(m, n, k, dtype, True)
    cfg = GemvConfig(16, 32, 4, 2, use_dot=True, split_k=split)
    ws = Workspace(x.device)
    first = skinny_linear(x, w, b, config=cfg, workspace=ws)
    _check(first, ref, dtype)
    assert ws.size > 0 and ws.num_tickets > 0  # the split's scratch
    assert torch.equal(skinny_linear(x, w, b, config=cfg, workspace=ws), first)
    assert not ws.tickets(ws.num_tickets).any()
    _check(skinny_linear(x, w, b, config=cfg), ref, dtype)
