"""DeepSeek tiny models on the GPU (`pytest -m gpu`): the whole engine with
the Triton op set, decode CUDA graphs (MLA absorbed decode and MoE inside the
graphs) equal to eager, and both equal to HF, in fp32."""

from __future__ import annotations

import pytest

from tests.hf_deepseek import hf_greedy, make_tiny_deepseek
from tinyengine import LLM, SamplingParams

pytestmark = pytest.mark.gpu

PROMPTS = [[5, 6, 7], list(range(3, 40)), [9] * 20, [11, 12], list(range(100, 117))]


@pytest.mark.parametrize("variant", ["v3", "v2-lite"])
def test_deepseek_graphs_equal_eager_equal_hf(tmp_path, variant):
    from tinyengine.kernels import jit_monitor

    path = make_tiny_deepseek(variant, tmp_path)
    hf_tokens, _ = hf_greedy(path, PROMPTS, 10)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    results = {}
    for eager in (False, True):
        llm = LLM(str(path), max_model_len=256, max_num_seqs=8, cuda_graph_sizes=[1, 2, 4, 8],
                  dtype="float32", enforce_eager=eager, print_startup_report=False)  # fmt: skip
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
        results[eager] = [o.outputs[0].token_ids for o in outs]
        if not eager:
            assert llm.startup_report().captured_sizes == [1, 2, 4, 8]
            assert llm.startup_report().workspace_growth_after_kv_sizing == 0
            late = jit_monitor.compiled_since(llm.engine._jit_compiles_at_ready)
            assert llm.stats()["jit_compiles_after_ready"] == 0, late
    assert results[False] == results[True] == hf_tokens


def test_v3_attention_widths_decode_with_the_gluon_kernel(tmp_path, monkeypatch):
    """bf16 at V3's attention widths (128 heads, latent 512 + rope 64; the
    rest tiny): the engine picks 64-token cache blocks, decode runs the
    Hopper Gluon MLA kernel (tinyengine/kernels/mla/gluon.py) inside the CUDA graphs,
    nothing compiles after READY, and greedy tokens with graphs equal eager."""
    import tinyengine.kernels.mla.gluon as mla_gluon
    from tinyengine.kernels import jit_monitor

    launches = []
    real_launch = mla_gluon.launch_split

    def counted_launch(*args, **kwargs):  # the real kernel, counted
        launches.append(args[0].shape)
        return real_launch(*args, **kwargs)

    monkeypatch.setattr(mla_gluon, "launch_split", counted_launch)
    path = make_tiny_deepseek(
        "v3", tmp_path, num_attention_heads=128, num_key_value_heads=128, kv_lora_rank=512,
        qk_rope_head_dim=64, qk_nope_head_dim=16, v_head_dim=16,
    )  # fmt: skip
    prompts = [*PROMPTS, list(range(200, 350))]  # 150 tokens: whole pages and a partial one
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    results = {}
    for eager in (False, True):
        llm = LLM(str(path), max_model_len=512, max_num_seqs=8, cuda_graph_sizes=[1, 2, 4, 8],
                  dtype="bfloat16", enforce_eager=eager, print_startup_report=False)  # fmt: skip
        assert llm.engine.config.block_size == 64
        launches.clear()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        results[eager] = [o.outputs[0].token_ids for o in outs]
        if eager:
            assert launches  # eager decode steps call the Gluon launcher (graphs replay it)
        else:
            late = jit_monitor.compiled_since(llm.engine._jit_compiles_at_ready)
            assert llm.stats()["jit_compiles_after_ready"] == 0, late
    assert results[False] == results[True]
