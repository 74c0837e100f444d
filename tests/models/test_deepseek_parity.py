"""DeepSeek-V2/V3 models against Hugging Face, fp32 on CPU, through the paged
forward harness: logits of prompts, chunks after a cached prefix, absorbed
decode steps and mixed decode+prefill batches within 1e-4; routing equal to
HF's router (ties included); per-expert stacking; layer truncation of a
sharded checkpoint; config spellings and dtype rules."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from tests.hf_deepseek import VARIANTS, hf_logits, make_config, make_tiny_deepseek
from tests.models.forward_harness import PagedHarness, load_tiny
from tinyengine.kernels import torch_ops
from tinyengine.kernels.moe.reference import _fused_moe_dense
from tinyengine.models.context import AttentionMetadata, ForwardContext

TOL = 1e-4


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    built: dict[str, Path] = {}

    def get(variant: str) -> Path:
        if variant not in built:
            built[variant] = make_tiny_deepseek(variant, tmp_path_factory.mktemp(variant))
        return built[variant]

    return get


def _tokens(n: int, seed: int) -> list[int]:
    return torch.randint(3, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_logits_match_hf(tiny, variant):
    """Prefill (expanded), a chunk after a cached prefix (expanded over a
    longer context), then single-token decode steps (absorbed)."""
    path = tiny(variant)
    ids = _tokens(40, 1)
    ref = hf_logits(path, ids)
    harness = PagedHarness(load_tiny(path), block_size=8, num_blocks=32)
    got = [harness.step({0: ids[:21]})[0], harness.step({0: ids[21:34]})[0]]
    got += [harness.step({0: [t]})[0] for t in ids[34:]]
    torch.testing.assert_close(torch.cat(got), ref, atol=TOL, rtol=0)


def test_no_shared_experts_matches_hf(tmp_path):
    """n_shared_experts = 0: transformers still saves zero-width shared-expert
    MLPs; the model has none, skips those tensors, and matches HF."""
    path = make_tiny_deepseek("v2-lite", tmp_path, n_shared_experts=0)
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        assert any(".shared_experts." in name for name in f.keys())
    ids = _tokens(12, 5)
    harness = PagedHarness(load_tiny(path), block_size=8, num_blocks=8)
    got = [harness.step({0: ids[:9]})[0]] + [harness.step({0: [t]})[0] for t in ids[9:]]
    torch.testing.assert_close(torch.cat(got), hf_logits(path, ids), atol=TOL, rtol=0)


def test_moe_layer_freq_is_ignored_as_hf_does(tmp_path):
    """moe_layer_freq = 2: HF still builds (and saves) experts in every layer
    from first_k_dense_replace on; the model loads them all and matches."""
    path = make_tiny_deepseek("v3", tmp_path, num_hidden_layers=3, moe_layer_freq=2)
    ids = _tokens(12, 6)
    harness = PagedHarness(load_tiny(path), block_size=8, num_blocks=8)
    got = [harness.step({0: ids[:9]})[0]] + [harness.step({0: [t]})[0] for t in ids[9:]]
    torch.testing.assert_close(torch.cat(got), hf_logits(path, ids), atol=TOL, rtol=0)


def test_mixed_batch_with_padding(tiny):
    """One step holding a decode row, a prompt and a chunk after a prefix
    (out of order), plus padding rows: each row must still match HF."""
    path = tiny("v3")
    a, b, c = _tokens(30, 2), _tokens(12, 3), _tokens(25, 4)
    refs = {0: hf_logits(path, a), 1: hf_logits(path, b), 2: hf_logits(path, c)}
    harness = PagedHarness(load_tiny(path), block_size=4, num_blocks=64)
    harness.step({0: a[:29], 2: c[:9]})
    out = harness.step({2: c[9:], 0: a[29:], 1: b}, num_padding=3)
    torch.testing.assert_close(out[0], refs[0][29:], atol=TOL, rtol=0)
    torch.testing.assert_close(out[1], refs[1], atol=TOL, rtol=0)
    torch.testing.assert_close(out[2], refs[2][9:], atol=TOL, rtol=0)


def _graph_shaped_decode(harness: PagedHarness, tokens: dict[int, int], max_seq_len: int):
    """A decode step built the way the runner builds a captured one: no host
    lengths, max_seq_len far above the real lengths, a wide block table."""
    model, bs = harness.model, harness.block_size
    seq_ids = list(tokens)
    slots, positions, lens = [], [], []
    for s in seq_ids:
        pos = harness.seq_lens[s]
        slots.append(harness._slot(s, pos))
        positions.append(pos)
        harness.seq_lens[s] = pos + 1
        lens.append(pos + 1)
    width = -(-max_seq_len // bs)
    tables = [harness.block_tables[s] for s in seq_ids]
    table = [t + [0] * (width - len(t)) for t in tables]
    n = len(seq_ids)
    attn = AttentionMetadata(
        num_tokens=n, num_seqs=n, max_query_len=1, max_seq_len=max_seq_len,
        query_start_loc=torch.arange(n + 1, dtype=torch.int32),
        seq_lens=torch.tensor(lens, dtype=torch.int32),
        block_tables=torch.tensor(table, dtype=torch.int32),
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        query_start_loc_cpu=None, seq_lens_cpu=None,
    )  # fmt: skip
    ctx = ForwardContext(attn, harness.kv_caches, harness.ops)
    with torch.inference_mode():
        hidden = model(torch.tensor([tokens[s] for s in seq_ids]), torch.tensor(positions), ctx)
        return model.compute_logits(hidden, ctx.ops)


def test_decode_without_host_lengths_reads_nothing_on_host(tiny, monkeypatch):
    """The decode path as captured in a CUDA graph: with the MoE in its
    graph-safe dense form, nothing in the model may read a tensor on the host
    (any .item()/.tolist()/bool()/int() raises here)."""
    path = tiny("v3")
    a, b = _tokens(20, 5), _tokens(7, 6)
    harness = PagedHarness(load_tiny(path), block_size=4, num_blocks=64)
    harness.step({0: a[:19], 1: b[:6]})
    harness.ops = dataclasses.replace(torch_ops(), fused_moe=_dense_op)

    def forbidden(*args, **kwargs):
        raise AssertionError("host read of a device tensor on the decode path")

    for name in ("item", "tolist", "__bool__", "__int__", "__float__", "__index__"):
        monkeypatch.setattr(torch.Tensor, name, forbidden)
    logits = _graph_shaped_decode(harness, {0: a[19], 1: b[6]}, max_seq_len=64)
    monkeypatch.undo()
    torch.testing.assert_close(logits[0], hf_logits(path, a)[-1], atol=TOL, rtol=0)
    torch.testing.assert_close(logits[1], hf_logits(path, b)[-1], atol=TOL, rtol=0)


def _dense_op(x, w13, w2, weights, ids, *, workspace=None):
    return _fused_moe_dense(x, w13, w2, weights, ids)


# ----------------------------------------------------------------------------- routing


def _hf_router(variant: str, **overrides):
    from transformers.models.deepseek_v2 import modeling_deepseek_v2 as v2
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as v3

    config = make_config(variant, **overrides)
    if VARIANTS[variant][0] == "v3":
        return config, v3.DeepseekV3TopkRouter(config)
    return config, v2.DeepseekV2TopkRouter(config)


@pytest.mark.parametrize("variant", ["v3", "v2-lite", "v2-group"])
@pytest.mark.parametrize("ties", ["none", "duplicate-experts", "all-equal"])
def test_routing_matches_hf_router(variant, ties):
    from tinyengine.kernels.opset import torch_ops
    from tinyengine.models.deepseek import DeepseekArgs
    from tinyengine.models.moe import TopkRouter

    config, hf = _hf_router(variant, n_routed_experts=16, num_experts_per_tok=4)
    args = DeepseekArgs(config.to_dict(), is_v3=VARIANTS[variant][0] == "v3")
    ours = TopkRouter(args.moe)
    gen = torch.Generator().manual_seed(7)
    weight = torch.randn(16, 64, generator=gen)
    x = torch.randn(50, 64, generator=gen)
    if ties == "duplicate-experts":
        weight[8:] = weight[:8]  # expert e+8 scores exactly like expert e
    elif ties == "all-equal":
        x[:25] = 0.0  # zero logits: every expert scores the same
    with torch.no_grad():
        hf.weight.copy_(weight)
        ours.weight.copy_(weight)
        if hasattr(hf, "e_score_correction_bias"):
            bias = torch.zeros(16) if ties != "none" else 0.1 * torch.randn(16, generator=gen)
            hf.e_score_correction_bias.copy_(bias)
            ours.e_score_correction_bias.copy_(bias)
        _, ref_weights, ref_ids = hf(x)
        weights, ids = ours(x, torch_ops())
    assert torch.equal(ids, ref_ids)  # same experts, same order: ties broken alike
    torch.testing.assert_close(weights, ref_weights, atol=1e-6, rtol=1e-6)


# ----------------------------------------------------------------------------- loading


def test_experts_are_stacked_from_per_expert_tensors(tiny):
    path = tiny("v3")
    model = load_tiny(path)
    experts = model.model.layers[1].mlp.experts
    inter = experts.intermediate_size
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
        assert "model.layers.1.mlp.experts.5.gate_proj.weight" in names
        for e in range(experts.num_experts):
            p = f"model.layers.1.mlp.experts.{e}"
            assert torch.equal(experts.w13_weight[e, :inter], f.get_tensor(f"{p}.gate_proj.weight"))
            assert torch.equal(experts.w13_weight[e, inter:], f.get_tensor(f"{p}.up_proj.weight"))
            assert torch.equal(experts.w2_weight[e], f.get_tensor(f"{p}.down_proj.weight"))


def test_missing_or_extra_expert_is_named(tiny, tmp_path):
    from safetensors.torch import load_file, save_file

    src = tiny("v2-lite")
    for name in ("config.json", "generation_config.json"):
        shutil.copy(src / name, tmp_path / name)
    tensors = load_file(str(src / "model.safetensors"))
    del tensors["model.layers.2.mlp.experts.3.up_proj.weight"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="lacks 1 tensor.*w13_weight"):
        load_tiny(tmp_path)
    with pytest.raises(ValueError, match="expert shard"):
        load_tiny(src, {"n_routed_experts": 4, "num_experts_per_tok": 2})


def test_truncated_proxy_reads_only_its_layers(tmp_path):
    """A sharded 3-layer checkpoint loaded as 1 layer: shards holding only
    layers 1-2 are never needed (deleting them changes nothing), and the
    result matches HF cut to 1 layer."""
    path = make_tiny_deepseek("v3", tmp_path / "ckpt", max_shard_size="60KB")
    index = json.loads((path / "model.safetensors.index.json").read_text())
    files: dict[str, set[str]] = {}
    for name, file in index["weight_map"].items():
        files.setdefault(file, set()).add(name)
    late = [f for f, names in files.items() if all(".layers.0." not in n and ".layers." in n
                                                    for n in names)]  # fmt: skip
    assert late, "the test needs shards that hold only later layers"
    ids = _tokens(12, 8)
    ref = hf_logits(path, ids, num_hidden_layers=1)
    for f in late:
        (path / f).unlink()
    with pytest.raises(ValueError, match="lacks weight file"):
        load_tiny(path)
    model = load_tiny(path, {"num_hidden_layers": 1})
    assert len(model.model.layers) == 1
    got = PagedHarness(model, block_size=4, num_blocks=8).step({0: ids})[0]
    torch.testing.assert_close(got, ref, atol=TOL, rtol=0)


def test_legacy_rope_spelling_and_head_dim_quirk(tiny, tmp_path):
    """Real DeepSeek configs say rope_scaling {"type": "yarn"} + rope_theta;
    HF's V3 writes head_dim = qk_rope_head_dim. Both must give the same model."""
    src = tiny("v3")
    config = json.loads((src / "config.json").read_text())
    assert config["head_dim"] == config["qk_rope_head_dim"]  # the quirk is there
    rope = dict(config.pop("rope_parameters"))
    config["rope_theta"] = rope.pop("rope_theta")
    rope["type"] = rope.pop("rope_type")
    config["rope_scaling"] = rope
    config["head_dim"] = 999  # must be ignored
    shutil.copy(src / "model.safetensors", tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text(json.dumps(config))
    ids = _tokens(9, 9)
    a = PagedHarness(load_tiny(src), block_size=4, num_blocks=8).step({0: ids})[0]
    b = PagedHarness(load_tiny(tmp_path), block_size=4, num_blocks=8).step({0: ids})[0]
    assert torch.equal(a, b)


def test_latent_cache_spec_and_bf16_rules(tiny):
    path = tiny("v3")
    model = load_tiny(path, dtype=torch.bfloat16)
    spec = model.kv_cache_spec()
    assert (spec.num_layers, spec.num_kv_heads, spec.head_dim_k, spec.head_dim_v) == (3, 1, 40, 0)
    assert spec.is_latent and spec.elements_per_token() == 3 * 40
    gate = model.model.layers[1].mlp.gate
    # The router decides on fp32 (as HF keeps it); the rotary table stays fp32.
    assert gate.weight.dtype == torch.float32
    assert gate.e_score_correction_bias.dtype == torch.float32
    assert model.model.rotary_emb.cos_sin_cache.dtype == torch.float32
    assert model.model.layers[0].self_attn.kv_b_proj.weight.dtype == torch.bfloat16
    ids = _tokens(10, 10)
    got = PagedHarness(model, block_size=4, num_blocks=8).step({0: ids})[0]
    assert got.dtype == torch.bfloat16  # logits stay in the model's dtype
    got = got.float()
    ref = hf_logits(path, ids)
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.8
    torch.testing.assert_close(got, ref, atol=0.15, rtol=0)


def test_config_errors_are_explained():
    from tinyengine.models.deepseek import DeepseekV3ForCausalLM

    config = make_config("v3").to_dict()
    with pytest.raises(ValueError, match="topk_group"):
        DeepseekV3ForCausalLM({**config, "topk_group": 5})
    with pytest.raises(ValueError, match="rope type"):
        DeepseekV3ForCausalLM({**config, "rope_parameters": {"rope_type": "llama3"}})
    with pytest.raises(ValueError, match="hidden_size"):
        DeepseekV3ForCausalLM({k: v for k, v in config.items() if k != "hidden_size"})
