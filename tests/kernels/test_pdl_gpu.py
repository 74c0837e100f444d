"""Programmatic dependent launch on the GPU (`pytest -m gpu`; Hopper only).

A kernel launched with PDL may start while the one before it still runs, so a
program that touched its input before `gdc_wait()` would read stale data. The
chain below is the decode step's dependency pattern (norm + linear, linear,
norm + gate_up + activation, linear, norm: each reading the previous
output, the norms fused into the linears as at batch 1), captured in a
CUDA graph and replayed with a new input each time: every replay must equal
the same chain run eagerly without PDL, bit for bit. Then a whole bf16 engine
with PDL on and off: the same tokens and log-probs.
"""

from __future__ import annotations

import pytest
import torch

from tests.hf_models import make_tiny_hf_model
from tinyengine import LLM, SamplingParams
from tinyengine.kernels import launch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
        reason="programmatic dependent launch needs a Hopper (sm_90+) GPU",
    ),
]


def _chain(x, res, w):
    from tinyengine.kernels.gemv.norm_linear import rms_norm_linear
    from tinyengine.kernels.gemv.triton import skinny_linear
    from tinyengine.kernels.norm.triton import rms_norm_triton

    h, res = rms_norm_linear(x, w["n1"], 1e-6, res, w["up"])  # [1, 2048], K = 1024, fused
    h = skinny_linear(h, w["down"])  # [1, 1024], K = 2048
    h, res = rms_norm_linear(h, w["n2"], 1e-6, res, w["gate_up"], silu_mul=True)  # [1, 3072]
    h = skinny_linear(h, w["out"])  # [1, 1024], K = 3072
    return rms_norm_triton(h, w["n3"], 1e-6, res)


def test_pdl_chain_in_graph_equals_eager_without_pdl(monkeypatch):
    g = torch.Generator(device="cuda").manual_seed(0)

    def rand(*shape):
        return (
            torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=g) / shape[-1] ** 0.5
        )

    w = {"n1": 1 + rand(1024), "n2": 1 + rand(1024), "n3": 1 + rand(1024),
         "up": rand(2048, 1024),
         "down": rand(1024, 2048), "gate_up": rand(6144, 1024),
         "out": rand(1024, 3072)}  # fmt: skip
    x_in, res_in = rand(1, 1024), rand(1, 1024)
    assert launch.programmatic_launch(x_in.device)
    _chain(x_in, res_in, w)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, res_out = _chain(x_in, res_in, w)
    monkeypatch.setattr(launch, "PDL_ENABLED", False)
    for i in range(50):
        x_in.copy_(rand(1, 1024) * (1 + i % 7))
        res_in.copy_(rand(1, 1024))
        graph.replay()
        want, want_res = _chain(x_in, res_in, w)
        torch.cuda.synchronize()
        assert torch.equal(out, want), f"replay {i}: the PDL chain read a stale input"
        assert torch.equal(res_out, want_res), f"replay {i}"


def test_engine_with_and_without_pdl_agree(tmp_path, monkeypatch):
    path = make_tiny_hf_model("qwen3", tmp_path / "qwen3", hidden_size=256,
                              intermediate_size=768, num_attention_heads=4,
                              num_key_value_heads=2, head_dim=64)  # fmt: skip
    prompts = [{"prompt_token_ids": [5 + i, 17, 33 + 2 * i, 9] * (3 + i)} for i in range(3)]
    params = SamplingParams(max_tokens=24, temperature=0.0, logprobs=1)
    runs = []
    for enabled in (True, False):
        monkeypatch.setattr(launch, "PDL_ENABLED", enabled)
        llm = LLM(str(path), dtype="bfloat16", max_model_len=256, max_num_seqs=4,
                  print_startup_report=False)  # fmt: skip
        assert llm.startup_report().captured_sizes, "graphs were captured"
        outs = llm.generate(prompts, params, use_tqdm=False)
        runs.append([(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs])
        del llm
        torch.cuda.empty_cache()
    assert runs[0] == runs[1]
