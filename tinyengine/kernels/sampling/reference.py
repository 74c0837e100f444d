"""Fused sampling: one pass over each row of logits picks its token, by the
Gumbel-max trick with temperature, or by plain argmax for greedy rows. This is
the torch reference and the definition of the random numbers; the Triton
kernel with the same signature is sampling/triton.py.

Owns the numerical definition of that draw and of its random numbers. The
torch reference reproduces the uniforms bit for bit and the noise op for op:
under the Triton interpreter tokens match exactly; on the GPU, where the kernel
takes log2 from the hardware approximation (lg2.approx, absolute error ~2^-22),
the noise matches to ~1e-5 and tokens match except at near-ties.
Must never import triton (the torch op set runs without it) or change its
inputs.

    gumbel_argmax_*(logits [R, V], inv_temperature [R] fp32, seeds [R] int64) -> tokens [R] int64

logits: bf16/fp16/fp32, last dim contiguous (rows may be strided);
inv_temperature, seeds: 1-D, any stride (the Sampler passes a table column).
Row r with inv_temperature[r] > 0 draws from softmax(logits[r] * inv_temperature[r]):

    token = argmax_c  logits[r, c] * inv_temperature[r] * log2(e) + noise(seeds[r], c)

where noise is Gumbel noise in log2 units, -log2(E) with E = -log2(u) and u
uniform in (0, 1) (the Gumbel trick's -ln(-ln u), times log2(e), shifted by the
constant log2(ln 2), which moves every score alike). Any other row (0: the
Sampler's greedy rows) is argmax(logits[r]): no noise, no temperature, and its
seed is never read.

Rules both implementations keep:
  * ties go to the lowest column (torch.argmax's rule);
  * a -inf logit (a banned or filtered token) never wins, unless the whole row
    is -inf (then 0, as torch.argmax); NaN logits never win either (the kernel
    differs from torch.argmax there, which picks the NaN);
  * the noise is always finite: u is never 0 or 1, and E is floored.

Random numbers: u[r, c] depends only on (seeds[r], c, V), never on the grid,
the split or the block size, so a row's token is a pure function of its
logits, its inverse temperature and its seed. Each Philox4x32-10 call
(tl.randint4x, key = the 64-bit seed, counter = (i, 0, 0, 0)) gives four 32-bit
words, used for the four columns i + k*Q (k = 0..3) a quarter row apart, with
Q = 16 * ceil(V / 64) (so every quarter starts 16-element aligned and a block's
four loads stay contiguous). A word w becomes u = (w >> 9) * 2^-23 + 2^-24, an
odd multiple of 2^-24 in [2^-24, 1 - 2^-24], exactly. For u > 1 - 2^-7, E
comes from a series in 1 - u (exact in fp32) instead of log2(u), so the large
noise values, the ones that win, do not depend on how precise log2 is near 1;
that is what makes the fast approximate log2 safe (an absolute error of 2^-22
on an E >= 0.011 moves the noise by < 3e-5).
"""

from __future__ import annotations

import torch

from tinyengine.kernels.launch import LOG2E

_SERIES_BELOW = 2.0**-7  # 1 - u below this: E from the series, not log2(u)
_E_FLOOR = 2.0**-30  # keeps the noise finite (<= 30) whatever log2 returns


def _quarter(vocab: int) -> int:
    """Q: columns per Philox word lane (16-aligned), so column c is word c // Q of counter c % Q."""
    return 16 * -(-vocab // 64)


_M32 = 0xFFFFFFFF
_PHILOX_KEY = (0x9E3779B9, 0xBB67AE85)
_PHILOX_ROUND = (0xD2511F53, 0xCD9E8D57)


def _mul_wide(a: int, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(hi, lo) 32-bit halves of a * b for a uint32 constant a and uint32 values
    b held in int64, without ever overflowing int64 (b split in 16-bit halves)."""
    low = a * (b & 0xFFFF)  # < 2^48
    mid = a * (b >> 16)  # < 2^48
    t = low + ((mid & 0xFFFF) << 16)  # < 2^49
    return (mid >> 16) + (t >> 32), t & _M32


def _philox_torch(seeds: torch.Tensor, counters: torch.Tensor) -> list[torch.Tensor]:
    """Philox4x32-10 as tl.randint4x computes it: key (seed_lo, seed_hi),
    counter (c, 0, 0, 0). seeds [R, 1], counters [Q] -> four words [R, Q] in int64."""
    k0, k1 = seeds & _M32, (seeds >> 32) & _M32
    zero = torch.zeros((seeds.shape[0], counters.shape[0]), dtype=torch.int64, device=seeds.device)
    c0, c1, c2, c3 = counters.expand_as(zero).clone(), zero, zero, zero
    for _ in range(10):
        hi_b, lo_b = _mul_wide(_PHILOX_ROUND[1], c2)
        hi_a, lo_a = _mul_wide(_PHILOX_ROUND[0], c0)
        c0, c1, c2, c3 = hi_b ^ c1 ^ k0, lo_b, hi_a ^ c3 ^ k1, lo_a
        k0, k1 = (k0 + _PHILOX_KEY[0]) & _M32, (k1 + _PHILOX_KEY[1]) & _M32
    return [c0, c1, c2, c3]


def gumbel_uniforms_torch(seeds: torch.Tensor, vocab: int) -> torch.Tensor:
    """The kernel's uniforms u [R, V] (fp32), bit for bit."""
    q = _quarter(vocab)
    counters = torch.arange(q, dtype=torch.int64, device=seeds.device)
    words = _philox_torch(seeds.to(torch.int64)[:, None], counters)
    u = torch.cat([((w >> 9).to(torch.float32) * 2.0**-23 + 2.0**-24) for w in words], dim=1)
    return u[:, :vocab]


def gumbel_noise_torch(seeds: torch.Tensor, vocab: int) -> torch.Tensor:
    """The kernel's noise [R, V] (fp32, log2 units), op for op."""
    u = gumbel_uniforms_torch(seeds, vocab)
    v = 1.0 - u  # exact where it is used (u > 1/2)
    series = v * (1.0 + v * (0.5 + v * (0.3333333333333333 + v * 0.25))) * LOG2E
    e = torch.where(v < _SERIES_BELOW, series, -torch.log2(u))
    return -torch.log2(torch.clamp(e, min=_E_FLOOR))


def gumbel_argmax_torch(
    logits: torch.Tensor, inv_temperature: torch.Tensor, seeds: torch.Tensor
) -> torch.Tensor:
    """The kernel's draw on its own random numbers (gumbel_noise_torch), in
    fp32: [R, V] scores, then torch.argmax. For tests: it materializes [R, V]."""
    x = logits.float()
    sampled = inv_temperature > 0
    scale = inv_temperature.float() * LOG2E
    scores = x * scale[:, None] + gumbel_noise_torch(seeds, x.shape[-1])
    return torch.where(sampled[:, None], scores, x).argmax(dim=-1)
