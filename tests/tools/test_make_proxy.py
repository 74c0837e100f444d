"""The proxy-checkpoint maker: presets that mean what they say (real V3 dims),
folders that transformers and tinyengine both load and agree on, the real
DeepSeek tokenizer, deterministic seeded weights whatever the sharding, the
cached atomic build, and the CLI."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from tinyengine.models.deepseek import DeepseekV3ForCausalLM
from tinyengine.tools import make_proxy
from tinyengine.tools.make_proxy import (
    PRESETS,
    ensure_preset,
    plan_tensors,
    preset_config,
    write_proxy,
)


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory) -> str:
    return ensure_preset("deepseek-v3-tiny", str(tmp_path_factory.mktemp("cache")))


def _read_all(folder: Path) -> dict[str, torch.Tensor]:
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    out = {}
    for name, file in index["weight_map"].items():
        with safe_open(str(folder / file), framework="pt") as f:
            out[name] = f.get_tensor(name)
    return out


def test_v3_proxy_preset_has_real_dims():
    c = preset_config("deepseek-v3-proxy")
    real = dict(hidden_size=7168, num_attention_heads=128, q_lora_rank=1536, kv_lora_rank=512,
                qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=256,
                num_experts_per_tok=8, n_group=8, topk_group=4, moe_intermediate_size=2048,
                intermediate_size=18432, first_k_dense_replace=3, vocab_size=129280,
                num_hidden_layers=4, routed_scaling_factor=2.5)  # fmt: skip
    assert {k: c[k] for k in real} == real
    assert c["rope_parameters"]["rope_type"] == "yarn" and c["rope_parameters"]["factor"] == 40
    # Layers 0-2 dense, layer 3 MoE with per-expert tensors: 15.1B params, 30.2 GB bf16.
    specs = {s.name: s.shape for s in plan_tensors(c)}
    assert "model.layers.2.mlp.gate_proj.weight" in specs
    assert specs["model.layers.3.mlp.experts.255.down_proj.weight"] == (7168, 2048)
    assert specs["model.layers.3.mlp.gate.e_score_correction_bias"] == (256,)
    assert "model.layers.4.input_layernorm.weight" not in specs
    total = sum(s.nbytes(2) for s in plan_tensors(c))
    assert 30.0e9 < total < 30.5e9
    # Our model builds from it (on the meta device: no memory) with a latent
    # cache of 576 values per token and layer.
    with torch.device("meta"):
        model = DeepseekV3ForCausalLM(c)
    assert model.kv_cache_spec().elements_per_token() == 4 * (512 + 64)
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    assert shapes["model.layers.3.mlp.experts.w13_weight"] == (256, 4096, 7168)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets_load_in_transformers_config(name):
    from transformers import AutoConfig

    c = preset_config(name)
    hf = AutoConfig.for_model(**{k: v for k, v in c.items() if k != "architectures"})
    assert hf.qk_head_dim == c["qk_nope_head_dim"] + c["qk_rope_head_dim"]
    assert hf.num_key_value_heads == c["num_attention_heads"]


def test_tiny_preset_hf_and_engine_agree(tiny_folder):
    from tests.hf_deepseek import hf_greedy
    from tinyengine import LLM, SamplingParams
    from tinyengine.tokenizer import Tokenizer

    folder = Path(tiny_folder)
    assert len(list(folder.glob("model-*.safetensors"))) >= 1
    tokenizer = Tokenizer.from_pretrained(folder)
    prompt = tokenizer.encode("The capital of France is")
    hf_tokens, _ = hf_greedy(folder, [prompt], 8)
    llm = LLM(tiny_folder, max_model_len=128, print_startup_report=False)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    assert out[0].outputs[0].token_ids == hf_tokens[0]
    # Text in, text out, through the real DeepSeek tokenizer and chat template.
    text = llm.generate("Hello", SamplingParams(max_tokens=5, ignore_eos=True), use_tqdm=False)
    assert len(text[0].outputs[0].token_ids) == 5 and text[0].outputs[0].text
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}],
                                         add_generation_prompt=True)  # fmt: skip
    assert chat == "<｜begin▁of▁sentence｜><｜User｜>hi<｜Assistant｜>"


def test_v2_lite_tiny_matches_hf(tmp_path):
    from tests.hf_deepseek import hf_logits
    from tests.models.forward_harness import PagedHarness, load_tiny

    folder = write_proxy(tmp_path / "v2", "deepseek-v2-lite-tiny", progress=False)
    config = json.loads((folder / "config.json").read_text())
    assert config["q_lora_rank"] is None and config["topk_method"] == "greedy"
    ids = [19923, 14, 1026, 2329, 344, 129279, 0, 7]
    ref = hf_logits(folder, ids)
    got = PagedHarness(load_tiny(folder), block_size=4, num_blocks=8).step({0: ids})[0]
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=0)


def test_weights_are_seeded_and_independent_of_sharding(tiny_folder, tmp_path):
    small = write_proxy(tmp_path / "a", "deepseek-v3-tiny", shard_size=1 << 20, progress=False)
    assert len(list(small.glob("model-*.safetensors"))) >= 3
    one = _read_all(Path(tiny_folder))
    many = _read_all(small)
    assert one.keys() == many.keys()
    assert all(torch.equal(one[k], many[k]) for k in one)
    other = write_proxy(tmp_path / "b", "deepseek-v3-tiny", num_layers=1, seed=1, progress=False)
    w = "model.layers.0.self_attn.kv_b_proj.weight"
    assert not torch.equal(_read_all(other)[w], one[w])
    # Perturbed norms and correction bias, so those paths matter.
    assert one["model.norm.weight"].float().std() > 0.1
    assert one["model.layers.1.mlp.gate.e_score_correction_bias"].float().abs().max() > 0.01


def test_ensure_preset_builds_once_and_replaces_unfinished(tmp_path, monkeypatch):
    first = ensure_preset("deepseek-v3-tiny", str(tmp_path), num_layers=1)
    assert Path(first).name == "deepseek-v3-tiny-1layers"
    assert json.loads((Path(first) / make_proxy.MARKER_NAME).read_text())["preset"]

    def no_build(*args, **kwargs):
        raise AssertionError("a finished folder must not be rebuilt")

    monkeypatch.setattr(make_proxy, "write_proxy", no_build)
    assert ensure_preset("deepseek-v3-tiny", str(tmp_path), num_layers=1) == first
    monkeypatch.undo()
    # A folder without the completion marker (an interrupted build) is rebuilt.
    (Path(first) / make_proxy.MARKER_NAME).unlink()
    assert ensure_preset("deepseek-v3-tiny", str(tmp_path), num_layers=1) == first
    assert make_proxy.is_complete(first)
    assert not list(tmp_path.glob(".*building*"))  # no temp folders left behind
    with pytest.raises(make_proxy.ProxyBuildError, match="unknown preset"):
        ensure_preset("deepseek-v9", str(tmp_path))


def test_cli_writes_a_folder(tmp_path, capsys):
    out = tmp_path / "cli"
    code = make_proxy.main(["--preset", "deepseek-v3-tiny", "--out", str(out), "--layers", "1"])
    assert code == 0 and capsys.readouterr().out.strip() == str(out)
    config = json.loads((out / "config.json").read_text())
    assert config["num_hidden_layers"] == 1 and config["architectures"] == ["DeepseekV3ForCausalLM"]
    assert (out / "tokenizer.json").is_file() and (out / "generation_config.json").is_file()
    assert make_proxy.main(["--preset", "deepseek-v3-tiny", "--out", str(out)]) == 1  # not empty


def test_cli_sets_width_and_checks_its_flags(tmp_path, capsys):
    out = tmp_path / "wide"
    wide = '{"hidden_size": 96, "n_routed_experts": 16}'
    code = make_proxy.main(["--preset", "deepseek-v3-tiny", "--out", str(out), "--seed", "3",
                            "--hf-overrides", wide])  # fmt: skip
    assert code == 0
    config = json.loads((out / "config.json").read_text())
    assert config["hidden_size"] == 96 and config["n_routed_experts"] == 16
    weights = _read_all(out)
    assert weights["model.embed_tokens.weight"].shape[1] == 96
    assert weights["model.layers.1.mlp.gate.weight"].shape == (16, 96)
    for argv in (["--seed", "3"], ["--hf-overrides", "{}"]):  # the cache holds presets as named
        with pytest.raises(SystemExit):
            make_proxy.main(["--preset", "deepseek-v3-tiny", "--cache-dir", str(tmp_path), *argv])
        assert "needs --out" in capsys.readouterr().err
    for bad in ("{not json", "[1, 2]"):
        with pytest.raises(SystemExit):
            make_proxy.main(["--preset", "deepseek-v3-tiny", "--out", str(tmp_path / "x"),
                             "--hf-overrides", bad])  # fmt: skip
        assert "--hf-overrides" in capsys.readouterr().err
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    assert make_proxy.main(["--preset", "deepseek-v3-tiny", "--out", str(a_file)]) == 1
    assert "is not a folder" in capsys.readouterr().err


def test_interrupted_write_leaves_nothing_behind(tmp_path, monkeypatch):
    from tinyengine.tools import checkpoint_writer

    real_save = checkpoint_writer.save_file
    calls = []

    def save_then_die(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt  # e.g. Ctrl-C after the first shard
        real_save(*args, **kwargs)

    monkeypatch.setattr(checkpoint_writer, "save_file", save_then_die)
    out = tmp_path / "out"
    out.mkdir()  # an empty folder given as --out is fine
    with pytest.raises(KeyboardInterrupt):
        write_proxy(out, "deepseek-v3-tiny", shard_size=1 << 20, progress=False)
    assert out.is_dir() and not any(out.iterdir())  # nothing half-written at the target
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # no temporary folder left
    monkeypatch.undo()
    folder = write_proxy(out, "deepseek-v3-tiny", shard_size=1 << 20, progress=False)
    assert {"config.json", "model.safetensors.index.json"} <= {p.name for p in folder.iterdir()}


def test_v2_lite_tiny_is_a_model_preset(tmp_path):
    from tinyengine.models_presets import PRESETS as MODEL_PRESETS
    from tinyengine.models_presets import resolve_model

    assert "deepseek-v2-lite-tiny" in MODEL_PRESETS
    folder = resolve_model("deepseek-v2-lite-tiny", cache_dir=str(tmp_path))
    config = json.loads((Path(folder) / "config.json").read_text())
    assert config["architectures"] == ["DeepseekV2ForCausalLM"] and make_proxy.is_complete(folder)


def test_truncated_load_reads_only_leading_shards(tmp_path):
    """Non-layer tensors first, then layer by layer: a proxy loaded with fewer
    layers never needs the shards of the dropped ones."""
    from tests.models.forward_harness import load_tiny

    folder = write_proxy(tmp_path / "p", "deepseek-v3-tiny", shard_size=64 << 10, progress=False)
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    files: dict[str, set[str]] = {}
    for name, file in index["weight_map"].items():
        files.setdefault(file, set()).add(name)
    order = sorted(files)
    late = [f for f in order if all(n.startswith("model.layers.1.") for n in files[f])]
    assert late and late == order[-len(late) :]  # layer 1 lives in the trailing shards
    for f in late:
        (folder / f).unlink()
    model = load_tiny(folder, {"num_hidden_layers": 1})
    assert len(model.model.layers) == 1 and not model.model.layers[0].is_moe
