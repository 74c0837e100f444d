"""The Sampler's fused path (tinyengine/worker/sampler.py with the Triton
Gumbel-argmax draw of tinyengine/kernels/sampling/): forced on CPU, where Triton
runs under the interpreter; the default on CUDA. The kernel itself is tested
in test_sampling.py.

CPU shapes stay tiny (the interpreter costs ~25 ms per program instance).
Every random draw uses a fixed seed: a tolerance is about the maths, not
about flakiness.
"""

from __future__ import annotations

import pytest
import torch

import tinyengine.kernels.sampling.triton as sampling
from tests.kernels.sampling_helpers import DEVICE, near_reference, randn
from tests.worker.sampler_helpers import sample_without_host_sync
from tinyengine.kernels.sampling.triton import gumbel_argmax_triton
from tinyengine.sampling_params import SamplingParams
from tinyengine.worker.sampler import Sampler

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
        gumbel_argmax_triton(logits, inv_t, sampler.seeds(gens, greedy))
    torch.cuda.current_stream().wait_stream(stream)
    graph.register_generator_state(sampler.generator)
    with torch.cuda.graph(graph):
        seeds = sampler.seeds(gens, greedy)
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
    params, pending = sample_without_host_sync(sampler, logits, kinds)
    out = pending.result()
    assert out.token_ids == pending.token_ids.tolist()
    assert all(out.token_ids[i] not in (0, 1, 2) for i in range(0, rows, 3))
    ref = torch.log_softmax(logits.float(), dim=-1)
    for i, p in enumerate(params):
        if p.logprobs is not None:
            tok, lp, _ = out.logprobs[i][0]
            assert tok == out.token_ids[i] and lp == pytest.approx(ref[i, tok].item(), abs=1e-5)
