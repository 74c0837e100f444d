"""tinyengine/models/loader.py: config + overrides, sharded checkpoints, layer truncation
that never reads dropped layers, and the errors a user sees for incomplete,
mismatched or pickle checkpoints."""

from __future__ import annotations

import json
import re
import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import tinyengine.models.loader as loader
from tests.hf_models import hf_logits, make_tiny_hf_model
from tests.models.forward_harness import PagedHarness, load_tiny
from tinyengine.models.loader import load_hf_config
from tinyengine.models.registry import get_model_class, supported_architectures

_LAYER = re.compile(r"\.layers\.(\d+)\.")


def layer_of(name: str) -> int | None:
    match = _LAYER.search(name)
    return int(match.group(1)) if match else None


def rewrite_checkpoint(path: Path, edit) -> None:
    """Apply `edit(dict of tensors)` to a single-file checkpoint in place."""
    tensors = load_file(path / "model.safetensors")
    edit(tensors)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})


@pytest.fixture
def record_reads(monkeypatch: pytest.MonkeyPatch) -> dict[str, list[str]]:
    """Wrap the loader's safe_open: file name -> tensor names actually read."""
    reads: dict[str, list[str]] = {}
    real_safe_open = loader.safe_open

    class Recording:
        def __init__(self, filename: str, *args, **kwargs) -> None:
            self.name = Path(filename).name
            self.handle = real_safe_open(filename, *args, **kwargs)
            reads.setdefault(self.name, [])

        def __enter__(self) -> Recording:
            self.handle.__enter__()
            return self

        def __exit__(self, *exc) -> None:
            self.handle.__exit__(*exc)

        def keys(self) -> list[str]:
            return list(self.handle.keys())

        def get_tensor(self, name: str) -> torch.Tensor:
            reads[self.name].append(name)
            return self.handle.get_tensor(name)

    monkeypatch.setattr(loader, "safe_open", Recording)
    return reads


# --- config ---------------------------------------------------------------


def test_config_missing_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="has no config.json"):
        load_hf_config(str(tmp_path))
    with pytest.raises(ValueError, match="is not a folder"):
        load_hf_config(str(tmp_path / "nope"))


def test_layer_count_below_one_is_a_clear_error(tmp_path: Path) -> None:
    # A bad layer count must fail at config time, naming its source, not deep
    # in the first forward ("too many values to unpack") or a zeros() call.
    path = make_tiny_hf_model("llama", tmp_path)
    for bad in (0, -1, 1.5, True, "2"):
        with pytest.raises(ValueError, match=r"num_hidden_layers .*hf_overrides"):
            load_hf_config(str(path), {"num_hidden_layers": bad})
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(dict(config, num_hidden_layers=0)))
    with pytest.raises(ValueError, match=r"num_hidden_layers .*config.json"):
        load_hf_config(str(path))


def test_hf_overrides_are_merged_before_building(tmp_path: Path) -> None:
    path = make_tiny_hf_model("llama", tmp_path)
    config = load_hf_config(str(path), {"num_hidden_layers": 1, "rms_norm_eps": 1e-3})
    assert config["num_hidden_layers"] == 1 and config["rms_norm_eps"] == 1e-3
    assert config["hidden_size"] == 64  # the rest is config.json's
    assert json.loads((path / "config.json").read_text())["num_hidden_layers"] == 4
    model = load_tiny(path, {"num_hidden_layers": 1, "rms_norm_eps": 1e-3})
    assert len(model.model.layers) == 1 and model.model.norm.eps == 1e-3


# --- files ----------------------------------------------------------------


def test_sharded_checkpoint_loads_like_the_single_file(tmp_path: Path) -> None:
    single = make_tiny_hf_model("qwen3", tmp_path / "single")
    sharded = make_tiny_hf_model("qwen3", tmp_path / "sharded", max_shard_size="40KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    assert len(list(sharded.glob("*.safetensors"))) > 3
    a = load_tiny(single).state_dict()
    b = load_tiny(sharded).state_dict()
    assert a.keys() == b.keys()
    assert all(torch.equal(a[name], b[name]) for name in a)


def test_several_files_without_an_index(tmp_path: Path) -> None:
    path = make_tiny_hf_model("llama", tmp_path / "m")
    reference = load_tiny(path).state_dict()
    tensors = load_file(path / "model.safetensors")
    (path / "model.safetensors").unlink()
    names = sorted(tensors)
    save_file({n: tensors[n] for n in names[::2]}, path / "a.safetensors")
    save_file({n: tensors[n] for n in names[1::2]}, path / "b.safetensors")
    loaded = load_tiny(path).state_dict()
    assert all(torch.equal(reference[name], loaded[name]) for name in reference)


def test_truncation_never_reads_dropped_layers_sharded(
    tmp_path: Path, record_reads: dict[str, list[str]]
) -> None:
    path = make_tiny_hf_model("qwen2", tmp_path, max_shard_size="40KB")
    weight_map = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    files: dict[str, list[str]] = {}
    for name, file in weight_map.items():
        files.setdefault(file, []).append(name)
    # Shards holding only layers >= 2 are deleted: opening one would fail.
    dropped = [f for f, names in files.items() if all((layer_of(n) or 0) >= 2 for n in names)]
    assert len(dropped) >= 2
    for file in dropped:
        (path / file).unlink()

    model = load_tiny(path, {"num_hidden_layers": 2})

    read = [name for names in record_reads.values() for name in names]
    assert all((layer_of(n) or 0) < 2 for n in read)
    # Every kept tensor was read once (nothing silently skipped).
    kept = {n for n in weight_map if (layer_of(n) or 0) < 2}
    assert sorted(read) == sorted(kept)
    assert set(record_reads) == {f for f, names in files.items() if set(names) & kept}
    assert model.num_attention_layers == 2


def test_truncation_never_reads_dropped_layers_single_file(
    tmp_path: Path, record_reads: dict[str, list[str]]
) -> None:
    path = make_tiny_hf_model("llama", tmp_path)
    load_tiny(path, {"num_hidden_layers": 1})
    read = record_reads["model.safetensors"]
    assert read and all((layer_of(n) or 0) < 1 for n in read)


def test_missing_shard_file_is_named(tmp_path: Path) -> None:
    path = make_tiny_hf_model("llama", tmp_path, max_shard_size="40KB")
    victim = sorted(path.glob("model-*.safetensors"))[1]
    victim.unlink()
    with pytest.raises(ValueError, match=f"lacks weight file.*{victim.name}"):
        load_tiny(path)


# --- names ----------------------------------------------------------------


def test_missing_tensor_is_named(tmp_path: Path) -> None:
    path = make_tiny_hf_model("llama", tmp_path)
    rewrite_checkpoint(path, lambda t: t.pop("model.layers.1.self_attn.k_proj.weight"))
    with pytest.raises(ValueError, match=r"lacks 1 tensor.*model\.layers\.1\.self_attn\.k_proj"):
        load_tiny(path)


def test_many_missing_tensors_are_counted_and_truncated(tmp_path: Path) -> None:
    path = make_tiny_hf_model("llama", tmp_path)

    def drop_last_two_layers(tensors: dict[str, torch.Tensor]) -> None:
        for name in [n for n in tensors if (layer_of(n) or 0) >= 2]:
            del tensors[name]

    rewrite_checkpoint(path, drop_last_two_layers)
    with pytest.raises(ValueError, match=r"lacks 18 tensor\(s\).*and 8 more"):
        load_tiny(path)
    load_tiny(path, {"num_hidden_layers": 2})  # ...but a 2-layer proxy is complete


def test_unexpected_tensor_is_named(tmp_path: Path) -> None:
    path = make_tiny_hf_model("llama", tmp_path)
    rewrite_checkpoint(
        path, lambda t: t.update({"model.layers.0.self_attn.mystery.weight": torch.zeros(2)})
    )
    with pytest.raises(ValueError, match=r"1 tensor.*model\.layers\.0\.self_attn\.mystery"):
        load_tiny(path)


def test_quantized_checkpoint_names_its_quantization(tmp_path: Path) -> None:
    # An FP8 checkpoint's scales are tensors no parameter takes: the error
    # says the checkpoint is quantized, not only which tensors are left over.
    path = make_tiny_hf_model("llama", tmp_path)
    scale = "model.layers.0.mlp.down_proj.weight_scale_inv"
    rewrite_checkpoint(path, lambda t: t.update({scale: torch.ones(1, 1)}))
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3"}
    (path / "config.json").write_text(json.dumps(config))
    refused = r"quant_method 'fp8'\) are not supported.*weight_scale_inv"
    with pytest.raises(ValueError, match=refused):
        load_tiny(path)


def test_shape_mismatch_names_the_tensor(tmp_path: Path) -> None:
    path = make_tiny_hf_model("llama", tmp_path)
    rewrite_checkpoint(
        path, lambda t: t.update({"model.layers.0.mlp.up_proj.weight": torch.zeros(128, 32)})
    )
    with pytest.raises(ValueError, match=r"up_proj\.weight.*shape mismatch"):
        load_tiny(path)


def test_tied_head_ignores_a_saved_copy_and_inv_freq(tmp_path: Path) -> None:
    path = make_tiny_hf_model("qwen2", tmp_path)  # tie_word_embeddings=True
    reference = load_tiny(path)

    def add_copy(tensors: dict[str, torch.Tensor]) -> None:
        assert "lm_head.weight" not in tensors  # HF does not save the tied copy
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
        tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)

    rewrite_checkpoint(path, add_copy)
    model = load_tiny(path)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert torch.equal(model.lm_head.weight, reference.lm_head.weight)


def test_tied_config_with_a_different_saved_head_loads_untied_as_hf(tmp_path: Path) -> None:
    """transformers unties a tied model whose checkpoint stores an LM head of
    other values (and uses it); the engine's logits follow."""
    path = make_tiny_hf_model("qwen2", tmp_path)  # tie_word_embeddings=True

    def add_head(tensors: dict[str, torch.Tensor]) -> None:
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"] * 0.5 + 0.01

    rewrite_checkpoint(path, add_head)
    model = load_tiny(path)
    assert model.lm_head.weight is not model.model.embed_tokens.weight
    saved = load_file(path / "model.safetensors")
    assert torch.equal(model.lm_head.weight, saved["lm_head.weight"])
    assert torch.equal(model.model.embed_tokens.weight, saved["model.embed_tokens.weight"])
    ids = [5, 9, 11, 3, 200, 17]
    got = PagedHarness(model, block_size=8, num_blocks=4).step({0: ids})[0]
    torch.testing.assert_close(got, hf_logits(path, ids), atol=1e-4, rtol=0)


def test_untied_head_is_loaded_separately(tmp_path: Path) -> None:
    path = make_tiny_hf_model("llama", tmp_path)
    model = load_tiny(path)
    assert model.lm_head.weight is not model.model.embed_tokens.weight
    saved = load_file(path / "model.safetensors")
    assert torch.equal(model.lm_head.weight, saved["lm_head.weight"])
    # The fused q/k/v rows are the three checkpoint tensors stacked in order.
    qkv = model.model.layers[0].self_attn.qkv_proj.weight
    parts = [saved[f"model.layers.0.self_attn.{p}_proj.weight"] for p in "qkv"]
    assert torch.equal(qkv, torch.cat(parts))


# --- refusals -------------------------------------------------------------


def test_pickle_only_folder_is_refused(tmp_path: Path) -> None:
    path = make_tiny_hf_model("llama", tmp_path)
    torch.save(load_file(path / "model.safetensors"), path / "pytorch_model.bin")
    (path / "model.safetensors").unlink()
    with pytest.raises(ValueError, match="pickle checkpoints are refused.*safetensors"):
        load_tiny(path)


def test_folder_without_weights(tmp_path: Path) -> None:
    path = make_tiny_hf_model("llama", tmp_path)
    (path / "model.safetensors").unlink()
    with pytest.raises(ValueError, match=r"no \*\.safetensors weights"):
        load_tiny(path)


def test_unsupported_config_leaves_default_dtype_alone(tmp_path: Path) -> None:
    path = make_tiny_hf_model("llama", tmp_path)
    with pytest.raises(ValueError, match="hidden_act"):
        load_tiny(path, {"hidden_act": "gelu"}, dtype=torch.bfloat16)
    assert torch.get_default_dtype() == torch.float32


def test_registry() -> None:
    assert {"LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"} <= set(
        supported_architectures()
    )
    with pytest.raises(ValueError, match="'GPT2LMHeadModel' is not supported.*LlamaForCausalLM"):
        get_model_class({"architectures": ["GPT2LMHeadModel"]})
    with pytest.raises(ValueError, match="no 'architectures'"):
        get_model_class({})


# --- reading on threads -----------------------------------------------------


def _load(path: Path, threads: int, device: str = "cpu") -> torch.nn.Module:
    hf_config = load_hf_config(str(path))
    return loader.load_model(str(path), hf_config, torch.float32, device, threads=threads)


@pytest.fixture
def reader_threads(monkeypatch: pytest.MonkeyPatch) -> set[str]:
    """The names of the threads that ran the loader's pieces."""
    names: set[str] = set()
    real_load_piece = loader._load_piece

    def recording(*args, **kwargs) -> None:
        names.add(threading.current_thread().name)
        real_load_piece(*args, **kwargs)

    monkeypatch.setattr(loader, "_load_piece", recording)
    return names


def test_threads_load_what_one_thread_loads(tmp_path: Path, reader_threads: set[str]) -> None:
    names = reader_threads
    path = make_tiny_hf_model("qwen3", tmp_path, max_shard_size="40KB")
    threaded = _load(path, threads=8).state_dict()
    assert len(names) > 1 and all(n.startswith("load-weights") for n in names)

    names.clear()
    single = _load(path, threads=1).state_dict()
    assert len(names) == 1
    assert threaded.keys() == single.keys()
    assert all(torch.equal(threaded[name], single[name]) for name in single)


def test_load_under_inference_mode(tmp_path: Path) -> None:
    # The worker threads must copy in the caller's mode: parameters built
    # under inference mode refuse in-place copies from outside it.
    path = make_tiny_hf_model("llama", tmp_path)
    reference = load_tiny(path).state_dict()
    with torch.inference_mode():
        model = _load(path, threads=8)
    assert all(p.is_inference() for p in model.parameters())
    loaded = model.state_dict()
    assert all(torch.equal(reference[name], loaded[name]) for name in reference)


def test_an_error_on_a_thread_stops_the_load(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = make_tiny_hf_model("llama", tmp_path, max_shard_size="40KB")
    started: list[str] = []
    real_load_piece = loader._load_piece

    def failing(path, *args) -> None:
        started.append(path)
        if len(started) == 1:
            raise RuntimeError("disk read failed")
        real_load_piece(path, *args)

    monkeypatch.setattr(loader, "_load_piece", failing)
    with pytest.raises(RuntimeError, match="disk read failed"):
        _load(path, threads=1)
    # One thread: the pieces queued behind the failed one never ran.
    assert len(started) == 1


def test_engine_reads_on_its_configured_threads(tmp_path: Path, reader_threads: set[str]) -> None:
    from tinyengine.llm import LLM

    names = reader_threads
    path = make_tiny_hf_model("llama", tmp_path)
    kwargs = {"dtype": "float32", "max_model_len": 64, "print_startup_report": False}
    LLM(str(path), load_threads=1, **kwargs).shutdown()
    assert len(names) == 1
    names.clear()
    LLM(str(path), load_threads=3, **kwargs).shutdown()
    assert 1 < len(names) <= 3


@pytest.mark.gpu
def test_threads_load_onto_the_gpu_what_the_cpu_loads(tmp_path: Path) -> None:
    path = make_tiny_hf_model("qwen3", tmp_path, max_shard_size="40KB")
    on_cpu = load_tiny(path).state_dict()
    on_gpu = _load(path, threads=8, device="cuda").state_dict()
    assert all(on_gpu[name].is_cuda for name in on_gpu)
    assert all(torch.equal(on_cpu[name], on_gpu[name].cpu()) for name in on_cpu)
