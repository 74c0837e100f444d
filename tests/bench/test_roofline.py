"""The decode roofline arithmetic (tinyengine/bench/roofline.py) on examples
worked out by hand, and the weight inventory of real tinyengine models."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from tinyengine.bench.roofline import (
    ExpertLayer,
    WeightInventory,
    decode_roofline,
    expected_distinct_experts,
    inventory_from_model,
    kv_bytes_per_token,
    kv_read_fn,
    mean_decode_context,
)
from tinyengine.bench.routing import distinct_experts
from tinyengine.models.registry import get_model_class

# 1000 dense bytes, a 100-row embedding of 10 bytes per row, one MoE layer of
# 8 experts (100 bytes each), 2 picked per token.
INVENTORY = WeightInventory(
    dense_bytes=1000,
    embedding_row_bytes=10,
    embedding_rows=100,
    expert_layers=(ExpertLayer(nbytes=800, num_experts=8, top_k=2),),
)


def test_expected_distinct_experts() -> None:
    assert expected_distinct_experts(8, 2, 1) == pytest.approx(2.0)  # one token: exactly K
    assert expected_distinct_experts(8, 2, 2) == pytest.approx(8 * (1 - 0.75**2))  # 3.5
    assert expected_distinct_experts(8, 2, 1000) == pytest.approx(8.0)  # saturates at E
    assert expected_distinct_experts(8, 8, 3) == pytest.approx(8.0)  # K = E: all, always


def test_weight_bytes_touched_by_hand() -> None:
    # B=1: 1000 dense + 1 row (10) + 2 of 8 experts (200) = 1210
    assert INVENTORY.bytes_touched(1) == pytest.approx(1210)
    # B=2: 1000 + 20 + 3.5/8 * 800 (350) = 1370
    assert INVENTORY.bytes_touched(2) == pytest.approx(1370)
    # huge B: every embedding row at most once, every expert: 1000 + 1000 + 800
    assert INVENTORY.bytes_touched(10_000) == pytest.approx(2800)
    assert INVENTORY.total_bytes == 2800


def test_measured_expert_counts_replace_the_uniform_guess() -> None:
    # B=2 with 2 of 8 experts measured (both tokens chose the same pair):
    # 1000 + 20 + 2/8 * 800 (200) = 1220, not the uniform 1370.
    assert INVENTORY.bytes_touched(2, experts_touched=[2.0]) == pytest.approx(1220)
    roof = decode_roofline(INVENTORY, 40, 2, 12.0, 1000.0, experts_touched=[2.0])
    assert roof.weight_bytes == pytest.approx(1220)


def test_distinct_experts_of_recorded_ids() -> None:
    # Four tokens; every one picks expert 0, and one other of 1..4 each.
    ids = np.array([[0, 1], [0, 2], [0, 3], [0, 4]])
    assert distinct_experts(ids, 1) == 2.0  # one token: its K experts
    assert distinct_experts(ids, 4) == 5.0  # all tokens: 0..4
    assert distinct_experts(ids, 100) == 5.0  # more rows than recorded: all of them
    assert 2.0 < distinct_experts(ids, 2) == 3.0  # any two tokens share expert 0


def test_decode_roofline_by_hand() -> None:
    # P=10, O=4: decode steps attend over 11, 12, 13 tokens -> mean 12 = P + O/2
    assert mean_decode_context(10, 4) == 12
    roof = decode_roofline(INVENTORY, kv_bytes_per_token=40, batch=2, mean_context=12.0,
                           bandwidth=1000.0)  # fmt: skip
    assert roof.weight_bytes == pytest.approx(1370)
    assert roof.kv_bytes == pytest.approx(40 * 12 * 2)  # 960
    assert roof.total_bytes == pytest.approx(2330)
    assert roof.step_s == pytest.approx(2.33)
    assert roof.tokens_per_s == pytest.approx(2 / 2.33)
    with pytest.raises(ValueError, match="bandwidth"):
        decode_roofline(INVENTORY, 40, 1, 12.0, 0.0)


def _tiny_llama(tied: bool) -> torch.nn.Module:
    config = {
        "architectures": ["LlamaForCausalLM"], "hidden_size": 16, "num_hidden_layers": 2,
        "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 8,
        "intermediate_size": 32, "vocab_size": 100, "tie_word_embeddings": tied,
        "max_position_embeddings": 64,
    }  # fmt: skip
    return get_model_class(config)(config)


@pytest.mark.parametrize("tied", [True, False])
def test_inventory_of_a_llama(tied: bool) -> None:
    # Per layer, fp32 elements: q 16x16 + k 8x16 + v 8x16 + o 16x16 = 768,
    # gate/up 2x32x16 + down 16x32 = 1536, two norms 32 -> 2336; two layers
    # 4672, final norm 16, lm_head 100x16 = 1600 (in full, tied or not).
    inventory = inventory_from_model(_tiny_llama(tied))
    assert inventory.dense_bytes == (4672 + 16 + 1600) * 4
    assert inventory.embedding_rows == 100
    assert inventory.embedding_row_bytes == 16 * 4
    assert inventory.expert_layers == ()
    assert inventory.bytes_touched(3) == (4672 + 16 + 1600 + 3 * 16) * 4


def test_inventory_and_kv_of_a_deepseek() -> None:
    from tinyengine.tools.make_proxy import preset_config

    config = preset_config("deepseek-v3-tiny")
    model = get_model_class(config)(config)
    inventory = inventory_from_model(model, config)
    # One MoE layer: 8 experts of w13 [64, 64] + w2 [64, 32] fp32 elements.
    assert inventory.expert_layers == (ExpertLayer(8 * (64 * 64 + 64 * 32) * 4, 8, 2),)
    every_param = sum(p.numel() * p.element_size() for p in model.parameters())
    assert inventory.total_bytes == every_param  # untied: each parameter counted once
    # The MLA latent cache: (kv_lora_rank 32 + rope 8) per token and layer, 2 layers.
    runner = SimpleNamespace(model=model, kv_caches=[], dtype=torch.bfloat16)
    assert kv_bytes_per_token(runner) == (32 + 8) * 2 * 2


def test_deepseek_v4_decode_reads_its_window_and_entries_not_its_whole_cache() -> None:
    """V4's roofline counts what a decode step reads (the model's
    decode_cache_read_bytes), by hand for V4-Flash's widths at 4k context."""
    from tinyengine.models.deepseek_v4 import DeepseekV4ForCausalLM
    from tinyengine.tools.make_v4 import preset_config

    config = preset_config("deepseek-v4-flash-proxy")
    with torch.device("meta"):
        model = DeepseekV4ForCausalLM(config)
    runner = SimpleNamespace(model=model, kv_caches=[], dtype=torch.bfloat16)
    read = kv_read_fn(runner)
    window = 4 * 128 * 512 * 2  # four layers' last 128 raw rows
    csa = 512 * 512 * 2 + 1024 * 128 * 2 + 2 * (4 * 512 + 4 * 128) * 4  # top-k, index keys, state
    hca = 32 * 512 * 2 + 2 * 512 * 4  # 4096 / 128 entries, state
    assert read(4096.0) == window + csa + hca
    # Past the window, a step reads more only of what grows with the context:
    # 1,024 more index keys and 32 more HCA entries per 4k tokens.
    assert read(8192.0) - read(4096.0) == 1024 * 128 * 2 + 32 * 512 * 2
    # What stays resident per token is the full-history group alone: CSA
    # entries + index keys + HCA entries (one row per 1,024-token block).
    assert kv_bytes_per_token(runner) == 256 + 64 + 8
    no_hook = SimpleNamespace(model=SimpleNamespace(), dtype=torch.bfloat16)
    assert kv_read_fn(no_hook) is None
