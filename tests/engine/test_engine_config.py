"""EngineConfig.from_kwargs: the options a vLLM script passes to LLM(...)."""

from __future__ import annotations

import pytest

from tinyengine.config import EngineConfig


def test_vllm_options_run_unchanged_at_their_one_meaningful_value():
    config = EngineConfig.from_kwargs(
        "m", tensor_parallel_size=1, pipeline_parallel_size=1, trust_remote_code=True,
        disable_log_stats=True, max_num_seqs=3,
    )  # fmt: skip
    assert config.model == "m" and config.max_num_seqs == 3
    config = EngineConfig.from_kwargs("m", enable_chunked_prefill=True, dtype="half")
    assert config.dtype == "float16"  # vLLM's aliases: half, float
    assert EngineConfig.from_kwargs("m", dtype="float").dtype == "float32"


@pytest.mark.parametrize(
    "kwargs,words",
    [
        ({"tensor_parallel_size": 0}, "tensor_parallel_size must be a positive integer"),
        ({"load_threads": 0}, "load_threads must be a positive integer"),
        ({"load_threads": True}, "load_threads must be a positive integer"),
        ({"tensor_parallel_size": 2, "batch_invariant": True}, "not available with tensor_par"),
        ({"enable_expert_parallel": "on"}, "enable_expert_parallel must be True or False"),
        ({"pipeline_parallel_size": 4}, "pipeline_parallel_size: tinyengine has no pipeline"),
        ({"trust_remote_code": "yes"}, "trust_remote_code must be True or False"),
        ({"enable_chunked_prefill": False}, "enable_chunked_prefill: tinyengine always"),
    ],
)
def test_vllm_options_other_values_are_errors(kwargs, words):
    with pytest.raises(ValueError, match=words):
        EngineConfig.from_kwargs("m", **kwargs)


def test_unknown_options_are_named():
    with pytest.raises(TypeError, match=r"unknown engine option\(s\) \['swap_spaces'\]"):
        EngineConfig.from_kwargs("m", swap_spaces=4)


@pytest.mark.parametrize("arch", ["llama", "deepseek"])
def test_max_model_len_past_the_model_positions(tmp_path, arch):
    """allow_long_max_model_len (vLLM's escape hatch): sequences
    may run past max_position_embeddings; the rope caches are extended to
    max_model_len (HF computes RoPE at any position), so tokens there still
    equal HF's instead of indexing past the cache."""
    from tests.hf_deepseek import make_tiny_deepseek
    from tests.hf_models import hf_greedy, make_tiny_hf_model
    from tinyengine import LLM, SamplingParams

    if arch == "llama":
        path = make_tiny_hf_model("llama", tmp_path, max_position_embeddings=32)
    else:
        path = make_tiny_deepseek("v2-lite", tmp_path, max_position_embeddings=32)
    prompt = list(range(3, 31))  # 28 tokens; 12 more run to position 39 > 32
    with pytest.raises(ValueError, match="max_position_embeddings=32"):
        LLM(str(path), max_model_len=48, print_startup_report=False)
    llm = LLM(str(path), max_model_len=48, allow_long_max_model_len=True,
              print_startup_report=False)  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
    ref, _ = hf_greedy(path, [prompt], 12)
    assert out.outputs[0].token_ids == ref[0]


def test_block_size_default_follows_the_model_on_cuda_triton():
    """block_size=None (the default): 64 for DeepSeek (MLA) on CUDA with the
    Triton backend, whose decode kernel then loads whole 64-token pages
    through TMA (vLLM forces 64 for FlashMLA likewise); 16 for every other
    model, device or backend; an explicit value always stands. Resolution
    reads only config.json and the model class, so it runs without a GPU."""
    deepseek = {"architectures": ["DeepseekV3ForCausalLM"], "kv_lora_rank": 512}
    llama = {"architectures": ["LlamaForCausalLM"]}

    def resolved(hf_config, device, **kwargs):
        return EngineConfig("m", **kwargs).resolve_block_size(hf_config, device)

    assert EngineConfig("m").block_size is None
    assert resolved(deepseek, "cuda") == 64
    assert resolved(deepseek, "cuda", attention_backend="torch") == 16
    assert resolved(deepseek, "cpu") == 16
    assert resolved(deepseek, "cpu", attention_backend="triton") == 16  # the interpreter
    assert resolved(llama, "cuda") == 16
    assert resolved(deepseek, "cuda", block_size=16) == 16
    assert resolved(llama, "cpu", block_size=32) == 32
    with pytest.raises(ValueError, match="block_size must be a power of two"):
        EngineConfig("m", block_size=48)
    with pytest.raises(ValueError, match="block_size must be a positive integer"):
        EngineConfig("m", block_size=0)
