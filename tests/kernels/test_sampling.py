"""Fused sampling (tinyengine/kernels/sampling/): the Triton Gumbel-argmax kernel vs its
torch reference on the same random numbers, the rules it keeps (ties, -inf,
greedy rows), the distribution it draws from; and the Sampler's fused path
(forced on CPU, where Triton runs under the interpreter; the default on CUDA).

The interpreter costs ~25 ms per program instance (one per row, or per row and
split), so CPU shapes stay tiny; statistical checks run on the torch reference,
which is pinned to the kernel token for token, and on the kernel itself on the
GPU. Every random draw uses a fixed seed: a tolerance is about the maths, not
about flakiness.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch

import tinyengine.kernels.sampling.triton as sampling
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
from tinyengine.sampling_params import SamplingParams
from tinyengine.worker.sampler import Sampler

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# Extreme keys too: the seed is a 64-bit Philox key, sign bit included.
SEEDS = [0, 1, -1, 2**62 + 12345, -(2**63), 2**63 - 1, 987654321987]


def randn(*shape: int, seed: int = 0, scale: float = 2.0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


def seeds_like(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(2**62, (rows,), generator=torch.Generator().manual_seed(seed))


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


# ------------------------------------------------------------------ the Sampler's fused path


def fused_sampler(seed: int = 0) -> Sampler:
    return Sampler(DEVICE, seed=seed, draw=sampling.gumbel_argmax_triton)


def test_sampler_fused_greedy_equals_torch_path() -> None:
    """Greedy rows, bans, logprobs: the fused sampler's output is the torch
    path's on the same device, field for field (logprobs: the same fp32 maths)."""
    logits = randn(4, 40, seed=6, scale=3.0)
    params = [
        SamplingParams(temperature=0.0, logprobs=3),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.0, top_k=3, logprobs=0),
        SamplingParams(temperature=0.0, logprobs=5),
    ]
    banned = [[int(logits[0].argmax())], [], [1, 2], []]
    gens = [None] * 4
    for dtype in (torch.float32, torch.bfloat16):
        x = logits.to(dtype).to(DEVICE)
        out = fused_sampler()(x, params, gens, banned)
        assert out == Sampler(DEVICE)(x.float(), params, gens, banned)
    assert out.token_ids[0] != int(logits[0].argmax())  # the ban was honoured


def test_sampler_fused_filters_and_bans() -> None:
    vocab = 30
    logits = randn(1, vocab, seed=7).expand(6, -1).contiguous()
    top3 = set(logits[0].topk(3).indices.tolist())
    params = [
        SamplingParams(temperature=1.5, top_k=3),
        SamplingParams(temperature=1.0, min_p=1.0),  # only the max survives
        SamplingParams(temperature=2.0),  # no filter: any token but the banned
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0, top_p=0.05),  # the top token alone
        SamplingParams(temperature=5.0),
    ]
    banned = [[], [], [int(logits[0].argmax())], [], [], list(range(vocab - 1))]
    top = int(logits[0].argmax())
    tokens = fused_sampler()(logits.to(DEVICE), params, [None] * 6, banned).token_ids
    assert tokens[0] in top3
    assert tokens[1] == top and tokens[3] == top and tokens[4] == top
    assert tokens[2] != top
    assert tokens[5] == vocab - 1
    assert torch.equal(logits, randn(1, vocab, seed=7).expand(6, -1))  # untouched


def test_sampler_fused_kernel_reads_the_logits_dtype_on_both_paths(monkeypatch) -> None:
    """bf16 logits reach the kernel as bf16 on the fast path and the filter
    path alike: one compiled variant, so a fast-path step after warmup (which
    takes the filter path) compiles nothing new on the GPU."""
    seen = []
    real = sampling.gumbel_argmax_triton

    def spy(logits, *args, **kwargs):
        seen.append(logits.dtype)
        return real(logits, *args, **kwargs)

    monkeypatch.setattr(sampling, "gumbel_argmax_triton", spy)
    logits = randn(2, 64, seed=9).to(torch.bfloat16).to(DEVICE)
    plain = [SamplingParams(temperature=1.0, seed=1), SamplingParams(temperature=0.0)]
    filtered = [plain[0], SamplingParams(temperature=0.7, top_p=0.9)]
    sampler = fused_sampler()
    fast = sampler(logits, plain, [sampler.new_generator(5), None]).token_ids
    slow = sampler(logits, filtered, [sampler.new_generator(5), None]).token_ids
    assert seen == [torch.bfloat16, torch.bfloat16]
    assert fast[0] == slow[0]  # a row without filters: the same input and seed


def seeded_tokens(position: str, target: SamplingParams, steps: int = 6, sampler_seed: int = 0):
    """A seeded request's tokens over `steps` steps, alone or at `position` in
    batches whose other rows change, and switch the batch between the fast
    path (no row filters) and the filter path (another row filters)."""
    vocab = 50
    sampler = fused_sampler(sampler_seed)
    gen = sampler.new_generator(42)
    tokens = []
    for step in range(steps):
        row = randn(1, vocab, seed=100 + step, scale=0.5)
        if position == "alone":
            logits, params, gens, at = row, [target], [gen], 0
        else:
            others = [
                SamplingParams(temperature=0.9, top_k=4 if step % 2 else 0),
                SamplingParams(temperature=0.0),
                SamplingParams(temperature=1.2, seed=7),
            ][: 1 + step % 3]
            other_gens = [None, None, sampler.new_generator(7 + step)][: len(others)]
            at = {"first": 0, "last": len(others), "middle": len(others) // 2}[position]
            other_logits = randn(len(others), vocab, seed=200 + step)
            logits = torch.cat([other_logits[:at], row, other_logits[at:]])
            params = others[:at] + [target] + others[at:]
            gens = other_gens[:at] + [gen] + other_gens[at:]
        tokens.append(sampler(logits.to(DEVICE), params, gens).token_ids[at])
    return tokens


@pytest.mark.parametrize(
    ("target", "positions"),
    [
        (SamplingParams(temperature=1.0, seed=42), ("first", "middle", "last")),
        (SamplingParams(temperature=0.8, top_k=10, seed=42), ("middle",)),
    ],
    ids=["fast-or-filter-path", "filter-path"],
)
def test_sampler_fused_seeded_tokens_independent_of_batch(
    target: SamplingParams, positions: tuple[str, ...]
) -> None:
    alone = seeded_tokens("alone", target)
    assert len(set(alone)) > 2, "sanity: the request really samples"
    for position in positions:
        # The sampler's own seed only drives unseeded rows.
        assert seeded_tokens(position, target, sampler_seed=len(position)) == alone, position


def test_sampler_fused_unseeded_rows_follow_sampler_seed() -> None:
    logits = randn(4, 500, seed=8, scale=0.1)
    params = [SamplingParams(temperature=1.0)] * 4

    def draw(seed: int) -> list[int]:
        return fused_sampler(seed)(logits.to(DEVICE), params, [None] * 4).token_ids

    assert draw(3) == draw(3) != draw(4)


# ------------------------------------------------------------------ GPU


def near_reference(logits, inv_t, seeds, tokens) -> torch.Tensor:
    """Per row: the kernel's token is the reference's, or scores within 1e-3 of
    it on the reference's own scores (a near-tie: on the GPU, FMA contraction
    and log2 move the last bits). Greedy rows must match exactly."""
    ref = gumbel_argmax_torch(logits, inv_t, seeds)
    x = logits.float()
    noise = gumbel_noise_torch(seeds, x.shape[1])
    scores = x * (inv_t.float() * math.log2(math.e))[:, None] + noise
    scores = torch.where(inv_t[:, None] > 0, scores, x)
    at_token = scores.gather(1, tokens[:, None])[:, 0]
    best = scores.gather(1, ref[:, None])[:, 0]
    assert ((tokens == ref) | (at_token >= best - 1e-3)).all()
    assert torch.equal(tokens[inv_t == 0], ref[inv_t == 0])
    return tokens == ref


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


@pytest.mark.gpu
def test_gpu_graph_capture_and_replay_of_fast_path() -> None:
    """The fast path's device work -- the seed draw from the sampler's own
    generator, then the kernel -- captured in a CUDA graph: every replay draws
    fresh seeds (the generator advances), reads the new logits, and picks the
    same tokens as the reference on those seeds."""
    rows, vocab = 64, 32_000
    sampler = Sampler("cuda", seed=0, draw=gumbel_argmax_triton)
    greedy = [i % 4 == 0 for i in range(rows)]
    gens = [None] * rows
    logits = torch.zeros(rows, vocab, device="cuda", dtype=torch.bfloat16)
    inv_t = torch.tensor([0.0 if gr else 1.0 for gr in greedy], device="cuda")
    graph = torch.cuda.CUDAGraph()
    if not hasattr(graph, "register_generator_state"):
        pytest.skip("this torch cannot capture a non-default CUDA generator")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm up: compile the kernel outside the capture
        gumbel_argmax_triton(logits, inv_t, sampler._seeds(gens, greedy))
    torch.cuda.current_stream().wait_stream(stream)
    graph.register_generator_state(sampler.generator)
    with torch.cuda.graph(graph):
        seeds = sampler._seeds(gens, greedy)
        tokens = gumbel_argmax_triton(logits, inv_t, seeds)
    g = torch.Generator(device="cuda").manual_seed(1)
    seen = []
    for _ in range(3):
        logits.copy_(torch.randn(rows, vocab, device="cuda", generator=g) * 3)
        graph.replay()
        torch.cuda.synchronize()
        near_reference(logits, inv_t, seeds, tokens)
        is_greedy = torch.tensor(greedy, device="cuda")
        assert torch.equal(tokens[is_greedy], logits[is_greedy].float().argmax(dim=-1))
        seen.append(seeds[~is_greedy].clone())
    assert not torch.equal(seen[0], seen[1]) and not torch.equal(seen[1], seen[2])


@pytest.mark.gpu
def test_gpu_fast_path_no_host_sync() -> None:
    """The fast path (no row filters; bans, logprobs, seeded rows) launches
    without a device->host sync, like the filter path (tests/worker)."""
    vocab, rows = 32_000, 48
    sampler = Sampler("cuda", draw=gumbel_argmax_triton)
    logits = (torch.randn(rows, vocab, device="cuda") * 3).bfloat16()
    kinds = [
        SamplingParams(temperature=0.0, logprobs=2),
        SamplingParams(temperature=0.8),
        SamplingParams(temperature=1.0, seed=1, logprobs=5),
        SamplingParams(temperature=1.2),
    ]
    params = [kinds[i % len(kinds)] for i in range(rows)]
    gens = [sampler.new_generator(i) if p.seed is not None else None for i, p in enumerate(params)]
    banned = [[0, 1, 2] if i % 3 == 0 else [] for i in range(rows)]
    sampler(logits, params, gens, banned)  # warm up allocators and kernels
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            pending = sampler.sample(logits, params, gens, banned)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    syncs = [str(w.message) for w in caught if "synchroniz" in str(w.message)]
    assert syncs == [], syncs
    out = pending.result()
    assert out.token_ids == pending.token_ids.tolist()
    assert all(out.token_ids[i] not in (0, 1, 2) for i in range(0, rows, 3))
    ref = torch.log_softmax(logits.float(), dim=-1)
    for i, p in enumerate(params):
        if p.logprobs is not None:
            tok, lp, _ = out.logprobs[i][0]
            assert tok == out.token_ids[i] and lp == pytest.approx(ref[i, tok].item(), abs=1e-5)
