"""Batch-invariant mode (EngineConfig.batch_invariant, kernels/batch_invariant.py):
a needle request's tokens and per-step logprobs, run alone, are bitwise
equal (==, not close) to the same request inside batches of other
requests, wherever it sits in the batch, with its prompt chunked at odd
boundaries, after a prefix-cache hit, after a preemption and recompute,
with and without async scheduling, greedy and seeded sampling. The same
comparison with the mode off differs (so the test can fail), and the mode
still matches HF's greedy tokens in fp32. CPU, tiny random Llama, Qwen3,
DeepSeek-V3, DeepSeek-V2-Lite (MLA, MoE) and DeepSeek-V4 (sliding, CSA and
HCA attention, hyper-connections, hash routing)."""

from __future__ import annotations

import json
import random

import pytest

from tests import hf_deepseek, hf_deepseek_v4, hf_models
from tests.hf_models import assert_greedy_matches
from tinyengine import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=5)
SEEDED = SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=12, ignore_eos=True,
                        logprobs=5)  # fmt: skip
ENGINE = dict(max_model_len=512, print_startup_report=False, batch_invariant=True)

_rng = random.Random(0)
NEEDLE = [_rng.randrange(3, 500) for _ in range(150)]


def _others(n: int, seed: int, longest: int = 250) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 500) for _ in range(rng.randrange(20, longest))] for _ in range(n)]


def _needle(llm: LLM, others: list[list[int]], params: SamplingParams, seed: int = 0) -> tuple:
    """The needle's (token ids, per-step logprobs) run among `others`, at a
    random place in the batch; the others get their own random params."""
    rng = random.Random(seed)
    at = rng.randrange(len(others) + 1)
    prompts = others[:at] + [NEEDLE] + others[at:]
    rest = [SamplingParams(temperature=rng.choice([0.0, 1.0]), max_tokens=rng.randrange(1, 20),
                           ignore_eos=True) for _ in others]  # fmt: skip
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts], rest[:at] + [params] + rest[at:],
        use_tqdm=False,
    )  # fmt: skip
    out = outs[at].outputs[0]
    return out.token_ids, [[(t, lp.logprob) for t, lp in d.items()] for d in out.logprobs]


# name -> (the module whose builder and HF reference it uses, its variant)
MODELS = {
    "llama": (hf_models, "llama"),
    "qwen3": (hf_models, "qwen3"),
    "deepseek-v3": (hf_deepseek, "v3"),  # MLA, sigmoid routing in groups
    "deepseek-v2-lite": (hf_deepseek, "v2-lite"),  # no q LoRA, softmax greedy routing
    # Sliding, CSA and HCA layers, hash and learned routing, hyper-connections.
    "deepseek-v4": (hf_deepseek_v4, None),
}


def _build(name: str, folder) -> str:
    module, variant = MODELS[name]
    if module is hf_deepseek_v4:
        return str(hf_deepseek_v4.make_tiny_v4(folder))
    build = module.make_tiny_deepseek if module is hf_deepseek else module.make_tiny_hf_model
    return str(build(variant, folder))


def _hf_greedy(path: str, prompts: list[list[int]], n: int) -> tuple:
    module = hf_deepseek if "deepseek" in path else hf_models
    return module.hf_greedy(path, prompts, n)


@pytest.fixture(scope="module", params=list(MODELS))
def model(request, tmp_path_factory):
    """(model folder, the needle's greedy and seeded runs alone)."""
    path = _build(request.param, tmp_path_factory.mktemp(request.param))
    llm = LLM(path, **ENGINE)
    alone = {p.seed: _needle(llm, [], p) for p in (GREEDY, SEEDED)}
    assert llm.stats()["batch_invariant"] is True
    return path, alone


CASES = {
    "batch_of_8": ({}, 8),
    "batch_of_40": ({"max_num_seqs": 64}, 40),
    "chunked_unaligned": ({"max_num_batched_tokens": 37}, 8),
    "preempted": ({"num_kv_blocks": 40, "block_size": 8, "max_num_seqs": 12}, 12),
    "sync_scheduling": ({"async_scheduling": False}, 8),
}


# DeepSeek-V4's reference ops run each query row alone in this mode (slow on
# a CPU): the cases that change how its rows are scheduled, not the big batch.
_V4_CASES = ("batch_of_8", "chunked_unaligned", "preempted")


@pytest.mark.parametrize(
    ("model", "case"),
    [(m, c) for m in MODELS for c in CASES if m != "deepseek-v4" or c in _V4_CASES],
    indirect=["model"],
)
def test_the_needle_is_bitwise_the_same_in_any_batch(model, case):
    path, alone = model
    config, num_others = CASES[case]
    llm = LLM(path, **{**ENGINE, **config})
    longest = 60 if "deepseek-v4" in path else 250  # V4 runs each row alone: shorter others
    for seed, params in enumerate((GREEDY, SEEDED)):
        got = _needle(llm, _others(num_others, seed, longest), params, seed=seed)
        assert got == alone[params.seed], f"{case}: {'seeded' if seed else 'greedy'} run differs"
    if case == "preempted":
        assert llm.stats()["num_preemptions"] > 0  # the case means something


def test_a_prefix_hit_changes_nothing(model):
    path, alone = model
    llm = LLM(path, **ENGINE)
    llm.generate([{"prompt_token_ids": NEEDLE[:100]}], SamplingParams(max_tokens=1),
                 use_tqdm=False)  # fmt: skip
    got = _needle(llm, _others(8, 3, 60), GREEDY, seed=3)
    assert llm.stats()["prefix_cache_hit_tokens"] >= 96  # six 16-token blocks were hits
    assert got == alone[GREEDY.seed]


def test_prompt_logprobs_too(model):
    path, _ = model
    params = SamplingParams(max_tokens=1, prompt_logprobs=3)

    def prompt_logprobs(llm: LLM, others: list[list[int]]) -> list:
        outs = llm.generate([{"prompt_token_ids": p} for p in [*others, NEEDLE]], params,
                            use_tqdm=False)  # fmt: skip
        return [None if d is None else sorted((t, lp.logprob) for t, lp in d.items())
                for d in outs[-1].prompt_logprobs]  # fmt: skip

    alone = prompt_logprobs(LLM(path, **ENGINE), [])
    chunked = LLM(path, **{**ENGINE, "max_num_batched_tokens": 37})
    assert prompt_logprobs(chunked, _others(4, 9, 60)) == alone


def test_with_the_mode_off_the_batch_shows(model):
    path, _ = model
    llm = LLM(path, **{**ENGINE, "batch_invariant": False})
    assert llm.stats()["batch_invariant"] is False
    alone = _needle(llm, [], GREEDY)
    assert _needle(llm, _others(8, 0, 60), GREEDY) != alone


def test_the_mode_still_matches_hf(model):
    path, _ = model
    prompts = [NEEDLE, NEEDLE[:17], _others(1, 5)[0]]
    tokens, logits = _hf_greedy(path, prompts, 8)
    logprobs = [[step.log_softmax(-1) for step in seq] for seq in logits]
    llm = LLM(path, **ENGINE)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=5)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert_greedy_matches(outs, tokens, logprobs)


@pytest.mark.parametrize(
    ("architecture", "config", "message"),
    [
        ("LlamaForCausalLM", {"attention_backend": "triton"}, "on a GPU"),
        ("LlamaForCausalLM", {"graph_backend": "recording"}, "eager steps"),
    ],
)
def test_where_the_mode_is_not_built_yet_it_says_so(tmp_path, architecture, config, message):
    (tmp_path / "config.json").write_text(
        json.dumps({"architectures": [architecture], "vocab_size": 100})
    )
    with pytest.raises(ValueError, match="batch_invariant=True is not available here") as err:
        LLM(str(tmp_path), **{**ENGINE, **config})
    assert message in str(err.value)


@pytest.mark.parametrize(
    ("architecture", "dtype", "backend"),
    [("LlamaForCausalLM", "auto", "triton"), ("Qwen3ForCausalLM", "float16", "triton"),
     ("LlamaForCausalLM", "float32", "torch"), ("DeepseekV3ForCausalLM", "auto", "triton"),
     ("DeepseekV4ForCausalLM", "auto", "triton"), ("DeepseekV4ForCausalLM", "float32", "torch")],
)  # fmt: skip
def test_auto_picks_the_invariant_triton_ops_where_they_cover_the_model(architecture, dtype,
                                                                        backend):  # fmt: skip
    # Decided without a GPU: the architecture, the dtype and the device suffice.
    from tinyengine.config import EngineConfig

    hf_config = {"architectures": [architecture]}
    config = EngineConfig(model="unused", batch_invariant=True, dtype=dtype)
    assert config.resolved_attention_backend("cuda", hf_config) == backend
    config.check_batch_invariant(hf_config, "cuda")  # every case above is served
    assert EngineConfig(model="unused", dtype=dtype).resolved_attention_backend(
        "cuda", hf_config) == "triton"  # fmt: skip


def test_triton_ops_asked_for_a_model_they_do_not_cover_are_refused():
    from tinyengine.config import EngineConfig

    # The invariant Triton ops take 16-bit weights only.
    config = EngineConfig(model="unused", batch_invariant=True, attention_backend="triton",
                          dtype="float32")  # fmt: skip
    with pytest.raises(ValueError, match="attention_backend='torch' for DeepseekV4ForCausalLM"):
        config.check_batch_invariant({"architectures": ["DeepseekV4ForCausalLM"]}, "cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["llama", "qwen3", "deepseek-v3", "deepseek-v4"])
def test_gpu_the_needle_is_bitwise_the_same_in_any_batch(name, tmp_path_factory):
    # The invariant Triton ops with CUDA graphs: a decode step alone replays
    # the 1-row graph, among 8 others the 16-row one, and enforce_eager runs
    # none (with piecewise graphs, the default, prefill and mixed steps
    # replay padded chains too; one case captures decode graphs only); MLA's
    # split kernel takes one split per row, the MoE its grouped GEMMs
    # (kernels/batch_invariant_triton.py).
    path = _build(name, tmp_path_factory.mktemp(name))
    # One block size for every engine here (for MLA it picks the tile path).
    gpu = dict(ENGINE, device="cuda", num_kv_blocks=512, max_num_seqs=64, block_size=16)
    llm = LLM(path, **gpu)
    assert llm.engine.runner.ops.batch_invariant
    assert llm.engine.runner.ops.name == "triton"
    assert llm.stats()["captured_graph_sizes"]
    alone = {p.seed: _needle(llm, [], p) for p in (GREEDY, SEEDED)}
    preempting = {"num_kv_blocks": 16, "max_num_seqs": 12}  # 256 tokens: it preempts
    del llm
    decode_graphs_only = {"cudagraph_mode": "full_decode_only"}  # prefill chunks run eagerly
    cases = [({}, 8), ({"max_num_batched_tokens": 37}, 4), ({"enforce_eager": True}, 8),
             (preempting, 12), ({}, 40), (decode_graphs_only, 8)]  # fmt: skip
    for seed, (config, num_others) in enumerate(cases):
        other = LLM(path, **{**gpu, **config})
        for params in (GREEDY, SEEDED):
            got = _needle(other, _others(num_others, seed), params, seed=seed)
            assert got == alone[params.seed], (config, num_others, params.seed)
        if config is preempting:
            assert other.stats()["num_preemptions"] > 0
        del other
