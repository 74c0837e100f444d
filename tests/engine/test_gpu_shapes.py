"""Model shapes and engine layouts off the beaten path, on the GPU: compiled
Triton kernels (attention with a head size that is not a power of two, MQA,
a 128/256-wide head, MLA with other latent and rope widths, MoE with top-1
and no shared experts), several KV block sizes, and CUDA graphs — greedy
tokens equal HF's (fp32, HF on CPU), with nothing compiled after READY."""

from __future__ import annotations

import pytest

from tests import hf_deepseek, hf_models
from tinyengine import LLM, SamplingParams

pytestmark = pytest.mark.gpu

PROMPTS = [[5, 6, 7], list(range(3, 60)), [9] * 20, [11, 12], list(range(100, 140))]
MAX_NEW = 10

# name -> (builder, variant/arch, config overrides, engine options)
CASES = {
    "llama-hd80-mha-block8": ("dense", "llama", dict(hidden_size=160, num_attention_heads=2,
                              num_key_value_heads=2, head_dim=80), dict(block_size=8)),
    "qwen3-hd128-mqa": ("dense", "qwen3", dict(hidden_size=128, num_attention_heads=2,
                        num_key_value_heads=1, head_dim=128), {}),
    "qwen2-hd256-block32": ("dense", "qwen2", dict(hidden_size=256, num_attention_heads=2,
                            num_key_value_heads=1, head_dim=256), dict(block_size=32)),
    "v3-latent48-rope16": ("deepseek", "v3", dict(kv_lora_rank=48, qk_rope_head_dim=16,
                           v_head_dim=16), {}),
    "v3-top1-16heads-block64": ("deepseek", "v3", dict(num_attention_heads=16,
                                num_key_value_heads=16, num_experts_per_tok=1, n_group=1,
                                topk_group=1), dict(block_size=64)),
    "v2-lite-no-shared": ("deepseek", "v2-lite", dict(n_shared_experts=0), {}),
}  # fmt: skip


@pytest.mark.parametrize("name", list(CASES))
def test_shape_matches_hf_with_triton_kernels_and_graphs(tmp_path, name):
    builder, kind, overrides, options = CASES[name]
    if builder == "dense":
        path = hf_models.make_tiny_hf_model(kind, tmp_path, **overrides)
        want, _ = hf_models.hf_greedy(path, PROMPTS, MAX_NEW)
    else:
        path = hf_deepseek.make_tiny_deepseek(kind, tmp_path, **overrides)
        want, _ = hf_deepseek.hf_greedy(path, PROMPTS, MAX_NEW)
    llm = LLM(str(path), dtype="float32", max_model_len=256, max_num_seqs=8,
              cuda_graph_sizes=[1, 2, 4, 8], attention_backend="triton",
              print_startup_report=False, **options)  # fmt: skip
    assert llm.startup_report().captured_sizes == [1, 2, 4, 8]
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == want
    assert llm.stats()["jit_compiles_after_ready"] == 0
