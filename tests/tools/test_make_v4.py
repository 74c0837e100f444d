"""The DeepSeek-V4 presets and load_format="dummy".

- deepseek-v4-tiny is a real checkpoint folder: transformers loads it (names
  in its V4 spelling, a hash table of distinct expert ids) and its logits
  equal tinyengine's; the engine chats with it through the real DeepSeek
  tokenizer.
- deepseek-v4-flash-proxy is config + tokenizer + the dummy-weight marker,
  with V4-Flash's shapes and a 4-layer schedule (sliding, sliding, CSA, HCA).
- load_format="dummy" builds any architecture without reading weights,
  deterministically; a folder without weights and without the marker is an
  error that names the option.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from tests.hf_deepseek import hf_logits
from tests.models.forward_harness import PagedHarness, load_tiny
from tinyengine import LLM, SamplingParams
from tinyengine.models.dummy_weights import DUMMY_MARKER
from tinyengine.tools.make_v4 import plan_tensors, preset_config, write_v4


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_v4(tmp_path_factory.mktemp("v4") / "tiny", "deepseek-v4-tiny", progress=False)


def test_tiny_preset_loads_in_transformers_and_matches(tiny):
    from safetensors import safe_open

    with safe_open(str(next(tiny.glob("*.safetensors"))), "pt") as f:
        table = f.get_tensor("model.layers.0.ffn.gate.tid2eid")
    assert table.dtype == torch.int64 and table.shape == (129280, 2)
    assert (table[:, 0] != table[:, 1]).all() and table.min() >= 0 and table.max() < 8
    ids = list(range(1000, 1070))  # crosses the 16-token window and HCA ratio 4 times
    ref = hf_logits(tiny, ids)
    harness = PagedHarness(load_tiny(tiny), block_size=16, num_blocks=16)
    torch.testing.assert_close(harness.step({0: ids})[0], ref, atol=1e-4, rtol=0)


def test_tiny_preset_chats_with_the_real_tokenizer(tiny):
    llm = LLM(str(tiny), print_startup_report=False)
    messages = [[{"role": "user", "content": "Hello, who are you?"}]]
    out = llm.chat(messages, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 12 and out[0].outputs[0].text
    assert out[0].prompt == (
        "<｜begin▁of▁sentence｜><｜User｜>Hello, who are you?<｜Assistant｜></think>"
    )
    assert out[0].prompt_token_ids[0] == 0  # the BOS id


def test_flash_proxy_is_a_dummy_weight_folder(tmp_path):
    folder = write_v4(tmp_path / "flash", "deepseek-v4-flash-proxy", progress=False)
    assert (folder / DUMMY_MARKER).is_file() and not list(folder.glob("*.safetensors"))
    config = json.loads((folder / "config.json").read_text())
    assert config["layer_types"] == ["sliding_attention", "sliding_attention",
                                     "compressed_sparse_attention",
                                     "heavily_compressed_attention"]  # fmt: skip
    assert config["mlp_layer_types"] == ["hash_moe"] * 3 + ["moe"]
    assert (config["hidden_size"], config["num_attention_heads"], config["head_dim"]) == (
        4096, 64, 512)  # fmt: skip
    # What a checkpoint of it would hold: ~4 x 13 GB of experts, bf16.
    total = sum(s.nbytes(2) for s in plan_tensors(config))
    assert 50e9 < total < 60e9


def test_dummy_load_format_reads_no_weights(tiny, tmp_path):
    folder = tmp_path / "no-weights"
    folder.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(tiny / name, folder / name)
    with pytest.raises(ValueError, match="load_format='dummy'"):
        LLM(str(folder), print_startup_report=False)
    prompts = [{"prompt_token_ids": list(range(5, 40))}]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    runs = []
    for _ in range(2):
        llm = LLM(str(folder), load_format="dummy", print_startup_report=False)
        runs.append(llm.generate(prompts, params, use_tqdm=False)[0].outputs[0].token_ids)
        del llm
    assert runs[0] == runs[1] and len(runs[0]) == 8
    # The marker makes "auto" mean dummy.
    (folder / DUMMY_MARKER).write_text("")
    llm = LLM(str(folder), print_startup_report=False)
    assert llm.generate(prompts, params, use_tqdm=False)[0].outputs[0].token_ids == runs[0]


def test_dummy_weights_for_a_llama(tmp_path):
    """Every architecture: norms 1, matrices normal(0, initializer_range)."""
    from tests.hf_models import make_tiny_hf_model

    path = make_tiny_hf_model("llama", tmp_path / "llama", num_hidden_layers=2)
    model = load_tiny(path)
    from tinyengine.models.loader import load_hf_config, load_model

    dummy = load_model(str(path), load_hf_config(str(path)), torch.float32, "cpu", "dummy")
    params = dict(dummy.named_parameters())
    assert torch.all(params["model.norm.weight"] == 1)
    weight = params["model.layers.0.mlp.down_proj.weight"]
    assert 0.01 < weight.std().item() < 0.2 and weight.abs().sum() > 0
    assert not torch.equal(
        weight, dict(model.named_parameters())["model.layers.0.mlp.down_proj.weight"]
    )


def test_preset_config_rejects_unknown_names():
    from tinyengine.tools.checkpoint_writer import CheckpointBuildError

    with pytest.raises(CheckpointBuildError, match="deepseek-v4-tiny"):
        preset_config("deepseek-v5")
