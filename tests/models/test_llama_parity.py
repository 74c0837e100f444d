"""The Llama family (Llama, Qwen2 with tied embeddings, Qwen3 with q/k norm,
Llama with llama3 RoPE scaling) against HF transformers in fp32: one-shot
prefill, prefill + paged decode, chunked prefill mixed with decodes in one
batch, padded batches, greedy generation and layer truncation."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tests.hf_models import (
    LLAMA3_ROPE,
    TINY_VARIANTS,
    YARN_ROPE,
    hf_greedy,
    hf_logits,
    make_tiny_hf_model,
)
from tests.models.forward_harness import PagedHarness, load_tiny

ATOL = 1e-4  # fp32 end to end; the differences are summation order only


def prompt(length: int = 20, seed: int = 0) -> list[int]:
    return torch.randint(1, 512, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a - b).abs().max().item()


@pytest.mark.parametrize("variant", list(TINY_VARIANTS))
def test_prefill_logits_match_hf(variant: str, tiny_model_dir: Callable[[str], Path]) -> None:
    path = tiny_model_dir(variant)
    model = load_tiny(path)
    tokens = prompt()
    ours = PagedHarness(model).step({0: tokens})[0]
    ref = hf_logits(path, tokens)
    assert ours.dtype == torch.float32 and ours.shape == (len(tokens), 512)
    assert max_diff(ours[-1], ref[-1]) <= ATOL  # the row the sampler uses
    assert max_diff(ours, ref) <= ATOL  # every position, i.e. every causal prefix
    # Sanity: the model is not degenerate (logits far from uniform).
    assert ref.std() > 0.3


@pytest.mark.parametrize("variant", list(TINY_VARIANTS))
def test_prefill_then_decode_matches_hf(
    variant: str, tiny_model_dir: Callable[[str], Path]
) -> None:
    path = tiny_model_dir(variant)
    harness = PagedHarness(load_tiny(path), block_size=16)
    tokens = prompt(31)  # the decode token lands at position 31: last slot of block 2
    first = harness.step({0: tokens})[0]
    next_token = int(first[-1].argmax())
    decoded = harness.step({0: [next_token]})[0]
    ref = hf_logits(path, tokens + [next_token])
    assert max_diff(decoded[0], ref[-1]) <= ATOL


def test_chunked_prefill_mixed_with_decodes(tiny_model_dir: Callable[[str], Path]) -> None:
    """One batch holds a prefill chunk after a cached prefix, a fresh prompt,
    a decode row and padding rows; every row must match HF."""
    path = tiny_model_dir("qwen3")
    harness = PagedHarness(load_tiny(path), block_size=16, num_blocks=40)
    a, b, c = prompt(30, seed=1), prompt(11, seed=2), prompt(18, seed=3)

    harness.step({0: a[:7], 2: c[:-1]})
    out = harness.step({0: a[7:], 1: b, 2: c[-1:]}, num_padding=3)

    assert max_diff(out[0], hf_logits(path, a)[7:]) <= ATOL
    assert max_diff(out[1], hf_logits(path, b)) <= ATOL
    assert max_diff(out[2], hf_logits(path, c)[-1:]) <= ATOL


@pytest.mark.parametrize("variant", ["llama", "qwen2-tied"])
def test_greedy_generation_matches_hf(variant: str, tiny_model_dir: Callable[[str], Path]) -> None:
    path = tiny_model_dir(variant)
    prompts = [prompt(12, seed=4), prompt(5, seed=5)]
    ref_tokens, ref_logits = hf_greedy(path, prompts, max_new_tokens=8)

    harness = PagedHarness(load_tiny(path), block_size=16)
    generated: dict[int, list[int]] = {0: [], 1: []}
    step_logits: dict[int, list[torch.Tensor]] = {0: [], 1: []}
    pending = {i: p for i, p in enumerate(prompts)}
    for _ in range(8):
        out = harness.step(pending)
        pending = {}
        for seq_id, logits in out.items():
            step_logits[seq_id].append(logits[-1])
            token = int(logits[-1].argmax())
            generated[seq_id].append(token)
            pending[seq_id] = [token]

    assert [generated[0], generated[1]] == ref_tokens
    for seq_id in (0, 1):
        for ours, ref in zip(step_logits[seq_id], ref_logits[seq_id], strict=True):
            assert max_diff(ours, ref) <= ATOL


def test_hf_greedy_ignores_eos(tmp_path: Path) -> None:
    """hf_greedy must produce max_new_tokens even when EOS is the argmax."""
    path = make_tiny_hf_model("llama", tmp_path / "a")
    tokens, _ = hf_greedy(path, [prompt(6)], max_new_tokens=5)
    eos_path = make_tiny_hf_model("llama", tmp_path / "b", eos_token_id=tokens[0][0])
    eos_tokens, eos_logits = hf_greedy(eos_path, [prompt(6)], max_new_tokens=5)
    assert eos_tokens == tokens and len(eos_logits[0]) == 5


@pytest.mark.parametrize("variant", ["llama", "qwen3"])
def test_truncated_model_matches_truncated_hf(
    variant: str, tiny_model_dir: Callable[[str], Path]
) -> None:
    path = tiny_model_dir(variant)
    model = load_tiny(path, hf_overrides={"num_hidden_layers": 2})
    assert model.num_attention_layers == 2 and len(model.model.layers) == 2
    tokens = prompt()
    ours = PagedHarness(model).step({0: tokens})[0]
    ref = hf_logits(path, tokens, num_hidden_layers=2)
    assert max_diff(ours, ref) <= ATOL
    assert max_diff(ours, hf_logits(path, tokens)) > 1e-2  # truncation really changed it


def test_rope_scaling_changes_the_output(tiny_model_dir: Callable[[str], Path]) -> None:
    """The two llama variants share weights (same seed); only RoPE differs,
    so equal logits would mean the llama3 scaling was silently ignored."""
    tokens = prompt(60)  # long enough for the scaled low frequencies to matter
    plain = PagedHarness(load_tiny(tiny_model_dir("llama"))).step({0: tokens})[0]
    scaled = PagedHarness(load_tiny(tiny_model_dir("llama-rope-llama3"))).step({0: tokens})[0]
    assert max_diff(plain, scaled) > 1e-3


def test_bfloat16_model_is_close_to_fp32(tiny_model_dir: Callable[[str], Path]) -> None:
    path = tiny_model_dir("qwen3")
    tokens = prompt()
    ref = PagedHarness(load_tiny(path)).step({0: tokens})[0]
    model = load_tiny(path, dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    ours = PagedHarness(model).step({0: tokens})[0]
    assert ours.dtype == torch.bfloat16  # logits stay in the model's dtype
    assert max_diff(ours.float(), ref) < 0.25 * ref.abs().max().item()


def _edit_config(path: Path, edit: Callable[[dict], None]) -> None:
    config_file = path / "config.json"
    config = json.loads(config_file.read_text())
    edit(config)
    config_file.write_text(json.dumps(config))


@pytest.mark.parametrize("rope", ["llama3", "yarn"])
def test_top_level_original_context_wins_as_in_hf(rope: str, tmp_path: Path) -> None:
    """A legacy rope_scaling dict without original_max_position_embeddings,
    and that key at the top level of config.json (Phi-3's spelling): HF takes
    the top-level value, not max_position_embeddings (256 here)."""
    params = dict(LLAMA3_ROPE if rope == "llama3" else YARN_ROPE)
    path = make_tiny_hf_model("llama", tmp_path, rope_parameters=params)

    def legacy(config: dict) -> None:
        scaling = {k: v for k, v in config.pop("rope_parameters").items()
                   if k not in ("original_max_position_embeddings", "rope_theta")}  # fmt: skip
        config.update(rope_scaling=scaling, rope_theta=10000.0)
        config["original_max_position_embeddings"] = 32

    _edit_config(path, legacy)
    tokens = prompt(70)
    ours = PagedHarness(load_tiny(path), num_blocks=16).step({0: tokens})[0]
    assert max_diff(ours, hf_logits(path, tokens)) <= ATOL


def test_qwen3_without_head_dim_takes_its_default(tmp_path: Path) -> None:
    """Qwen3Config's head_dim is 128 when config.json omits it (Llama's is
    hidden_size // heads, 16 for these tiny widths)."""
    path = make_tiny_hf_model("qwen3", tmp_path, head_dim=128)
    _edit_config(path, lambda config: config.pop("head_dim"))
    tokens = prompt(20)
    ours = PagedHarness(load_tiny(path)).step({0: tokens})[0]
    assert max_diff(ours, hf_logits(path, tokens)) <= ATOL


def test_legacy_rope_scaling_beside_rope_parameters_wins(tmp_path: Path) -> None:
    """config.json as transformers 5 saves it (rope_parameters: default RoPE)
    with YaRN added in the legacy spelling: transformers takes rope_scaling
    whole, so must the engine."""
    path = make_tiny_hf_model("llama", tmp_path)

    def add_yarn(config: dict) -> None:
        assert config["rope_parameters"]["rope_type"] == "default"
        config["rope_scaling"] = {"type": "yarn", "factor": 4.0,
                                  "original_max_position_embeddings": 32}  # fmt: skip

    _edit_config(path, add_yarn)
    tokens = prompt(70)
    ours = PagedHarness(load_tiny(path), num_blocks=16).step({0: tokens})[0]
    assert max_diff(ours, hf_logits(path, tokens)) <= ATOL
