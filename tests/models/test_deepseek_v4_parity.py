"""DeepSeek-V4 against Hugging Face, fp32 on CPU, through the paged forward
harness: logits of whole prompts, of chunks that end anywhere relative to the
sliding window (8) and the compression windows (4 for CSA, 8 for HCA), of
decode steps and of mixed batches with padding rows, within 1e-4, for block
sizes below, equal to and above the ratios. Also: the checkpoint names of
DeepSeek's release, layer truncation, ignored MTP weights, and a block size
that cannot page the compressed entries."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.hf_deepseek import hf_logits
from tests.hf_deepseek_v4 import make_tiny_v4
from tests.models.forward_harness import PagedHarness, load_tiny
from tinyengine.models.deepseek_v4 import checkpoint_to_param

TOL = 1e-4


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_v4(tmp_path_factory.mktemp("v4"))


@pytest.fixture(scope="module")
def model(tiny):
    return load_tiny(tiny)


def _tokens(n: int, seed: int) -> list[int]:
    return torch.randint(3, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("block_size", [4, 8, 16])
def test_chunks_and_decode_steps_match_hf(tiny, model, block_size):
    ids = _tokens(60, 1)
    ref = hf_logits(tiny, ids)
    harness = PagedHarness(model, block_size=block_size, num_blocks=64)
    cuts = [0, 13, 22, 23, 30, 35, 41, 60]  # unaligned to 4, 8 and the block sizes
    got = [harness.step({0: ids[a:b]})[0] for a, b in zip(cuts, cuts[1:], strict=False)]
    torch.testing.assert_close(torch.cat(got), ref, atol=TOL, rtol=0)
    harness = PagedHarness(model, block_size=block_size, num_blocks=64)
    got = [harness.step({0: ids[:9]})[0]] + [harness.step({0: [t]})[0] for t in ids[9:]]
    torch.testing.assert_close(torch.cat(got), ref, atol=TOL, rtol=0)


@pytest.mark.parametrize(
    "overrides",
    [
        # Four residual streams, no hash-routed layer, other ratios and window.
        dict(hc_mult=4, num_hash_layers=0, compress_rate_csa=2, compress_rate_hca=16,
             sliding_window=16, index_topk=8),
        # One stream (mHC reduces to a plain residual), two sliding layers first.
        dict(hc_mult=1, layer_types=["sliding_attention", "sliding_attention",
                                     "compressed_sparse_attention",
                                     "heavily_compressed_attention"]),
    ],
    ids=["hc4-ratios-2-16", "hc1-two-sliding"],
)  # fmt: skip
def test_other_configurations_match_hf(tmp_path, overrides):
    """Shapes of V4 the tiny model above does not have, prefill in unaligned
    chunks then decode steps."""
    path = make_tiny_v4(tmp_path, **overrides)
    ids = _tokens(50, 5)
    ref = hf_logits(path, ids)
    harness = PagedHarness(load_tiny(path), block_size=16, num_blocks=64)
    cuts = [0, 7, 19, 33]
    got = [harness.step({0: ids[a:b]})[0] for a, b in zip(cuts, cuts[1:], strict=False)]
    got += [harness.step({0: [t]})[0] for t in ids[33:]]
    torch.testing.assert_close(torch.cat(got), ref, atol=TOL, rtol=0)


def test_mixed_batch_with_padding(tiny, model):
    """A decode row, a whole prompt and a chunk after a prefix in one step,
    plus padding rows; then both sequences decode together."""
    a, b, c = _tokens(30, 2), _tokens(21, 3), _tokens(45, 4)
    refs = {0: hf_logits(tiny, a), 1: hf_logits(tiny, b), 2: hf_logits(tiny, c)}
    harness = PagedHarness(model, block_size=8, num_blocks=64)
    got = {0: [harness.step({0: a[:17]})[0]], 2: [harness.step({2: c[:26]})[2]], 1: []}
    out = harness.step({2: c[26:27], 1: b, 0: a[17:29]}, num_padding=3)
    for seq, logits in out.items():
        got[seq].append(logits)
    for i in range(27, 45):
        step = {2: [c[i]]} if i != 29 else {2: [c[i]], 0: [a[29]]}
        for seq, logits in harness.step(step, num_padding=1).items():
            got[seq].append(logits)
    for seq, parts in got.items():
        logits = torch.cat(parts)
        torch.testing.assert_close(logits, refs[seq][: len(logits)], atol=TOL, rtol=0)


def test_layer_truncation_matches_hf_with_fewer_layers(tiny):
    ids = _tokens(30, 5)
    ref = hf_logits(tiny, ids, num_hidden_layers=3)
    harness = PagedHarness(load_tiny(tiny, {"num_hidden_layers": 3}), block_size=8)
    torch.testing.assert_close(harness.step({0: ids})[0], ref, atol=TOL, rtol=0)


def test_release_names_and_mtp_weights(tiny, tmp_path):
    """DeepSeek's release spells names without `model.` (embed, norm,
    hc_head_fn, layers.N.attn.wq_a, ...) and ships MTP layers; both load."""
    tensors = load_file(str(tiny / "model.safetensors"))
    renamed = {}
    for name, tensor in tensors.items():
        name = name.removeprefix("model.")
        name = {"embed_tokens.weight": "embed.weight", "hc_head.hc_fn": "hc_head_fn",
                "hc_head.hc_base": "hc_head_base", "hc_head.hc_scale": "hc_head_scale"}.get(
            name, name)  # fmt: skip
        renamed[name] = tensor
    renamed["mtp.0.attn.wq_a.weight"] = torch.zeros(3, 3)
    save_file(renamed, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text((tiny / "config.json").read_text())
    ids = _tokens(20, 6)
    harness = PagedHarness(load_tiny(tmp_path), block_size=8)
    torch.testing.assert_close(harness.step({0: ids})[0], hf_logits(tiny, ids), atol=TOL, rtol=0)


def test_checkpoint_names_map_to_parameters():
    assert checkpoint_to_param("layers.3.attn.indexer.compressor.ape") == (
        "model.layers.3.self_attn.compressor.indexer.position_bias", None)  # fmt: skip
    assert checkpoint_to_param("model.layers.1.ffn.experts.5.w3.weight") == (
        "model.layers.1.mlp.experts.w13_weight", (5, 1))  # fmt: skip
    assert checkpoint_to_param("layers.0.ffn.gate.bias") == (
        "model.layers.0.mlp.gate.e_score_correction_bias", None)  # fmt: skip
    assert (
        checkpoint_to_param("layers.2.attn.norm.weight")[0]
        == "model.layers.2.self_attn.kv_norm.weight"
    )
    assert checkpoint_to_param("norm.weight")[0] == "model.norm.weight"
    assert checkpoint_to_param("head.weight")[0] == "lm_head.weight"
    # HF's own names pass through.
    name = "model.layers.2.self_attn.compressor.kv_norm.weight"
    assert checkpoint_to_param(name) == (name, None)


def test_block_size_must_page_the_compressed_entries(tiny, model):
    harness = PagedHarness(model, block_size=12, num_blocks=16)
    with pytest.raises(ValueError, match="block_size=12 and the compression ratio 8"):
        harness.step({0: _tokens(20, 7)})


def test_config_json_legacy_spellings(tiny, tmp_path):
    """compress_ratios / num_hash_layers / qk_rope_head_dim (older V4
    configs) mean what HF folds them into."""
    from tinyengine.models.deepseek_v4 import DeepseekV4Args

    config = json.loads((tiny / "config.json").read_text())
    legacy = dict(config)
    for key in ("layer_types", "mlp_layer_types", "compress_rates", "partial_rotary_factor"):
        legacy.pop(key)
    legacy.update(compress_ratios=[0, 4, 128, 4], num_hash_layers=1, qk_rope_head_dim=8)
    args = DeepseekV4Args(legacy)
    assert args.layer_types == config["layer_types"]
    assert args.mlp_layer_types == config["mlp_layer_types"]
    assert args.attention.rope_dim == 8
    with pytest.raises(ValueError, match="layer_types"):
        DeepseekV4Args({**config, "layer_types": ["sliding_attention"] * 3 + ["dense"]})


def test_long_chunks_attend_in_query_tiles(tiny, model):
    """Chunks longer than the reference's 256-query tile (a prompt of 300,
    then 200 more after it): each tile reads only the raw rows its window
    reaches, and the logits still match HF."""
    ids = _tokens(500, 8)
    ref = hf_logits(tiny, ids)
    harness = PagedHarness(model, block_size=16, num_blocks=40)
    got = [harness.step({0: ids[:300]})[0], harness.step({0: ids[300:]})[0]]
    torch.testing.assert_close(torch.cat(got), ref, atol=TOL, rtol=0)
