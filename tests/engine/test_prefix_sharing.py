"""Prompts that share a prefix and arrive together (one `generate` call)
hit it from the first step: the 32-prompt case of the host-overhead issue,
with the GPU's token budget (8,192), counted by the engine's own stats.
Blocks become hits as soon as a request whose tokens fill them has them
allocated (scheduling/block_manager.py), so only the first prompt computes
the shared 1,024 tokens."""

from __future__ import annotations

import random

from tests.hf_models import make_tiny_hf_model
from tinyengine import LLM, SamplingParams


def test_32_prompts_sharing_1024_tokens_compute_them_once(tmp_path):
    path = make_tiny_hf_model("qwen3", tmp_path / "qwen3")
    rng = random.Random(0)
    shared = [rng.randrange(3, 500) for _ in range(1024)]
    prompts = [shared + [rng.randrange(3, 500) for _ in range(32)] for _ in range(32)]
    llm = LLM(str(path), max_model_len=2048, max_num_batched_tokens=8192, max_num_seqs=64,
              allow_long_max_model_len=True, print_startup_report=False)  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.num_cached_tokens for o in outs] == [0] + [1024] * 31
    stats = llm.stats()
    assert stats["prefix_cache_hit_tokens"] == 31 * 1024
    assert stats["num_free_blocks"] == stats["num_total_blocks"]
