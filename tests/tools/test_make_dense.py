"""The dense shape presets (qwen3-0.6b-shape, llama3-8b-shape): public shapes
that transformers and our models agree on tensor for tensor, real tokenizers
whose ids fit the vocab, folders that HF and tinyengine load and decode
identically, the shared writer's device option, and the presets' wiring into
TINYENGINE_MODEL and the command lines."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from tinyengine.tools import checkpoint_writer, make_dense, make_proxy
from tinyengine.tools.make_dense import PRESETS, plan_tensors, preset_config, write_dense

# Small widths, real vocab and tokenizer: a CPU-cheap stand-in for each preset.
TINY = dict(
    hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    head_dim=16, intermediate_size=128, initializer_range=0.1, max_position_embeddings=4096,
)  # fmt: skip
PROMPT = [1000, 2000, 3000, 42, 7, 99999, 128000]


@pytest.fixture(scope="module", params=sorted(PRESETS))
def tiny_dense(request, tmp_path_factory) -> tuple[str, Path]:
    name = request.param
    out = tmp_path_factory.mktemp(name) / "model"
    return name, write_dense(out, preset_config(name, **TINY), progress=False)


def test_presets_have_the_public_shapes():
    q = preset_config("qwen3-0.6b-shape")
    assert (q["hidden_size"], q["num_hidden_layers"], q["num_attention_heads"]) == (1024, 28, 16)
    assert (q["num_key_value_heads"], q["head_dim"], q["intermediate_size"]) == (8, 128, 3072)
    assert q["vocab_size"] == 151936 and q["tie_word_embeddings"] is True
    assert q["rope_parameters"]["rope_theta"] == 1e6 and q["max_position_embeddings"] == 40960
    llama = preset_config("llama3-8b-shape")
    assert (llama["hidden_size"], llama["num_hidden_layers"], llama["intermediate_size"]) == (
        4096, 32, 14336,
    )  # fmt: skip
    assert (llama["num_attention_heads"], llama["num_key_value_heads"]) == (32, 8)
    assert llama["vocab_size"] == 128256 and llama["tie_word_embeddings"] is False
    assert llama["rope_parameters"]["rope_theta"] == 500000 and llama["rms_norm_eps"] == 1e-5
    params = {n: sum(s.nbytes(1) for s in plan_tensors(preset_config(n))) for n in PRESETS}
    assert 0.59e9 < params["qwen3-0.6b-shape"] < 0.60e9  # Qwen3-0.6B: 0.6B with tied head
    assert 8.02e9 < params["llama3-8b-shape"] < 8.04e9  # Llama-3-8B: 8.03B


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_plan_matches_transformers_and_our_model(name):
    """Same names and shapes as HF's model (built on the meta device, no
    memory), and every tensor routes into one of our model's parameters."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from tinyengine.models.registry import get_model_class

    config = preset_config(name)
    plan = {s.name: s.shape for s in plan_tensors(config)}
    hf_config = AutoConfig.for_model(**{k: v for k, v in config.items() if k != "architectures"})
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(hf_config)
        ours = get_model_class(config)(config)
    hf_shapes = {n: tuple(p.shape) for n, p in hf.named_parameters()}  # tied head: listed once
    assert plan == hf_shapes
    fused = {n: tuple(p.shape) for n, p in ours.named_parameters()}
    assert fused["model.layers.0.self_attn.qkv_proj.weight"][0] == sum(
        plan[f"model.layers.0.self_attn.{x}_proj.weight"][0] for x in "qkv"
    )
    assert ("model.layers.0.self_attn.q_norm.weight" in fused) == (name == "qwen3-0.6b-shape")


def test_tiny_dense_hf_and_engine_agree(tiny_dense):
    from tests.hf_models import hf_greedy
    from tinyengine import LLM, SamplingParams

    name, folder = tiny_dense
    hf_tokens, _ = hf_greedy(folder, [PROMPT], 8)
    llm = LLM(str(folder), dtype="float32", max_model_len=128, print_startup_report=False)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": PROMPT}], params, use_tqdm=False)
    assert out[0].outputs[0].token_ids == hf_tokens[0]
    # The real tokenizer: text in, text out, every id inside the vocabulary.
    tokenizer = llm.get_tokenizer()
    assert tokenizer is not None and tokenizer.vocab_size <= PRESETS[name]["vocab_size"]
    assert max(tokenizer.eos_token_ids) < PRESETS[name]["vocab_size"]
    text = llm.generate("Hello", SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert len(text[0].outputs[0].token_ids) == 4 and text[0].outputs[0].text
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(folder))
    for sample in ("Hello world", "naïve café 日本語 🎉", "  a\n\nb"):
        assert tokenizer.encode(sample) == hf(sample)["input_ids"]
    chat = [{"role": "user", "content": "hi"}]
    assert tokenizer.apply_chat_template(chat, add_generation_prompt=True) == (
        hf.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    )


def test_tiny_dense_runs_finite_in_bf16(tiny_dense):
    from tinyengine import LLM, SamplingParams

    _, folder = tiny_dense
    llm = LLM(str(folder), dtype="bfloat16", max_model_len=128, print_startup_report=False)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=1)
    out = llm.generate([{"prompt_token_ids": PROMPT}], params, use_tqdm=False)
    for step in out[0].outputs[0].logprobs:
        assert all(torch.isfinite(torch.tensor(lp.logprob)) for lp in step.values())


def _read_all(folder: Path) -> dict[str, torch.Tensor]:
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    out = {}
    for name, file in index["weight_map"].items():
        with safe_open(str(folder / file), framework="pt") as f:
            out[name] = f.get_tensor(name)
    return out


def test_weights_are_seeded_with_sane_scales(tiny_dense, tmp_path):
    name, folder = tiny_dense
    one = _read_all(folder)
    assert ("lm_head.weight" in one) == (name == "llama3-8b-shape")
    again = write_dense(
        tmp_path / "again", preset_config(name, **TINY), shard_size=1 << 20, progress=False
    )
    assert len(list(again.glob("model-*.safetensors"))) >= 2
    many = _read_all(again)
    assert one.keys() == many.keys() and all(torch.equal(one[k], many[k]) for k in one)
    for tensor_name, x in one.items():
        assert x.dtype == torch.bfloat16 and torch.isfinite(x.float()).all()
        if tensor_name.endswith("norm.weight"):
            assert abs(x.float().mean().item() - 1.0) < 0.15
        else:
            assert abs(x.float().std().item() - TINY["initializer_range"]) < 0.02
    generation = json.loads((folder / "generation_config.json").read_text())
    assert generation["bos_token_id"] == PRESETS[name]["bos_token_id"]


def test_build_device_option(monkeypatch):
    monkeypatch.setenv(checkpoint_writer.BUILD_DEVICE_ENV, "cpu")
    assert checkpoint_writer.build_device() == "cpu"
    assert checkpoint_writer.build_device("auto") in ("cpu", "cuda")
    monkeypatch.setenv(checkpoint_writer.BUILD_DEVICE_ENV, "tpu")
    with pytest.raises(checkpoint_writer.CheckpointBuildError, match="not one of"):
        checkpoint_writer.build_device()
    if not torch.cuda.is_available():
        with pytest.raises(checkpoint_writer.CheckpointBuildError, match="no CUDA device"):
            checkpoint_writer.build_device("cuda")
    # CPU builds keep the fingerprint they had before the option; CUDA ones differ.
    name = "deepseek-v3-tiny"
    blob = json.dumps([make_proxy.BUILD_VERSION, make_proxy.PRESETS[name], None], sort_keys=True)
    old = hashlib.sha256(blob.encode()).hexdigest()[:16]
    assert make_proxy._fingerprint(name, None, "cpu") == old
    assert make_proxy._fingerprint(name, None, "cuda") != make_proxy._fingerprint(name, None, "cpu")


@pytest.mark.gpu
def test_cuda_generation_is_seeded_and_scaled():
    spec = checkpoint_writer.TensorSpec("w", (3000, 4000), "normal")
    a = checkpoint_writer.generate(spec, 0, 0.02, torch.bfloat16, "cuda")
    b = checkpoint_writer.generate(spec, 0, 0.02, torch.bfloat16, "cuda")
    assert a.device.type == "cpu" and torch.equal(a, b)
    assert abs(a.float().std().item() - 0.02) < 1e-3 and torch.isfinite(a.float()).all()


def test_presets_resolve_and_clis_reach_them(monkeypatch, tmp_path, capsys):
    from tinyengine import models_presets

    calls = []
    monkeypatch.setattr(make_dense, "ensure_preset", lambda n, cache_dir=None: calls.append(n))
    for name in PRESETS:
        assert models_presets.is_preset(name)
        models_presets.resolve_model(name)
    assert sorted(calls) == sorted(PRESETS)
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "x").write_text("x")
    for main in (make_dense.main, make_proxy.main):
        assert main(["--preset", "qwen3-0.6b-shape", "--out", str(busy)]) == 1
        assert "not empty" in capsys.readouterr().err
