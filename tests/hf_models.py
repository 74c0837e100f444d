"""Tiny random Hugging Face models and HF reference outputs, for tests.

Owns how the test suite makes model folders (config.json + safetensors, as
`save_pretrained` writes them) and runs HF transformers as the reference.
Plain functions, no pytest fixtures, so any test layer can import them
(`from tests.hf_models import ...`, run from the repo root).
Must never be imported by the engine itself: transformers is a test-only
dependency.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

# A llama3 rope variant for overrides: make_tiny_hf_model("llama", p,
# rope_parameters=LLAMA3_ROPE). The small original context (64) puts the
# tiny model's frequencies in all three bands (kept, blended, scaled).
LLAMA3_ROPE: dict[str, Any] = {
    "rope_type": "llama3",
    "rope_theta": 10000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}

# YaRN (Qwen's long-context setting): a 4x stretch of a 128-token original
# context, so the tiny model's dims span the kept, blended and interpolated
# bands, and cos/sin carry the 1.14 attention factor.
YARN_ROPE: dict[str, Any] = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 128,
}

_TINY: dict[str, Any] = dict(
    hidden_size=64,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,  # GQA: 2 query heads per KV head
    head_dim=16,
    vocab_size=512,
    intermediate_size=128,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    # Larger than HF's 0.02 so logits are far from uniform and argmax is stable.
    initializer_range=0.08,
)

ARCHS = ("llama", "qwen2", "qwen3")

# The parity suites' piecewise-graph configuration (the CPU stand-in for
# graphs): 48-token chunks, so prefills chunk and mix with decodes, and
# decode batches past 2 rows replay piecewise chains too.
PIECEWISE_CONFIG = {
    "graph_backend": "recording",
    "cudagraph_mode": "full_and_piecewise",
    "max_num_batched_tokens": 48,
    "cuda_graph_sizes": [1, 2],
}

# Named variants the test suite covers: name -> (arch, config overrides).
TINY_VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("llama", {}),
    "llama-rope-llama3": ("llama", {"rope_parameters": LLAMA3_ROPE}),
    "qwen2-tied": ("qwen2", {}),
    "qwen3": ("qwen3", {}),
    "qwen3-rope-yarn": ("qwen3", {"rope_parameters": YARN_ROPE}),
    # One KV head, a head size that is no power of two, every optional bias.
    "llama-mqa-bias": (
        "llama",
        {"num_key_value_heads": 1, "head_dim": 24, "attention_bias": True, "mlp_bias": True},
    ),
}


def _config(arch: str, overrides: dict[str, Any]) -> Any:
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    kwargs = dict(_TINY)
    if arch == "llama":
        cls = LlamaConfig
    elif arch == "qwen2":
        cls = Qwen2Config
        kwargs["tie_word_embeddings"] = True  # exercise the tied lm_head path
    elif arch == "qwen3":
        cls = Qwen3Config
    else:
        raise ValueError(f"unknown tiny arch {arch!r}; choose one of {ARCHS}")
    kwargs.update(overrides)
    return cls(**kwargs)


def make_tiny_hf_model(
    arch: str,
    path: str | Path,
    *,
    seed: int = 0,
    max_shard_size: str | int | None = None,
    **config_overrides: Any,
) -> Path:
    """Build a tiny random float32 HF model of `arch` and save it to `path`.

    Norm weights and biases are perturbed away from HF's 1/0 init so that
    those code paths change the output (a wrong norm or a dropped bias would
    otherwise go unnoticed). `max_shard_size` (e.g. "40KB") writes a sharded
    checkpoint with model.safetensors.index.json.
    """
    from transformers import AutoModelForCausalLM

    config = _config(arch, config_overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.2 * torch.randn_like(param))
            elif name.endswith(".bias"):
                param.copy_(0.1 * torch.randn_like(param))
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    kwargs: dict[str, Any] = {}
    if max_shard_size is not None:
        kwargs["max_shard_size"] = max_shard_size
    model.save_pretrained(path, **kwargs)
    return path


def load_hf_model(path: str | Path, **config_overrides: Any) -> Any:
    """The saved model back in HF, float32, eager attention (the reference)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(path),
        dtype=torch.float32,
        attn_implementation="eager",
        use_kernels=False,
        **config_overrides,
    )
    return model.eval()


@torch.no_grad()
def hf_logits(path: str | Path, token_ids: list[int], **config_overrides: Any) -> torch.Tensor:
    """HF's fp32 logits [len(token_ids), vocab] for one sequence, one forward."""
    model = load_hf_model(path, **config_overrides)
    return model(torch.tensor([token_ids])).logits[0].float()


@torch.no_grad()
def hf_greedy(
    path: str | Path,
    prompts_token_ids: list[list[int]],
    max_new_tokens: int,
    **config_overrides: Any,
) -> tuple[list[list[int]], list[list[torch.Tensor]]]:
    """Greedy-generate `max_new_tokens` for each prompt with HF (one prompt at a
    time, no padding). Returns (generated ids per prompt, per-step fp32 logits
    [vocab] per prompt).

    EOS never stops generation here: the model's eos_token_id is cleared, so
    every prompt yields exactly max_new_tokens tokens. Clearing it (instead of
    suppressing EOS with min_new_tokens) keeps the argmax untouched, so the
    tokens stay the plain argmax of the returned raw logits, which is what an
    engine run with ignore_eos must reproduce.
    """
    model = load_hf_model(path, **config_overrides)
    # generate() falls back to generation_config for arguments passed as None,
    # so clearing eos must happen on the model's own generation config.
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0  # silences a warning; nothing is padded
    tokens: list[list[int]] = []
    logits: list[list[torch.Tensor]] = []
    for prompt in prompts_token_ids:
        out = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            do_sample=False,
            max_new_tokens=max_new_tokens,
            min_new_tokens=0,
            output_logits=True,
            return_dict_in_generate=True,
        )
        tokens.append(out.sequences[0, len(prompt) :].tolist())
        logits.append([step[0].float() for step in out.logits])
    return tokens, logits


def assert_greedy_matches(
    outs: list, tokens: list[list[int]], logprobs: list, tol: float = 1e-4
) -> None:
    """Engine outputs of a greedy run with logprobs (ignore_eos, as many new
    tokens as HF generated) against HF's: the same tokens, finish "length",
    and every returned logprob within `tol` of HF's (`logprobs[i][step]`: the
    log-softmax of HF's logits at that step)."""
    for i, out in enumerate(outs):
        completion = out.outputs[0]
        prompt_len = len(out.prompt_token_ids)
        assert completion.token_ids == tokens[i], f"prompt {i} (len {prompt_len})"
        assert completion.finish_reason == "length"
        assert len(completion.logprobs) == len(tokens[i])
        for step, entries in enumerate(completion.logprobs):
            for token_id, lp in entries.items():
                ref = logprobs[i][step][token_id].item()
                assert abs(lp.logprob - ref) <= tol, (i, step, token_id, lp.logprob, ref)
