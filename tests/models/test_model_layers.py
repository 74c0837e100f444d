"""Shared layers and config parsing: RoPE from both config.json spellings and
against HF's own rotary embedding, RMSNorm's fused residual add, the packed
weight loaders, and the constructor seams (tp, unsupported configs)."""

from __future__ import annotations

import pytest
import torch

from tests.hf_models import LLAMA3_ROPE, YARN_ROPE
from tinyengine.kernels import torch_ops
from tinyengine.models.layers import RMSNorm
from tinyengine.models.llama import LlamaForCausalLM, Qwen2ForCausalLM
from tinyengine.models.parallel_layers import QKVParallelLinear, packed_weight_loader
from tinyengine.models.rotary import RotaryEmbedding, get_rope_parameters

TINY = dict(
    architectures=["LlamaForCausalLM"], hidden_size=64, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=128,
    vocab_size=512, max_position_embeddings=512,
)  # fmt: skip


def test_rope_parameters_from_both_config_spellings() -> None:
    legacy = {  # transformers < 5
        "rope_theta": 500000.0,
        "rope_scaling": {"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    }  # fmt: skip
    new = {  # transformers >= 5
        "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                            "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                            "original_max_position_embeddings": 8192},
    }  # fmt: skip
    a, b = get_rope_parameters(legacy), get_rope_parameters(new)
    assert a["rope_type"] == b["rope_type"] == "llama3"
    assert {k: a[k] for k in b} == b
    assert get_rope_parameters({}) == {"rope_type": "default", "rope_theta": 10000.0}
    assert get_rope_parameters({"rope_theta": 1e6})["rope_theta"] == 1e6


def test_rope_rejects_what_it_cannot_do() -> None:
    with pytest.raises(ValueError, match="'dynamic' is not supported"):
        RotaryEmbedding(16, 32, get_rope_parameters({"rope_parameters": {"rope_type": "dynamic"}}))
    with pytest.raises(ValueError, match="nested"):
        get_rope_parameters({"rope_parameters": {"full_attention": {"rope_type": "default"}}})


YARN_ROPE_BETAS = {**YARN_ROPE, "beta_fast": 16, "beta_slow": 2, "truncate": False}


@pytest.mark.parametrize("rope", [None, LLAMA3_ROPE, YARN_ROPE, YARN_ROPE_BETAS],
                         ids=["default", "llama3", "yarn", "yarn-betas"])  # fmt: skip
def test_rope_cache_matches_hf(rope: dict | None) -> None:
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    config_kwargs = {k: v for k, v in TINY.items() if k != "architectures"}
    if rope is not None:
        config_kwargs["rope_parameters"] = rope
    hf_config = LlamaConfig(**config_kwargs)
    positions = torch.arange(512)[None]
    cos, sin = LlamaRotaryEmbedding(hf_config)(torch.zeros(1, dtype=torch.float32), positions)

    ours = RotaryEmbedding(16, 512, get_rope_parameters(hf_config.to_dict()))
    our_cos, our_sin = ours.cos_sin_cache.chunk(2, dim=-1)
    torch.testing.assert_close(our_cos, cos[0, :, :8], atol=1e-6, rtol=0)
    torch.testing.assert_close(our_sin, sin[0, :, :8], atol=1e-6, rtol=0)


def test_rmsnorm_fused_residual_add() -> None:
    torch.manual_seed(0)
    norm = RMSNorm(8, eps=1e-5)
    norm.weight.data.uniform_(0.5, 1.5)
    x, residual = torch.randn(3, 8), torch.randn(3, 8)
    ops = torch_ops()
    out, new_residual = norm(x, ops, residual)
    torch.testing.assert_close(new_residual, x + residual)
    torch.testing.assert_close(out, norm(x + residual, ops))
    expected = (x + residual) / ((x + residual).pow(2).mean(-1, keepdim=True) + 1e-5).sqrt()
    torch.testing.assert_close(out, expected * norm.weight)


def test_packed_weight_loader_checks_shard_and_shape() -> None:
    qkv = QKVParallelLinear(8, head_dim=2, num_heads=4, num_kv_heads=2, bias=True)
    assert qkv.weight.shape == (8 + 4 + 4, 8)
    qkv.weight.weight_loader(qkv.weight, torch.ones(4, 8), "k")
    assert qkv.weight[8:12].eq(1).all()
    with pytest.raises(ValueError, match="unknown shard 'x'"):
        packed_weight_loader(qkv.weight, torch.ones(4, 8), "x")
    with pytest.raises(ValueError, match="shape mismatch for shard 'q'"):
        packed_weight_loader(qkv.weight, torch.ones(4, 8), "q")


def test_tensor_parallel_shards_and_refusals() -> None:
    # The Llama family shards (tests/distributed runs it over processes);
    # a head count the ranks do not divide is refused.
    model = LlamaForCausalLM(TINY, tp_rank=1, tp_size=2)
    attn = model.model.layers[0].self_attn
    assert (attn.num_heads, attn.num_kv_heads) == (2, 1)
    assert tuple(attn.qkv_proj.weight.shape) == (4 * 16, 64)  # 2 q heads + 1 k + 1 v
    assert tuple(attn.o_proj.weight.shape) == (64, 2 * 16)
    assert model.kv_cache_spec().num_kv_heads == 1
    qkv = QKVParallelLinear(8, 2, 4, 2, bias=False, tp_rank=1, tp_size=2)
    packed_weight_loader(qkv.weight, torch.arange(8.0)[:, None].expand(8, 8), "q")
    assert qkv.weight[:4, 0].tolist() == [4.0, 5.0, 6.0, 7.0]  # rank 1's two q heads
    with pytest.raises(ValueError, match="num_attention_heads=4 is not divisible"):
        LlamaForCausalLM(TINY, tp_rank=0, tp_size=3)
    # Heads that divide but an MLP width that does not: the error names the config field.
    odd_mlp = dict(TINY, intermediate_size=130)
    with pytest.raises(ValueError, match="intermediate_size=130 is not divisible by tensor_par"):
        LlamaForCausalLM(odd_mlp, tp_rank=0, tp_size=4)


def test_model_api_shapes() -> None:
    model = LlamaForCausalLM(TINY)
    assert model.num_attention_layers == 2
    assert (model.hidden_size, model.vocab_size) == (64, 512)
    spec = model.kv_cache_spec()
    assert (spec.num_kv_heads, spec.head_dim_k, spec.head_dim_v) == (2, 16, 16)
    assert set(LlamaForCausalLM.packed_modules_mapping) == {
        "q_proj", "k_proj", "v_proj", "gate_proj", "up_proj",
    }  # fmt: skip
    # One cos/sin cache shared by all layers.
    assert model.model.layers[1].self_attn.rotary_emb is model.model.rotary_emb


def test_unsupported_configs_are_rejected() -> None:
    with pytest.raises(ValueError, match="sliding-window"):
        Qwen2ForCausalLM({**TINY, "use_sliding_window": True, "max_window_layers": 1})
    with pytest.raises(ValueError, match="sliding-window"):
        Qwen2ForCausalLM({**TINY, "layer_types": ["full_attention", "sliding_attention"]})
    # Sliding from layer max_window_layers >= the layer count: nowhere (HF's
    # layer_types are all full_attention), so the model is accepted.
    Qwen2ForCausalLM({**TINY, "use_sliding_window": True, "max_window_layers": 2})
    Qwen2ForCausalLM({**TINY, "use_sliding_window": True})  # Qwen2Config's default: 28
    with pytest.raises(ValueError, match="multiple of"):
        LlamaForCausalLM({**TINY, "num_key_value_heads": 3})
    with pytest.raises(ValueError, match="hidden_act"):
        LlamaForCausalLM({**TINY, "hidden_act": "gelu"})
    with pytest.raises(ValueError, match="partial_rotary_factor"):
        LlamaForCausalLM({**TINY, "partial_rotary_factor": 0.5})
    with pytest.raises(ValueError, match=r"lacks \['intermediate_size'\]"):
        LlamaForCausalLM({k: v for k, v in TINY.items() if k != "intermediate_size"})


def test_qwen2_bias_layout() -> None:
    model = Qwen2ForCausalLM(TINY)
    attn = model.model.layers[0].self_attn
    assert attn.qkv_proj.bias is not None and attn.o_proj.bias is None
    llama_attn = LlamaForCausalLM({**TINY, "attention_bias": True}).model.layers[0].self_attn
    assert llama_attn.qkv_proj.bias is not None and llama_attn.o_proj.bias is not None
