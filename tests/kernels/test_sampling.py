"""Fused sampling (tinyengine/kernels/sampling/): the Triton Gumbel-argmax kernel vs its
torch reference on the same random numbers, the rules it keeps (ties, -inf,
greedy rows), the distribution it draws from. The Sampler's fused path is in
test_sampling_sampler.py.

The interpreter costs ~25 ms per program instance (one per row, or per row and
split), so CPU shapes stay tiny; statistical checks run on the torch reference,
which is pinned to the kernel token for token, and on the kernel itself on the
GPU. Every random draw uses a fixed seed: a tolerance is about the maths, not
about flakiness.
"""

from __future__ import annotations

import math

import pytest
import torch

import tinyengine.kernels.sampling.triton as sampling
from tests.kernels.sampling_helpers import DEVICE, near_reference, randn, seeds_like
from tinyengine.kernels.sampling.reference import (
    gumbel_argmax_torch,
    gumbel_noise_torch,
    gumbel_uniforms_torch,
)
from tinyengine.kernels.sampling.triton import (
    gumbel_argmax_triton,
    gumbel_noise_triton,
    gumbel_uniforms_triton,
    launch_gumbel_argmax,
)

# Extreme keys too: the seed is a 64-bit Philox key, sign bit included.
SEEDS = [0, 1, -1, 2**62 + 12345, -(2**63), 2**63 - 1, 987654321987]


def run(logits, inv_t, seeds, **kw) -> torch.Tensor:
    """The kernel on DEVICE, result on the host."""
    inv_t = torch.as_tensor(inv_t, dtype=torch.float32)
    draw = launch_gumbel_argmax if kw else gumbel_argmax_triton  # kw: a forced launch shape
    out = draw(logits.to(DEVICE), inv_t.to(DEVICE), seeds.to(DEVICE), **kw)
    assert out.dtype == torch.int64 and out.shape == (logits.shape[0],)
    return out.cpu()


def reference(logits, inv_t, seeds) -> torch.Tensor:
    return gumbel_argmax_torch(logits, torch.as_tensor(inv_t, dtype=torch.float32), seeds)


# ------------------------------------------------------------------ random numbers


@pytest.mark.parametrize("vocab", [1, 7, 64, 65, 300])
def test_uniforms_match_torch_bit_for_bit(vocab: int) -> None:
    seeds = torch.tensor(SEEDS)
    u = gumbel_uniforms_triton(seeds.to(DEVICE), vocab).cpu()
    assert torch.equal(u, gumbel_uniforms_torch(seeds, vocab))
    assert u.min() > 0 and u.max() < 1  # never 0 or 1: the noise stays finite


def test_noise_matches_torch_and_is_finite() -> None:
    seeds = torch.tensor(SEEDS)
    noise = gumbel_noise_triton(seeds.to(DEVICE), 333).cpu()
    ref = gumbel_noise_torch(seeds, 333)
    assert torch.isfinite(noise).all()
    # Equal up to the last bits of log2 (numpy's / the GPU's vs torch's).
    assert torch.allclose(noise, ref, rtol=0, atol=1e-4 if DEVICE == "cuda" else 1e-5)


def test_noise_extremes_stay_finite_and_bounded() -> None:
    """The reference on many uniforms, both ends included: Gumbel noise in log2
    units lies in [-log2(24), log2(1/E_min)] ~ [-4.6, 23.5], finite."""
    noise = gumbel_noise_torch(torch.arange(64), 4096)
    assert torch.isfinite(noise).all()
    assert noise.min() > -5 and noise.max() < 26
    # A standard Gumbel g (mean Euler's gamma, variance pi^2 / 6) in log2
    # units: g * log2(e) + log2(ln 2), the shift being the dropped constant.
    mean = 0.5772156649 * math.log2(math.e) + math.log2(math.log(2))
    var = math.pi**2 / 6 * math.log2(math.e) ** 2
    assert abs(noise.double().mean().item() - mean) < 0.01
    assert abs(noise.double().var().item() - var) < 0.02


# ------------------------------------------------------------------ kernel vs reference


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_kernel_equals_reference(dtype: torch.dtype) -> None:
    inv_t = [1.0, 0.0, 2.0, 0.5, 0.0, 1 / 1.3]  # 0 = greedy
    logits = randn(len(inv_t), 1000, seed=1).to(dtype)
    seeds = seeds_like(len(inv_t))
    assert torch.equal(run(logits, inv_t, seeds), reference(logits, inv_t, seeds))


@pytest.mark.parametrize(
    ("vocab", "block", "splits"),
    [(333, 16, 1), (333, 16, 3), (333, 32, 2), (777, 16, 7), (777, 16, 64)],
)
def test_split_and_block_never_change_tokens(vocab: int, block: int, splits: int) -> None:
    """Chunks of 16 or 32 counters (64 or 128 columns) and up to 13 splits:
    several chunks per split, splits ending mid-row, a last chunk past the vocab
    (neither vocab is a multiple of 64)."""
    inv_t = [1.0, 0.0, 0.25]
    logits, seeds = randn(3, vocab, seed=vocab), seeds_like(3, seed=vocab)
    chunks = -(-sampling._quarter(vocab) // block)
    shape = sampling._plan(3, vocab, torch.device("cpu"), splits, block)
    assert shape[3] == min(splits, chunks)  # really that many splits
    tokens = run(logits, inv_t, seeds, num_splits=splits, block=block)
    assert torch.equal(tokens, reference(logits, inv_t, seeds))


def test_strided_inputs() -> None:
    """Row-strided logits (a vocab slice of wider rows) and inv_temperature /
    seeds as strided columns of a table, as the Sampler passes them."""
    wide = randn(4, 120, seed=3)
    logits = wide[:, :100]
    table = torch.tensor([[9.0, 1.0], [9.0, 0.0], [9.0, 3.0], [9.0, 0.7]])
    seed_table = torch.stack([seeds_like(4), seeds_like(4, seed=1)], dim=1)
    out = gumbel_argmax_triton(
        logits.to(DEVICE), table[:, 1].to(DEVICE), seed_table[:, 1].to(DEVICE)
    ).cpu()
    assert torch.equal(out, reference(logits, table[:, 1], seed_table[:, 1]))


def test_inputs_unchanged_and_argument_checks() -> None:
    logits = randn(2, 50).to(DEVICE)
    inv_t = torch.tensor([1.0, 0.0], device=DEVICE)
    seeds = seeds_like(2).to(DEVICE)
    before = (logits.clone(), inv_t.clone(), seeds.clone())
    gumbel_argmax_triton(logits, inv_t, seeds)
    assert all(torch.equal(a, b) for a, b in zip((logits, inv_t, seeds), before, strict=True))
    empty = gumbel_argmax_triton(logits[:0], inv_t[:0], seeds[:0])
    assert empty.shape == (0,) and empty.dtype == torch.int64
    with pytest.raises(ValueError, match="contiguous"):
        gumbel_argmax_triton(logits.t(), inv_t, seeds)
    with pytest.raises(ValueError, match="shape"):
        gumbel_argmax_triton(logits, inv_t[:1], seeds)
    with pytest.raises(ValueError, match="float32"):
        gumbel_argmax_triton(logits, inv_t.double(), seeds)


# ------------------------------------------------------------------ rules


def test_greedy_rows_are_torch_argmax_with_ties() -> None:
    """Few distinct values, so every row has tied maxima, some across split
    boundaries and across the kernel's quarter-row lanes: the lowest index wins."""
    logits = torch.randint(0, 3, (6, 200), generator=torch.Generator().manual_seed(4)).float()
    logits[5] = 1.0  # all equal: 0
    seeds = seeds_like(6)
    expected = logits.argmax(dim=-1)
    for splits in (None, 3):
        tokens = run(logits, [0.0] * 6, seeds, num_splits=splits, block=16)
        assert torch.equal(tokens, expected)
    # bf16: the same, on values bf16 holds exactly.
    assert torch.equal(run(logits.bfloat16(), [0.0] * 6, seeds), expected)


def test_neg_inf_never_chosen() -> None:
    vocab = 300
    logits = randn(5, vocab, seed=5)
    logits[:, :200] = float("-inf")  # two thirds banned, across all four lanes
    logits[3, :] = float("-inf")
    logits[3, 123] = -1e30  # the only finite logit wins
    logits[4, :] = float("-inf")  # all -inf: 0, as torch.argmax
    inv_t = [1e-3, 1.0, 0.0, 5.0, 1.0]  # 1e-3: T = 1000, nearly uniform
    seeds = seeds_like(5)
    for splits in (None, 4):
        tokens = run(logits, inv_t, seeds, num_splits=splits, block=16).tolist()
        assert all(t >= 200 for t in tokens[:3]), tokens
        assert tokens[3] == 123 and tokens[4] == 0
    assert run(logits[4:], [0.0], seeds[4:]).tolist() == [0]


def test_same_seed_same_draw_other_seed_other_draw() -> None:
    """Near-flat logits over 1000 tokens: a draw is a function of the seed."""
    logits = randn(1, 1000, scale=0.01).expand(6, -1).contiguous()
    seeds = torch.tensor([11, 12, 11, 13, 14, 12])
    tokens = run(logits, [1.0] * 6, seeds).tolist()
    assert tokens[0] == tokens[2] and tokens[1] == tokens[5]
    assert len({tokens[0], tokens[1], tokens[3], tokens[4]}) == 4, tokens


# df = 7 (8 tokens): P(chi2 > 30) ~ 1e-4, so only a wrong distribution fails.
CHI2_LIMIT_DF7 = 30.0
SMALL_LOGITS = torch.tensor([1.0, 0.5, 0.0, -0.5, -1.0, 0.2, 2.0, -3.0])


def chi_square(tokens: torch.Tensor, probs: torch.Tensor) -> float:
    counts = torch.bincount(tokens.cpu(), minlength=probs.numel()).double()
    expected = probs.double() * tokens.numel()
    return (((counts - expected) ** 2) / expected).sum().item()


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_reference_draws_follow_softmax(temperature: float) -> None:
    """20k draws (one call, 20k rows and seeds) from softmax(logits / T). The
    reference is the kernel token for token (tests above), so this is the
    kernel's distribution; the GPU runs the same check on the kernel itself."""
    n = 20_000
    logits = SMALL_LOGITS.expand(n, -1)
    inv_t = torch.full((n,), 1 / temperature)
    tokens = gumbel_argmax_torch(logits, inv_t, seeds_like(n, seed=int(temperature * 10)))
    assert chi_square(tokens, torch.softmax(SMALL_LOGITS / temperature, 0)) < CHI2_LIMIT_DF7


# ------------------------------------------------------------------ GPU


@pytest.mark.gpu
def test_gpu_bf16_decode_batch() -> None:
    """Decode shape: 256 rows of a 151,936-token vocab in bf16, and small
    batches (the vocab-split path), vs the reference on the same seeds."""
    vocab = 151_936
    g = torch.Generator(device="cuda").manual_seed(0)
    exact = []
    for rows in (256, 7, 1):
        logits = (torch.randn(rows, vocab, device="cuda", generator=g) * 4).bfloat16()
        logits[:, 1000:2000] = float("-inf")
        inv_t = torch.tensor([0.0, 1.0, 1 / 0.7, 1 / 1.5] * 64, device="cuda")[:rows]
        seeds = torch.randint(2**62, (rows,), device="cuda", generator=g)
        tokens = gumbel_argmax_triton(logits, inv_t, seeds)
        exact.append(near_reference(logits, inv_t, seeds, tokens))
        assert not ((tokens >= 1000) & (tokens < 2000)).any()
        greedy = inv_t == 0
        assert torch.equal(tokens[greedy], logits[greedy].float().argmax(dim=-1))
        for splits in (1, 5):
            split_tokens = launch_gumbel_argmax(logits, inv_t, seeds, num_splits=splits)
            assert torch.equal(split_tokens, tokens), splits
    assert torch.cat(exact).float().mean() > 0.99


@pytest.mark.gpu
@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_gpu_kernel_draws_follow_softmax(temperature: float) -> None:
    n = 200_000
    logits = SMALL_LOGITS.cuda().expand(n, -1).contiguous()
    inv_t = torch.full((n,), 1 / temperature, device="cuda")
    g = torch.Generator(device="cuda").manual_seed(1)
    seeds = torch.randint(2**62, (n,), device="cuda", generator=g)
    tokens = gumbel_argmax_triton(logits, inv_t, seeds)
    assert chi_square(tokens, torch.softmax(SMALL_LOGITS / temperature, 0)) < CHI2_LIMIT_DF7
