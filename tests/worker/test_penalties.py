"""Repetition / frequency / presence penalties: the logit adjustment against a
per-token loop, the device-side history the sampler keeps (so asynchronous
scheduling sees the in-flight token), greedy tokens against HF's
repetition_penalty, and raw logprobs left alone."""

from __future__ import annotations

import random

import pytest
import torch

from tests.hf_models import load_hf_model, make_tiny_hf_model
from tinyengine import LLM, SamplingParams
from tinyengine.worker.penalties import TokenHistory, penalize
from tinyengine.worker.sampler import Sampler

VOCAB = 50


def _to_device(data: list, dtype: torch.dtype) -> torch.Tensor:
    return torch.tensor(data, dtype=dtype)


def _reference(row: torch.Tensor, prompt: list[int], output: list[int], p: SamplingParams):
    """The definition, one token at a time."""
    out = row.clone()
    for v in range(len(out)):
        x = float(out[v])
        if v in prompt or v in output:
            x = x / p.repetition_penalty if x > 0 else x * p.repetition_penalty
        x -= p.frequency_penalty * output.count(v)
        x -= p.presence_penalty * (v in output)
        out[v] = x
    return out


def test_penalize_matches_the_definition_and_leaves_other_rows():
    rng = random.Random(0)
    logits = torch.randn(4, VOCAB) * 3
    params = [
        SamplingParams(repetition_penalty=1.5),
        SamplingParams(),  # no penalty: untouched, and needs no history
        SamplingParams(frequency_penalty=0.7, presence_penalty=-0.4),
        SamplingParams(repetition_penalty=0.8, frequency_penalty=-1.0, presence_penalty=2.0),
    ]
    prompts = [[rng.randrange(VOCAB) for _ in range(6)] for _ in params]
    outputs = [[rng.randrange(VOCAB) for _ in range(9)] for _ in params]
    histories = []
    for p, prompt, output in zip(params, prompts, outputs, strict=True):
        if not p.has_penalties:
            histories.append(None)
            continue
        h = TokenHistory(prompt, VOCAB, _to_device)
        for t in output:
            h.record(torch.tensor([t]))
        histories.append(h)
    before = logits.clone()
    got = penalize(logits, params, histories, _to_device)
    assert torch.equal(logits, before)  # a copy: the caller's logits stay raw
    for i, p in enumerate(params):
        want = _reference(before[i], prompts[i], outputs[i], p)
        torch.testing.assert_close(got[i], want, rtol=1e-6, atol=1e-6)
    assert torch.equal(got[1], before[1])
    assert penalize(logits, [SamplingParams()] * 4, [None] * 4, _to_device) is logits
    with pytest.raises(ValueError, match="no TokenHistory"):
        penalize(logits, params, [None] * 4, _to_device)


def test_logit_bias_adds_before_the_penalties_and_needs_no_history():
    logits = torch.randn(3, VOCAB)
    params = [
        SamplingParams(logit_bias={3: 5.0, 7: -100.0}),  # bias only: no history
        SamplingParams(),
        SamplingParams(repetition_penalty=2.0, logit_bias={1: 1.5}),
    ]
    history = TokenHistory([1, 2], VOCAB, _to_device)
    got = penalize(logits, params, [None, None, history], _to_device)
    want = logits.clone()
    want[0, 3] += 5.0
    want[0, 7] -= 100.0
    biased = logits[2].clone()
    biased[1] += 1.5  # then token 1 (in the prompt) is repetition-penalized
    want[2] = _reference(biased, [1, 2], [], params[2])
    torch.testing.assert_close(got, want)
    # HF's order: SequenceBiasLogitsProcessor, then the repetition penalty.
    from transformers import RepetitionPenaltyLogitsProcessor, SequenceBiasLogitsProcessor

    ids = torch.tensor([[1, 2]])
    hf = SequenceBiasLogitsProcessor({(1,): 1.5})(ids, logits[2:3].clone())
    hf = RepetitionPenaltyLogitsProcessor(2.0)(ids, hf)
    torch.testing.assert_close(got[2:3], hf)


@pytest.mark.parametrize("fused", [False, True], ids=["torch", "fused"])
def test_sampler_counts_its_draws_and_keeps_raw_logprobs(fused):
    """Greedy with a huge presence penalty can never repeat a token; the
    history counts each draw; logprobs are those of the raw logits."""
    draw = None
    if fused:
        from tinyengine.kernels.sampling.triton import gumbel_argmax_triton as draw
    sampler = Sampler("cpu", draw=draw)
    logits = torch.zeros(1, VOCAB)
    logits[0, :5] = torch.tensor([5.0, 4.0, 3.0, 2.0, 1.0])
    params = [SamplingParams(temperature=0.0, presence_penalty=2.0, frequency_penalty=2.0,
                             logprobs=1)]  # fmt: skip
    history = sampler.new_history([], VOCAB)
    picked = []
    for _ in range(4):
        out = sampler(logits, params, [None], None, [history])
        picked.append(out.token_ids[0])
        raw_lp = torch.log_softmax(logits[0], -1)[out.token_ids[0]].item()
        assert out.logprobs[0][0][1] == pytest.approx(raw_lp, abs=1e-5)
    assert picked == [0, 1, 2, 3]  # each pick pays 4 on every later step
    assert history.counts[:5].tolist() == [1, 1, 1, 1, 0]


def test_logit_bias_steers_greedy_decoding(llama_path):
    """+100 on a token makes greedy pick it every step; the logprobs stay the
    raw distribution's; ids outside the vocabulary are refused by name."""
    llm = LLM(llama_path, max_model_len=64, print_startup_report=False)
    prompt = {"prompt_token_ids": PROMPTS[0]}

    def run(**kw):
        params = SamplingParams(temperature=0, ignore_eos=True, logprobs=0, **kw)
        return llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]

    plain = run(max_tokens=4)
    forced = run(max_tokens=4, logit_bias={77: 100.0})
    assert forced.token_ids == [77] * 4 and plain.token_ids[0] != 77
    first = plain.token_ids[0]
    banned = run(max_tokens=1, logit_bias={first: -100.0})
    assert banned.token_ids[0] != first
    # Step 0's logprob of token 77 is the unbiased model's (rank far from 1).
    assert forced.logprobs[0][77].rank > 1
    with pytest.raises(ValueError, match=r"logit_bias token ids \[99999\]"):
        llm.generate(prompt, SamplingParams(logit_bias={99999: 1.0}), use_tqdm=False)


@pytest.mark.parametrize("value", [-2.5, 2.01, float("nan"), "1"])
def test_bad_penalties_are_refused_by_name(value):
    for name in ("presence_penalty", "frequency_penalty"):
        with pytest.raises(ValueError, match=rf"SamplingParams\.{name}"):
            SamplingParams(**{name: value})
    for bad in (0.0, -1.0, float("inf"), "2"):
        with pytest.raises(ValueError, match=r"SamplingParams\.repetition_penalty"):
            SamplingParams(repetition_penalty=bad)
    for bad in ({-1: 1.0}, {"3": 1.0}, {3: 101.0}, {3: float("nan")}, [3]):
        with pytest.raises(ValueError, match=r"SamplingParams\.logit_bias"):
            SamplingParams(logit_bias=bad)


@pytest.fixture(scope="module")
def llama_path(tmp_path_factory) -> str:
    return str(make_tiny_hf_model("llama", tmp_path_factory.mktemp("llama-penalty")))


PROMPTS = [[5, 9, 9, 17, 3], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52, 53, 54, 55, 56]]


def test_repetition_penalty_matches_hf_greedy(llama_path):
    """HF's repetition_penalty (RepetitionPenaltyLogitsProcessor, over prompt
    and generated ids) is vLLM's: greedy tokens must agree exactly, with the
    default asynchronous scheduling (step N+1 launched before step N's token
    reaches the host) and with preemption (too few KV blocks)."""
    model = load_hf_model(llama_path)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    want = []
    for prompt in PROMPTS:
        out = model.generate(
            torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            do_sample=False, max_new_tokens=12, repetition_penalty=1.8,
        )  # fmt: skip
        want.append(out[0, len(prompt) :].tolist())
    plain = model.generate(torch.tensor([PROMPTS[0]]), do_sample=False, max_new_tokens=12)
    assert plain[0, len(PROMPTS[0]) :].tolist() != want[0]  # the penalty changes the answer

    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, repetition_penalty=1.8)
    for config in ({}, {"async_scheduling": False}, {"num_kv_blocks": 9, "block_size": 4}):
        llm = LLM(llama_path, max_model_len=64, print_startup_report=False, **config)
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == want, config
        assert not llm.engine.runner.request_sampling.histories  # freed with their requests
        if "num_kv_blocks" in config:
            assert llm.stats()["num_preemptions"] > 0


def test_frequency_penalty_sees_the_in_flight_token(llama_path):
    """Asynchronous scheduling launches step N+1 before step N's token is on
    the host; the device-side history must still count it, so the tokens are
    those of the synchronous engine."""
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True,
                            frequency_penalty=1.5, presence_penalty=0.5)  # fmt: skip
    runs = []
    for config in ({"async_scheduling": True}, {"async_scheduling": False}):
        llm = LLM(llama_path, max_model_len=64, print_startup_report=False, **config)
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
        runs.append([o.outputs[0].token_ids for o in outs])
    assert runs[0] == runs[1]
    plain = llm.generate({"prompt_token_ids": PROMPTS[0]}, SamplingParams(
        temperature=0.0, max_tokens=16, ignore_eos=True), use_tqdm=False)[0]  # fmt: skip
    assert plain.outputs[0].token_ids != runs[1][0]


@pytest.mark.gpu
def test_penalties_on_cuda_graphs_async_equals_sync(llama_path):
    """On the GPU (fused sampler, CUDA graphs, real asynchronous copies): the
    penalized greedy tokens do not depend on async scheduling, equal HF's
    repetition_penalty in fp32, and nothing compiles after READY."""
    from tinyengine.kernels import jit_monitor

    model = load_hf_model(llama_path).cuda()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    want = []
    for prompt in PROMPTS:
        out = model.generate(torch.tensor([prompt], device="cuda"), do_sample=False,
                             max_new_tokens=12, repetition_penalty=1.8)  # fmt: skip
        want.append(out[0, len(prompt) :].tolist())
    del model
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, repetition_penalty=1.8)
    for config in ({"async_scheduling": True}, {"async_scheduling": False}):
        llm = LLM(llama_path, dtype="float32", max_model_len=64, max_num_seqs=8,
                  print_startup_report=False, **config)  # fmt: skip
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == want, config
        assert jit_monitor.compiled_since(llm.engine._jit_compiles_at_ready) == []
        del llm
