"""RMSNorm fused into the skinny GEMM (tinyengine/kernels/gemv/norm_linear.py:
the FMA tile in one K step, and the DOT loop over several) vs the two
launches it replaces (the norm kernel, then the skinny kernel with the same
tile) and vs the torch reference; the
`rms_norm_linear` dispatcher; and the op sets' `rms_norm_linear`. On CPU the
kernels run under the Triton interpreter (tests/conftest.py)."""

from __future__ import annotations

import itertools

import pytest
import torch

import tinyengine.kernels.gemv.norm_linear as norm_linear
import tinyengine.kernels.gemv.tiles as gemv_tiles
from tinyengine.kernels import torch_ops
from tinyengine.kernels.batch_invariant import batch_invariant_ops
from tinyengine.kernels.gemv.reference import rms_norm_linear as rms_norm_linear_ref
from tinyengine.kernels.gemv.silu import skinny_linear_silu_mul
from tinyengine.kernels.gemv.triton import MAX_M, _num_sms, skinny_linear
from tinyengine.kernels.norm.triton import rms_norm_triton

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
EPS = 1e-6


def _problem(n: int, k: int, dtype: torch.dtype, bias: bool, residual: bool, seed: int = 0,
             rows: int = 1):  # fmt: skip
    g = torch.Generator().manual_seed(seed * 7919 + n * 1000 + k + rows)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(dtype).to(DEVICE)

    x = rand(rows, k, scale=3.0)
    res = rand(rows, k) if residual else None
    nw = rand(k, scale=0.2) + 1.0
    w = rand(n, k, scale=2 / k**0.5)
    b = rand(n) if bias else None
    return x, res, nw, w, b


def _fma_tile(x, w):
    """The FMA tile for x's rows (the dispatcher's choice up to FMA_MAX_M rows)."""
    return gemv_tiles.fma_config(x.shape[0], w.shape[0], w.shape[1], _num_sms(x.device))


def _two_launches(x, nw, res, w, b, silu_mul, cfg=None):
    """The norm kernel, then the skinny kernel with the tile the fused launch
    uses (`cfg`, else the FMA tile)."""
    if res is None:
        h, new_res = rms_norm_triton(x, nw, EPS), x
    else:
        h, new_res = rms_norm_triton(x, nw, EPS, res)
    cfg = cfg or _fma_tile(x, w)
    linear = skinny_linear_silu_mul if silu_mul else skinny_linear
    return linear(h, w, b, config=cfg), new_res


# Exact under the interpreter; on the GPU the fused tile's sum of squares may
# be reduced in another order than the norm kernel's, so one step is allowed.
MAX_DIFF = {torch.float32: 0.0, torch.bfloat16: 0.0} if DEVICE == "cpu" else {
    torch.float32: 1e-5, torch.bfloat16: 2**-6}  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,k", [(37, 100), (64, 128), (24, 256)])
@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("silu_mul", [False, True])
@pytest.mark.parametrize("rows", [1, 3])
def test_fused_equals_norm_then_linear(dtype, n, k, residual, silu_mul, rows):
    x, res, nw, w, b = _problem(2 * n, k, dtype, bias=residual, residual=residual, rows=rows)
    x_before = x.clone()
    y, new_res = norm_linear.skinny_rms_norm_linear(x, nw, EPS, res, w, b, silu_mul=silu_mul,
                                                    config=_fma_tile(x, w))  # fmt: skip
    want, want_res = _two_launches(x, nw, res, w, b, silu_mul)
    assert torch.equal(x, x_before), "the input row was written"
    assert torch.equal(new_res, want_res), "the new residual is x + residual, rounded once"
    if res is None:
        assert new_res is x
    assert y.shape == want.shape == (rows, n if silu_mul else 2 * n)
    for i in range(1, rows):  # each row as its one-row launch computes it
        yi, ri = norm_linear.skinny_rms_norm_linear(
            x[i : i + 1], nw, EPS, None if res is None else res[i : i + 1], w, b,
            silu_mul=silu_mul, config=_fma_tile(x, w),
        )  # fmt: skip
        assert torch.equal(yi, y[i : i + 1]) and torch.equal(ri, new_res[i : i + 1])
    diff = (y.float() - want.float()).abs().max().item()
    assert diff <= MAX_DIFF[dtype] * max(1.0, want.float().abs().max().item())
    ref, ref_res = rms_norm_linear_ref(x, nw, EPS, res, w, b, silu_mul=silu_mul)
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    # (The interpreter rounds fp32 -> bf16 its own way, so bf16 sums may
    # differ from torch's by a step there.)
    assert torch.allclose(new_res.float(), ref_res.float(), rtol=tol, atol=0)
    scale = max(1.0, ref.float().abs().max().item())  # bf16 steps of the largest output
    assert torch.allclose(y.float(), ref.float(), rtol=tol, atol=tol * scale)


# The DOT loop in 32-wide K steps, so a row spans several (K = 100: a
# partial last one) and the prologue's first pass and per-step chunks both run.
DOT_TILE = gemv_tiles.GemvConfig(block_n=16, block_k=32, num_warps=4, num_stages=2, use_dot=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,k", [(37, 100), (24, 256)])
@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("silu_mul", [False, True])
@pytest.mark.parametrize("rows", [3, 16, 17])
def test_dot_loop_fused_equals_norm_then_linear(dtype, n, k, residual, silu_mul, rows):
    x, res, nw, w, b = _problem(2 * n, k, dtype, bias=residual, residual=residual, rows=rows)
    x_before = x.clone()
    y, new_res = norm_linear.skinny_rms_norm_linear(x, nw, EPS, res, w, b, silu_mul=silu_mul,
                                                    config=DOT_TILE)  # fmt: skip
    want, want_res = _two_launches(x, nw, res, w, b, silu_mul, DOT_TILE)
    assert torch.equal(x, x_before), "the input rows were written"
    assert torch.equal(new_res, want_res), "the new residual is x + residual, rounded once"
    assert y.shape == want.shape == (rows, n if silu_mul else 2 * n)
    # The sum of squares is formed a K step at a time here, over the whole
    # row in the norm kernel: rstd may differ in its last bit, which can move
    # a normalized value by one step of the dtype.
    tol = 1e-5 if dtype == torch.float32 else 2**-6
    assert (y.float() - want.float()).abs().max().item() <= tol * max(
        1.0, want.float().abs().max().item()
    )
    ref, _ = rms_norm_linear_ref(x, nw, EPS, res, w, b, silu_mul=silu_mul)
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    scale = max(1.0, ref.float().abs().max().item())
    assert torch.allclose(y.float(), ref.float(), rtol=tol, atol=tol * scale)


def test_fused_launch_refuses_what_it_cannot_do():
    x, res, nw, w, b = _problem(16, 64, torch.float32, bias=False, residual=True)
    rows = MAX_M + 1  # past the skinny kernel's rows
    with pytest.raises(ValueError, match=f"M must be in 1..{MAX_M}"):
        norm_linear.skinny_rms_norm_linear(x.repeat(rows, 1), nw, EPS, res.repeat(rows, 1), w)
    with pytest.raises(ValueError, match="even row count"):
        norm_linear.skinny_rms_norm_linear(x, nw, EPS, res, w[:15], silu_mul=True)
    big = 2 * 8192  # past ONE_STEP_MAX_K: the row needs more than one K step
    xb = torch.randn(1, big, device=DEVICE)
    with pytest.raises(ValueError, match="K <= one step"):
        norm_linear.skinny_rms_norm_linear(xb, torch.ones(big, device=DEVICE), EPS, None,
                                           torch.randn(4, big, device=DEVICE),
                                           config=gemv_tiles.M1_CONFIG)  # fmt: skip


@pytest.mark.parametrize("rows", [1, 2, norm_linear.NORM_MAX_M + 1])
def test_dispatcher_matches_reference(rows, monkeypatch):
    """Off the GPU, and past NORM_MAX_M rows, the dispatcher runs the norm
    kernel and the linear, never the fused launch."""
    if DEVICE == "cpu" or rows > norm_linear.NORM_MAX_M:

        def boom(*args, **kwargs):
            raise AssertionError("the fused launch ran")

        monkeypatch.setattr(norm_linear, "skinny_rms_norm_linear", boom)
    g = torch.Generator().manual_seed(rows)
    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float32
    x = torch.randn(rows, 96, generator=g).to(dtype).to(DEVICE)
    res = torch.randn(rows, 96, generator=g).to(dtype).to(DEVICE)
    nw = (1 + 0.1 * torch.randn(96, generator=g)).to(dtype).to(DEVICE)
    w = (torch.randn(40, 96, generator=g) / 10).to(dtype).to(DEVICE)
    for silu_mul in (False, True):
        y, new_res = norm_linear.rms_norm_linear(x, nw, EPS, res, w, silu_mul=silu_mul)
        ref, ref_res = rms_norm_linear_ref(x, nw, EPS, res, w, silu_mul=silu_mul)
        assert torch.equal(new_res, ref_res)
        tol = 1e-5 if dtype == torch.float32 else 3e-2
        assert torch.allclose(y.float(), ref.float(), rtol=tol, atol=tol)


def test_invariant_set_rows_do_not_depend_on_the_batch():
    """The batch-invariant set composes its own norm and linears: a row's
    result is the same alone or among others."""
    ops = batch_invariant_ops(torch_ops())
    g = torch.Generator().manual_seed(5)
    x, res = torch.randn(6, 64, generator=g), torch.randn(6, 64, generator=g)
    nw, w = 1 + 0.1 * torch.randn(64, generator=g), torch.randn(48, 64, generator=g) / 8
    for silu_mul in (False, True):
        y, new_res = ops.rms_norm_linear(x, nw, EPS, res, w, silu_mul=silu_mul)
        for i in (0, 4):
            yi, ri = ops.rms_norm_linear(x[i : i + 1], nw, EPS, res[i : i + 1], w,
                                         silu_mul=silu_mul)  # fmt: skip
            assert torch.equal(yi[0], y[i]) and torch.equal(ri[0], new_res[i])


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", [(4096, 1024), (6144, 1024), (2048, 2048), (1024, 3072)])
def test_gpu_model_shapes(n, k):
    """Qwen3-0.6B's norm + linear pairs (and wider K) at bf16 on the GPU."""
    sms = _num_sms(torch.device(DEVICE))
    for silu_mul, rows in itertools.product((False, True), (1, 2, 3, 8, 16)):
        x, res, nw, w, b = _problem(n, k, torch.bfloat16, bias=False, residual=True, rows=rows)
        cfg = gemv_tiles.pick_config(rows, n, k, sms)
        want, want_res = _two_launches(x, nw, res, w, None, silu_mul, cfg)
        runs = [norm_linear.rms_norm_linear(x, nw, EPS, res, w, silu_mul=silu_mul)]
        if cfg.use_dot:  # the DOT loop's prologue, whatever the dispatcher's bound
            runs.append(norm_linear.skinny_rms_norm_linear(x, nw, EPS, res, w, silu_mul=silu_mul,
                                                           config=cfg))  # fmt: skip
        for y, new_res in runs:
            assert torch.equal(new_res, want_res)
            diff = (y.float() - want.float()).abs().max().item()
            assert diff <= 2**-6 * max(1.0, want.float().abs().max().item())


@pytest.mark.gpu
@pytest.mark.parametrize("num_prompts", [2, 3])  # decode on the FMA tile; on the DOT loop
def test_gpu_engine_with_and_without_the_fused_norm(num_prompts, tmp_path, monkeypatch):
    """A bf16 Qwen3 (q/k norms, GQA) decoding with CUDA graphs: the fused
    norm + linear against the norm kernel then the linear. Greedy tokens
    equal; log-probs within bf16 noise (a sum of squares reduced in another
    order can move a normalized value by one bf16 step). Two prompts decode
    on the FMA tile; three on the DOT loop (a graph of 4 rows), which the
    dispatcher fuses only when its bound allows (raised here)."""
    monkeypatch.setattr(norm_linear, "NORM_MAX_M", 16)
    from tests.hf_models import make_tiny_hf_model
    from tinyengine import LLM, SamplingParams

    # Wide enough that both pairs fuse: 4+ weight rows a program on the FMA
    # tile at 132 SMs, and qkv's 2,560 rows not split over K on the DOT loop.
    path = make_tiny_hf_model("qwen3", tmp_path / "qwen3", hidden_size=1024,
                              intermediate_size=1024, num_attention_heads=16,
                              num_key_value_heads=2, head_dim=128)  # fmt: skip
    launches = []
    fused_launch = norm_linear.skinny_rms_norm_linear

    def counted(*args, **kwargs):
        launches.append(kwargs.get("silu_mul", False))
        return fused_launch(*args, **kwargs)

    monkeypatch.setattr(norm_linear, "skinny_rms_norm_linear", counted)
    prompts = [
        {"prompt_token_ids": [3 + i, 41, 7 * i + 2, 19] * (4 + i)} for i in range(num_prompts)
    ]
    params = SamplingParams(max_tokens=20, temperature=0.0, logprobs=2)
    runs = []
    for fused in (True, False):
        if not fused:
            monkeypatch.setattr(norm_linear, "_fusable", lambda *args: False)
        llm = LLM(str(path), dtype="bfloat16", max_model_len=256, max_num_seqs=4,
                  print_startup_report=False)  # fmt: skip
        runs.append([o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)])
        del llm
        torch.cuda.empty_cache()
    assert set(launches) == {False, True}, "the fused launch ran for both pairs"
    # A random tiny model's next-token distribution is nearly flat, so the
    # runs may part at a near tie; up to there every step agrees.
    for a, b in zip(*runs, strict=True):
        for ta, tb, la, lb in zip(a.token_ids, b.token_ids, a.logprobs, b.logprobs, strict=True):
            if ta != tb:
                assert tb in la, "the other run's token is not even second here"
                assert la[ta].logprob - la[tb].logprob < 0.05, "parted where no tie was"
                break
            assert abs(la[ta].logprob - lb[tb].logprob) < 0.05
