"""Startup's shape runs (ForwardContext.running_only): profile's decode sizes
and warmup's piecewise token counts run one decoder layer of each kind
(CausalLM.layer_kinds), since those runs only compile a shape's kernels and
size its scratch, which every layer of a kind shares.

- layer_kinds picks the first two layers and the first of every other build
  (a MoE layer among dense ones; V4's attention types and routing kinds).
- With the Triton op set (the interpreter on CPU, a tiny Llama), the arena after startup is
  exactly as large as when the shape runs take every layer, and no context a
  graph replays keeps a layer subset.
"""

from __future__ import annotations

from collections import Counter

import pytest

from tests.hf_deepseek import make_tiny_deepseek
from tests.hf_deepseek_v4 import make_tiny_v4
from tests.hf_models import make_tiny_hf_model
from tinyengine import LLM, SamplingParams
from tinyengine.models.layers import CausalLM
from tinyengine.models.llama import LlamaDecoderLayer

LIGHT = dict(max_model_len=64, max_num_seqs=2, max_num_batched_tokens=32,
             print_startup_report=False)  # fmt: skip


def _kinds(path) -> tuple[int, ...]:
    return LLM(str(path), **LIGHT).engine.runner.model.layer_kinds()


def test_layer_kinds_of_each_family(tmp_path):
    # Llama: every layer is built alike; the first two still both run (the
    # first starts the residual stream, the second adds to it).
    assert _kinds(make_tiny_hf_model("llama", tmp_path / "l", num_hidden_layers=5)) == (0, 1)
    # DeepSeek-V3: layers 0-1 dense, 2-4 MoE.
    v3 = make_tiny_deepseek("v3", tmp_path / "d", num_hidden_layers=5, first_k_dense_replace=2)
    assert _kinds(v3) == (0, 1, 2)
    # DeepSeek-V4: sliding + hash routing, CSA, HCA, then a CSA and an HCA again.
    v4 = make_tiny_v4(tmp_path / "v4", num_hidden_layers=5,
                      layer_types=["sliding_attention", "compressed_sparse_attention",
                                   "heavily_compressed_attention", "compressed_sparse_attention",
                                   "heavily_compressed_attention"])  # fmt: skip
    assert _kinds(v4) == (0, 1, 2)


def test_shape_runs_size_the_arena_as_every_layer_would(tmp_path, monkeypatch):
    # Llama only: the interpreter's startups cost ~20 s here and ~40 s for a
    # DeepSeek model, whose kinds test_layer_kinds_of_each_family checks.
    path = make_tiny_hf_model("llama", tmp_path / "llama", num_hidden_layers=4)
    engine = dict(max_model_len=32, max_num_seqs=3, max_num_batched_tokens=16,
                  attention_backend="triton", graph_backend="recording",
                  cuda_graph_sizes=[1, 2], print_startup_report=False)  # fmt: skip
    calls: Counter = Counter()  # decoder layer -> forwards during startup
    forward = LlamaDecoderLayer.forward

    def counted(self, *args, **kwargs):
        calls[self] += 1
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(LlamaDecoderLayer, "forward", counted)
    runs = {}
    for every_layer in (False, True):
        if every_layer:
            monkeypatch.setattr(CausalLM, "layer_kinds", lambda self: tuple(range(4)))
        calls.clear()
        llm = LLM(str(path), **engine)
        runner = llm.engine.runner
        layers = runner.model.model.layers
        if not every_layer:
            # Layers 2 and 3 are built as layer 1: the shape runs (profile's
            # decode sizes, warmup's piecewise counts) skip them, and nothing
            # else does.
            shape_runs = len(runner.graph_sizes()) + len(runner.piecewise_graph_sizes())
            assert runner.model.layer_kinds() == (0, 1) and shape_runs >= 2
            assert calls[layers[0]] == calls[layers[1]] > calls[layers[2]] == calls[layers[3]]
            assert calls[layers[1]] - calls[layers[3]] >= shape_runs
        else:
            assert len({calls[layer] for layer in layers}) == 1
        # No graph-shaped context is left running a subset.
        assert all(runner.decode_context(n).only_layers is None for n in (1, 2))
        params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": list(range(3, 3 + n))} for n in (5, 20)],
                            params, use_tqdm=False)  # fmt: skip
        runs[every_layer] = (runner.workspace.size, [o.outputs[0].token_ids for o in outs])
    assert runs[False] == runs[True]


# In a process of its own, so that every kernel variant the engine needs is
# built or loaded during its startup (jit_monitor counts per process).
_CAPTURE_COMPILES = """
import sys
from tinyengine import LLM, SamplingParams
llm = LLM(sys.argv[1], dtype="bfloat16", max_model_len=256, max_num_seqs=8,
          print_startup_report=False)
capture = {s.name: s for s in llm.startup_report().stages}["capture"]
prompts = [{"prompt_token_ids": list(range(3, 3 + n))} for n in (5, 40, 90)]
llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
             use_tqdm=False)
print(capture.kernels, llm.stats()["jit_compiles_after_ready"])
"""


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["qwen3", "deepseek-v3", "deepseek-v4"])
def test_gpu_shape_runs_leave_capture_nothing_to_compile(tmp_path, arch):
    """On the GPU, the shape runs (one layer of each kind) compile every
    kernel variant the decode and piecewise graphs hold: capture builds
    none, and serving afterwards none either."""
    import os
    import subprocess
    import sys

    if arch == "qwen3":
        path = make_tiny_hf_model("qwen3", tmp_path / arch, num_hidden_layers=4)
    elif arch == "deepseek-v3":
        path = make_tiny_deepseek("v3", tmp_path / arch, num_hidden_layers=4)
    else:
        path = make_tiny_v4(tmp_path / arch, num_hidden_layers=5,
                            layer_types=["sliding_attention", "compressed_sparse_attention",
                                         "heavily_compressed_attention",
                                         "compressed_sparse_attention",
                                         "heavily_compressed_attention"])  # fmt: skip
    run = subprocess.run([sys.executable, "-c", _CAPTURE_COMPILES, str(path)],
                         env=dict(os.environ), capture_output=True, text=True,
                         timeout=600)  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    capture_kernels, after_ready = map(int, run.stdout.split()[-2:])
    assert capture_kernels == 0 and after_ready == 0
