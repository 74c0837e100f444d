"""Fused gate_up GEMV + SiLU-and-mul (tinyengine/kernels/gemv/silu.py, M == 1) vs its torch
reference and vs the unfused path (skinny_linear, then the activation), and the
`linear_silu_mul` dispatcher the MLP calls. On CPU the kernel runs under the
Triton interpreter (tests/conftest.py), so the CPU shapes stay small."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import tinyengine.kernels.gemv.silu as gemv_silu
import tinyengine.kernels.gemv.triton as gemv
from tinyengine.kernels import torch_ops
from tinyengine.kernels.activation.triton import silu_and_mul_triton
from tinyengine.kernels.gemv.reference import skinny_linear_silu_mul_torch
from tinyengine.kernels.gemv.silu import linear_silu_mul, skinny_linear_silu_mul
from tinyengine.kernels.gemv.triton import GemvConfig, skinny_linear

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# BLOCK_N counts weight rows per program: half gate rows, half their up rows.
FMA_SMALL = GemvConfig(block_n=4, block_k=64, num_warps=4, num_stages=2, use_dot=False)
FMA_R_SMALL = GemvConfig(8, 64, 4, 2, use_dot=False, reduce_each_step=True)
FMA_TINY = GemvConfig(block_n=2, block_k=32, num_warps=1, num_stages=1, use_dot=False)
DOT_SMALL = GemvConfig(block_n=16, block_k=64, num_warps=4, num_stages=2, use_dot=True)


def _problem(inter: int, k: int, dtype: torch.dtype, bias: bool, device: str = DEVICE):
    g = torch.Generator().manual_seed(inter * 1000 + k + bias)
    x = torch.randn(1, k, generator=g).to(dtype).to(device)
    w = (torch.randn(2 * inter, k, generator=g) * (2 / k**0.5)).to(dtype).to(device)
    b = torch.randn(2 * inter, generator=g).to(dtype).to(device) if bias else None
    return x, w, b


def _ulps(a: torch.Tensor, b: torch.Tensor) -> int:
    """Max distance in representable steps between two bf16/fp16 tensors."""

    def ordered(t: torch.Tensor) -> torch.Tensor:
        bits = t.contiguous().view(torch.int16).int()
        return torch.where(bits < 0, -(bits & 0x7FFF), bits)  # sign-magnitude -> monotonic

    return int((ordered(a) - ordered(b)).abs().max().item())


def _unfused(x, w, b, config=None):
    """The two-launch path the fused kernel replaces (on CPU both kernels run
    under the interpreter)."""
    return silu_and_mul_triton(skinny_linear(x, w, b, config=config))


# Exact under the interpreter (checked); on the GPU the compiler may lay out the
# fused tile's reductions differently, so one step is allowed there.
MAX_ULPS = 0 if DEVICE == "cpu" else 1


# (config, I, K): tails in I (I not a multiple of BLOCK_N // 2) and in K (K not
# a multiple of BLOCK_K), and even cases; None is the default (pick_config) choice.
FP32_CASES = [
    (None, 37, 100),
    (None, 64, 128),
    (None, 13, 200),
    (FMA_SMALL, 37, 100),
    (FMA_SMALL, 16, 128),
    (FMA_R_SMALL, 13, 200),
    (FMA_TINY, 5, 72),
    (DOT_SMALL, 37, 100),
    (DOT_SMALL, 16, 64),
]


@pytest.mark.parametrize(
    "cfg,inter,k", FP32_CASES, ids=lambda v: "default" if v is None else str(v)
)
@pytest.mark.parametrize("bias", [False, True])
def test_fused_matches_reference_fp32(cfg: GemvConfig | None, inter: int, k: int, bias: bool):
    x, w, b = _problem(inter, k, torch.float32, bias)
    out = skinny_linear_silu_mul(x, w, b, config=cfg)
    ref = skinny_linear_silu_mul_torch(x, w, b)
    assert out.shape == (1, inter) and out.dtype == torch.float32
    err = (out - ref).abs().max().item()
    assert torch.allclose(out, ref, rtol=1e-5, atol=1e-5), f"max abs err {err}"


def test_reference_is_the_unfused_math() -> None:
    """The reference: fp32 GEMV rounded to dtype, then silu(gate) * up in fp32
    rounded once (the Triton activation's rounding)."""
    x, w, b = _problem(24, 32, torch.bfloat16, True, device="cpu")
    y = (x.float() @ w.float().T + b.float()).to(torch.bfloat16)
    gate, up = y.float()[:, :24], y.float()[:, 24:]
    expected = (F.silu(gate) * up).to(torch.bfloat16)
    assert torch.equal(skinny_linear_silu_mul_torch(x, w, b), expected)
    out = torch.empty(1, 24, dtype=torch.bfloat16)
    assert skinny_linear_silu_mul_torch(x, w, b, out=out) is out
    assert torch.equal(out, expected)


@pytest.mark.parametrize("cfg", [None, FMA_SMALL, DOT_SMALL], ids=str)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fused_half_matches_unfused(cfg: GemvConfig | None, dtype: torch.dtype) -> None:
    """bf16/fp16, same config for both launches: the two-launch path's result
    (same tile, same per-row fp32 sums, same rounding steps)."""
    x, w, b = _problem(37, 100, dtype, True)
    out = skinny_linear_silu_mul(x, w, b, config=cfg)
    assert out.dtype == dtype and out.shape == (1, 37)
    assert _ulps(out, _unfused(x, w, b, config=cfg)) <= MAX_ULPS


@pytest.mark.parametrize("m", [2, 5, 8])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fused_rows_match_unfused(m: int, dtype: torch.dtype) -> None:
    """2-8 rows on the DOT tile (the default config): the two-launch path's
    result, row for row."""
    x, w, b = _problem(37, 100, dtype, True)
    xm = (x + torch.arange(m, device=DEVICE, dtype=dtype)[:, None] / 8).contiguous()
    out = skinny_linear_silu_mul(xm, w, b)
    assert out.shape == (m, 37)
    assert _ulps(out, _unfused(xm, w, b)) <= MAX_ULPS


def test_fused_out_and_no_write_past_inter() -> None:
    """A caller-given out that is a slice of a wider buffer: filled in place,
    nothing written past I."""
    x, w, b = _problem(13, 64, torch.float32, True)
    out_wide = torch.zeros(1, 24, device=DEVICE)
    out = out_wide[:, :13]
    res = skinny_linear_silu_mul(x, w, b, out=out, config=FMA_SMALL)
    assert res.data_ptr() == out.data_ptr()
    assert torch.allclose(out, skinny_linear_silu_mul_torch(x, w, b), rtol=1e-5, atol=1e-5)
    assert (out_wide[:, 13:] == 0).all()


def test_fused_rejects_bad_args() -> None:
    x, w, b = _problem(8, 32, torch.float32, True)
    with pytest.raises(ValueError, match="M must be in"):
        skinny_linear_silu_mul(x.expand(gemv.MAX_M + 1, -1), w)
    with pytest.raises(ValueError, match="M must be in"):
        skinny_linear_silu_mul(x[:0], w)
    x2, w2, _ = _problem(8, 128, torch.float32, False)  # two K steps of FMA_SMALL
    with pytest.raises(ValueError, match="FMA config serves more than one row in one K step"):
        skinny_linear_silu_mul(x2.expand(2, -1), w2, config=FMA_SMALL)
    with pytest.raises(ValueError, match="even row count"):
        skinny_linear_silu_mul(x, w[:15])
    with pytest.raises(ValueError, match="need x"):
        skinny_linear_silu_mul(x, w[:, :16])  # K mismatch
    with pytest.raises(ValueError, match="need x"):
        skinny_linear_silu_mul(x[0], w)  # 1-D x
    with pytest.raises(ValueError, match="dtypes"):
        skinny_linear_silu_mul(x, w.double())  # mixed
    with pytest.raises(ValueError, match="dtypes"):
        skinny_linear_silu_mul(x.double(), w.double())  # unsupported
    with pytest.raises(ValueError, match="bias dtype"):
        skinny_linear_silu_mul(x, w, b.double())
    with pytest.raises(ValueError, match="bias must be"):
        skinny_linear_silu_mul(x, w, b[:8])  # [I] instead of [2I]
    with pytest.raises(ValueError, match="contiguous last dim"):
        skinny_linear_silu_mul(x, w.t().contiguous().t())
    with pytest.raises(ValueError, match="out must be"):
        skinny_linear_silu_mul(x, w, out=torch.empty(1, 16, device=DEVICE))  # [1, 2I]
    bad = GemvConfig(block_n=1, block_k=32, num_warps=1, num_stages=1, use_dot=False)
    with pytest.raises(ValueError, match="BLOCK_N"):
        skinny_linear_silu_mul(x, w, config=bad)


# --- dispatch ------------------------------------------------------------------


def test_dispatch_falls_back_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """On CPU: F.linear then the torch activation, exactly as the layers run it."""

    def boom(*a, **kw):
        raise AssertionError("the fused kernel must not run on CPU")

    monkeypatch.setattr(gemv_silu, "skinny_linear_silu_mul", boom)
    for m in (1, 3):
        x = torch.randn(m, 32, dtype=torch.bfloat16)
        w = torch.randn(48, 32, dtype=torch.bfloat16)
        b = torch.randn(48, dtype=torch.bfloat16)
        gate, up = F.linear(x, w, b).chunk(2, dim=-1)
        assert torch.equal(linear_silu_mul(x, w, b), F.silu(gate) * up)


def test_dispatch_uses_fused_kernel_for_few_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """With the predicate forced to the kernel's eligibility (as on CUDA),
    rows it takes go through the fused kernel, more rows through linear +
    activation."""
    calls: list[str] = []
    real_fused, real_plain = gemv_silu.skinny_linear_silu_mul, gemv.skinny_linear

    def spy_fused(*a, **kw):
        calls.append("fused")
        return real_fused(*a, **kw)

    def spy_plain(*a, **kw):
        calls.append("plain")
        return real_plain(*a, **kw)

    monkeypatch.setattr(gemv_silu, "skinny_linear_silu_mul", spy_fused)
    monkeypatch.setattr(gemv, "skinny_linear", spy_plain)
    monkeypatch.setattr(gemv, "skinny_linear_ok", lambda x, w, b=None: gemv._eligible(x, w, b))
    x, w, b = _problem(24, 64, torch.bfloat16, True)
    out = linear_silu_mul(x, w, b)
    assert calls == ["fused"]
    assert _ulps(out, _unfused(x, w, b)) <= MAX_ULPS
    x2 = torch.cat([x, x])
    out2 = linear_silu_mul(x2, w, b)
    assert calls == ["fused", "fused"]
    assert _ulps(out2, _unfused(x2, w, b)) <= MAX_ULPS
    calls.clear()
    many = x.expand(gemv.MAX_M + 1, -1).contiguous()
    out3 = linear_silu_mul(many, w, b)
    assert calls == []  # past the kernel's rows: F.linear and the activation
    gate, up = F.linear(many, w, b).chunk(2, dim=-1)
    assert torch.equal(out3, F.silu(gate) * up)  # SiluAndMul's torch path (CPU)


def test_torch_op_set_never_reaches_the_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """The op set is the switch: the torch set's linear_silu_mul is F.linear
    then the torch activation even where the kernel's predicate holds."""

    def boom(*a, **kw):
        raise AssertionError("the torch op set must not launch the kernel")

    monkeypatch.setattr(gemv_silu, "skinny_linear_silu_mul", boom)
    monkeypatch.setattr(gemv, "skinny_linear", boom)
    monkeypatch.setattr(gemv, "skinny_linear_ok", lambda x, w, b=None: True)
    x, w, b = _problem(8, 32, torch.bfloat16, False, device="cpu")
    gate, up = F.linear(x, w).chunk(2, dim=-1)
    assert torch.equal(torch_ops().linear_silu_mul(x, w), F.silu(gate) * up)


# --- GPU (bf16, realistic shapes) ----------------------------------------------

GPU_SHAPES = [(14336, 4096), (11008, 4096), (1536, 576), (1000, 300)]  # last: tails


@pytest.mark.gpu
@pytest.mark.parametrize("inter,k", GPU_SHAPES)
@pytest.mark.parametrize("bias", [False, True])
def test_gpu_fused_matches_unfused(inter: int, k: int, bias: bool) -> None:
    x, w, b = _problem(inter, k, torch.bfloat16, bias)
    out = skinny_linear_silu_mul(x, w, b)
    unfused = silu_and_mul_triton(skinny_linear(x, w, b))
    assert _ulps(out, unfused) <= 1
    ref = skinny_linear_silu_mul_torch(x, w, b)
    assert torch.allclose(out.float(), ref.float(), rtol=2**-6, atol=2**-6)
    assert gemv.skinny_linear_ok(x, w, b)
    assert _ulps(linear_silu_mul(x, w, b), unfused) <= 1


@pytest.mark.gpu
@pytest.mark.parametrize("inter,k", GPU_SHAPES)
def test_gpu_fused_bit_exact(inter: int, k: int) -> None:
    """Same tile and K loop as the plain launch, so the same fp32 sums: equal
    bits, for every shape."""
    x, w, b = _problem(inter, k, torch.bfloat16, True)
    unfused = silu_and_mul_triton(skinny_linear(x, w, b))
    assert torch.equal(skinny_linear_silu_mul(x, w, b), unfused)


@pytest.mark.gpu
def test_gpu_dispatch_fallback_and_graph_capture() -> None:
    """M > 1 on CUDA: linear + the Triton activation. M == 1: the fused kernel
    captured in a CUDA graph replays to the eager result."""
    x, w, b = _problem(1536, 576, torch.bfloat16, True)
    x4 = x.repeat(4, 1)
    gate, up = F.linear(x4, w, b).chunk(2, dim=-1)
    assert torch.equal(linear_silu_mul(x4, w, b), silu_and_mul_triton(F.linear(x4, w, b)))
    assert torch.allclose(
        linear_silu_mul(x4, w, b).float(), (F.silu(gate) * up).float(), rtol=2**-6, atol=2**-6
    )
    eager = linear_silu_mul(x, w, b)  # compiles outside the capture
    static_x = x.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        linear_silu_mul(static_x, w, b)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = linear_silu_mul(static_x, w, b)
    static_x.copy_(x)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, eager)


@pytest.mark.parametrize("rows", [17, 40, 64])
def test_fused_serves_up_to_64_rows(rows: int) -> None:
    """Past 16 rows (the dispatcher sends up to MAX_M): the DOT tile
    with the rows padded to 32 or 64 equals the two-launch path."""
    x, w, b = _problem(37, 100, torch.bfloat16, True)
    many = (x.float() * torch.linspace(-2, 2, rows, device=x.device)[:, None]).to(x.dtype)
    out = skinny_linear_silu_mul(many, w, b)
    assert out.shape == (rows, 37)
    assert _ulps(out, _unfused(many, w, b)) <= MAX_ULPS
    # gate and up are each rounded before their product: two ulps apart at most
    ref = skinny_linear_silu_mul_torch(many, w, b).float()
    assert torch.allclose(out.float(), ref, rtol=2**-5, atol=2**-6)
