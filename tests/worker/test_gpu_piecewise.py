"""Piecewise CUDA graphs on the GPU (`pytest -m gpu`; skipped without CUDA):
real graph chains split at the splitting ops, replayed for prefill, chunked
and mixed steps of Llama, Qwen3, DeepSeek-V3 and DeepSeek-V4 tiny models,
generate the eager engine's greedy tokens (fp32), and no Triton kernel
compiles after READY. The CPU tests (test_piecewise_graphs.py) cover the
contract with the recording backend; this is the real capture.
"""

from __future__ import annotations

import random

import pytest

from tests.worker.test_piecewise_graphs import _model
from tinyengine import LLM, SamplingParams

pytestmark = pytest.mark.gpu


def _prompts() -> list[dict]:
    rng = random.Random(1)
    shared = [rng.randrange(3, 500) for _ in range(48)]
    prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in (1, 6, 19, 37, 90)]
    prompts += [shared + [rng.randrange(3, 500) for _ in range(k)] for k in (3, 14)]
    return [{"prompt_token_ids": p} for p in prompts]


@pytest.mark.parametrize("kind", ["llama", "qwen3", "deepseek-v3", "deepseek-v4"])
def test_piecewise_graphs_generate_the_eager_tokens(tmp_path, kind):
    path = _model(kind, tmp_path)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    base = dict(max_model_len=256, max_num_seqs=8, max_num_batched_tokens=64, dtype="float32",
                cuda_graph_sizes=[1, 2], print_startup_report=False)  # fmt: skip
    results = {}
    for mode in ("eager", "piecewise"):
        config = {"enforce_eager": True} if mode == "eager" else {
            "cudagraph_mode": "full_and_piecewise"}  # fmt: skip
        llm = LLM(path, **base, **config)
        results[mode] = [o.outputs[0].token_ids for o in llm.generate(_prompts(), params,
                                                                       use_tqdm=False)]  # fmt: skip
        if mode == "piecewise":
            report = llm.startup_report()
            assert report.piecewise_sizes == [8, 16, 32, 48, 64]
            assert report.workspace_growth_after_kv_sizing == 0
            assert llm.stats()["jit_compiles_after_ready"] == 0
            assert llm.engine.runner.piecewise.backend.num_replays >= 5
            stats = llm.stats()
            assert stats["num_free_blocks"] == stats["num_total_blocks"]
    assert results["piecewise"] == results["eager"]
