"""The tensor-core GEMM (tinyengine/kernels/gemm/triton.py) against fp32 math:
every tile bucket, K not a multiple of the tile, bias, wrapped rows; the
interpreter on a CPU (fp32, small), the GPU in bf16/fp16/fp32."""

from __future__ import annotations

import pytest
import torch

from tinyengine.kernels.gemm.triton import matmul, tiles

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 1e-4, torch.float16: 2**-9, torch.bfloat16: 2**-6}


def _problem(m: int, n: int, k: int, dtype: torch.dtype, bias: bool):
    g = torch.Generator().manual_seed(m * 7 + n * 3 + k)
    x = torch.randn(m, k, generator=g).to(dtype).to(DEVICE)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(dtype).to(DEVICE)
    b = torch.randn(n, generator=g).to(dtype).to(DEVICE) if bias else None
    ref = x.float() @ w.float().T + (0 if b is None else b.float())
    return x, w, b, ref


@pytest.mark.parametrize(("m", "n", "k"), [(9, 48, 40), (70, 33, 64), (130, 80, 96)])
@pytest.mark.parametrize("bias", [False, True])
def test_matmul_matches_fp32_math(m, n, k, bias):
    x, w, b, ref = _problem(m, n, k, torch.float32, bias)
    out = matmul(x, w, b)
    assert out.dtype == torch.float32 and out.shape == (m, n)
    torch.testing.assert_close(out, ref, rtol=TOL[torch.float32], atol=TOL[torch.float32])


def test_matmul_rejects_mismatched_operands():
    x = torch.zeros(4, 8)
    with pytest.raises(ValueError, match="need x"):
        matmul(x, torch.zeros(3, 9))
    with pytest.raises(ValueError, match="dtypes torch.float32, torch.float64"):
        matmul(x, torch.zeros(3, 8, dtype=torch.float64))
    with pytest.raises(ValueError, match="bias must be"):
        matmul(x, torch.zeros(3, 8), torch.zeros(4))


def test_tiles_cover_every_bucket():
    assert [tiles(m, 2)[:4] for m in (9, 64, 65, 512, 513)] == [
        (64, 64, 128, 4), (64, 64, 128, 4), (128, 128, 64, 4), (128, 128, 64, 4), (128, 256, 64, 8)
    ]  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("m", "n", "k"), [(9, 1024, 4096), (300, 200, 1000), (1000, 4096, 512)])
def test_matmul_on_the_gpu(dtype, m, n, k):
    x, w, b, ref = _problem(m, n, k, dtype, bias=True)
    out = matmul(x, w, b)
    torch.testing.assert_close(out.float(), ref, rtol=TOL[dtype], atol=TOL[dtype])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_rows_bits_do_not_depend_on_the_kernel_or_the_batch(dtype):
    """Rows computed inside 1100 rows (the persistent TMA kernel, large
    tiles) equal the same rows computed alone, in small batches (the
    pointer kernel) and in mid-sized ones (TMA, smaller tiles)."""
    x, w, b, _ = _problem(1100, 1024, 4096, dtype, bias=True)
    whole = matmul(x, w, b)
    for rows in (slice(0, 1), slice(0, 9), slice(3, 67), slice(5, 70), slice(100, 300),
                 slice(200, 800)):  # fmt: skip
        assert torch.equal(matmul(x[rows], w, b), whole[rows]), rows


@pytest.mark.gpu
def test_a_new_row_count_compiles_nothing():
    """Any row count reuses the variants its tile bucket compiled: the
    persistent kernel's program count and M are not specialized on, so a
    prefill chunk of a length warmup never ran compiles nothing."""
    from tinyengine.kernels import jit_monitor

    assert jit_monitor.install()
    w = torch.randn(512, 1024, dtype=torch.bfloat16, device=DEVICE)
    for m in (9, 16, 1, 96, 600):  # every variant: pointer kernel, both TMA buckets
        matmul(torch.randn(m, 1024, dtype=torch.bfloat16, device=DEVICE), w)
    before = jit_monitor.num_compiles()
    for m in (65, 77, 130, 300, 511, 513, 700, 1001):
        x = torch.randn(m, 1024, dtype=torch.bfloat16, device=DEVICE)
        torch.testing.assert_close(matmul(x, w).float(), x.float() @ w.float().T,
                                   rtol=TOL[torch.bfloat16], atol=TOL[torch.bfloat16])  # fmt: skip
    assert jit_monitor.num_compiles() == before, jit_monitor.compiled_since(before)
