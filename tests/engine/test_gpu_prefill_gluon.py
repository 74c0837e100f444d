"""The engine on a Hopper GPU in bf16 with 128-wide heads, where prompts of
128 tokens and more take the warp-specialized Gluon prefill
(kernels/attention/gluon.py): the kernel runs in the engine's own cache
layout (K and V rows of one allocation), is compiled before READY, and its
first tokens and every prompt position's log-prob are those of the same
engine with the Triton prefill kernel. Skipped without a Hopper GPU and Gluon."""

from __future__ import annotations

import pytest
import torch

import tinyengine.kernels.attention.gluon as prefill_gluon
from tests import hf_models
from tinyengine import LLM, SamplingParams

pytestmark = pytest.mark.gpu

PROMPTS = [list(range(3, 303)), [7] * 150, list(range(360, 500)), [5, 6, 7]]


def _first_tokens(path, monkeypatch, gluon: bool) -> tuple[list, list, int]:
    launches = []
    launch = prefill_gluon.launch
    monkeypatch.setattr(prefill_gluon, "launch", lambda *a: launches.append(1) or launch(*a))
    if not gluon:
        monkeypatch.setattr(prefill_gluon, "supports", lambda *a, **k: False)
    llm = LLM(str(path), dtype="bfloat16", max_model_len=512, max_num_seqs=4,
              max_num_batched_tokens=512, attention_backend="triton",
              print_startup_report=False)  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, prompt_logprobs=1)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    assert llm.stats()["jit_compiles_after_ready"] == 0
    tokens = [o.outputs[0].token_ids[0] for o in outs]
    # Every prompt position's output row: the log-prob of the next prompt token.
    logprobs = [lp[t].logprob for o, p in zip(outs, PROMPTS, strict=True)
                for lp, t in zip(o.prompt_logprobs[1:], p[1:], strict=True)]  # fmt: skip
    monkeypatch.undo()
    return tokens, logprobs, len(launches)


def test_gluon_prefill_in_the_engine_matches_the_triton_prefill(tmp_path, monkeypatch):
    if not (torch.cuda.is_available() and prefill_gluon.is_hopper(0) and prefill_gluon.HAVE_GLUON):
        pytest.skip("no Gluon or not a Hopper GPU")
    path = hf_models.make_tiny_hf_model("qwen3", tmp_path, hidden_size=256,
                                        num_attention_heads=4, num_key_value_heads=2,
                                        head_dim=128)  # fmt: skip
    tokens, logprobs, launches = _first_tokens(path, monkeypatch, gluon=True)
    assert launches > 0, "no prefill took the Gluon kernel"
    assert prefill_gluon._compile_failed == []
    want_tokens, want_logprobs, none = _first_tokens(path, monkeypatch, gluon=False)
    assert none == 0
    assert tokens == want_tokens
    assert logprobs == pytest.approx(want_logprobs, abs=0.05)
