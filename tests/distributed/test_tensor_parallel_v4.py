"""Tensor-parallel DeepSeek-V4 on CPU processes (gloo): sharded over 2
ranks (query heads, output groups and sinks split; the one KV head, the
compressors, the indexer, mHC and the router whole on every rank; each
expert's and the shared expert's intermediate features split; vocab-parallel
embedding and LM head), the model gives the one-process logits, fp32, for a
prefill of two sequences long enough for the sliding window, CSA's entries
(m = 4, more of them than the indexer's top-k) and HCA's (m = 8), and a
decode step after it.

The model has 8 heads in 4 output groups, so each rank holds two groups of
two heads (a rank's grouped output projection is itself grouped). A rank
reads only its slices of the sharded tensors; a head or group count that
tp_size does not divide is refused. Only the 2-rank run starts processes:
one spawn for the whole file (process start-ups are the slow part)."""

from __future__ import annotations

import re

import pytest
import torch

from tests.distributed.checkpoint_reads import record_reads
from tests.distributed.rank_processes import spawn_ranks
from tests.hf_deepseek_v4 import make_tiny_v4
from tests.models.forward_harness import PagedHarness
from tinyengine.models.deepseek_v4 import DeepseekV4ForCausalLM
from tinyengine.models.deepseek_v4_attention import CSA, HCA
from tinyengine.models.loader import load_hf_config, load_model

SIZE = 2
OVERRIDES = dict(num_attention_heads=8, o_groups=4)
PROMPTS = [
    [(37 * i + 11) % 500 + 3 for i in range(27)],
    [(53 * i + 5) % 500 + 3 for i in range(22)],
]
# Checkpoint tensors (HF writes V4 in DeepSeek's release spelling) a rank
# keeps a slice of; everything else it reads whole. The indexer's wq_b is
# whole: the indexer is replicated.
SHARDED = re.compile(
    r"attn\.(wq_b|wo_a|wo_b|attn_sink)\b|ffn\.(experts|shared_experts)\.|embed_tokens|^head\."
)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return str(make_tiny_v4(tmp_path_factory.mktemp("v4"), **OVERRIDES))


def _load(path: str, tp_rank: int = 0, tp_size: int = 1):
    hf_config = load_hf_config(path)
    return load_model(path, hf_config, torch.float32, "cpu", tp_rank=tp_rank, tp_size=tp_size)


def _steps(model) -> list[torch.Tensor]:
    """Logits of (1) both prompts' every token in one prefill, (2) one decode
    step of both sequences (each the argmax of its last prefill row)."""
    harness = PagedHarness(model, block_size=8, num_blocks=16)
    first = harness.step({0: PROMPTS[0], 1: PROMPTS[1]})
    second = harness.step({seq: [int(logits[-1].argmax())] for seq, logits in first.items()})
    return [torch.cat(list(first.values())), torch.cat(list(second.values()))]


def _sharded_logits(rank: int, size: int, path: str) -> list[torch.Tensor]:
    return _steps(_load(path, rank, size))


def test_two_ranks_give_the_one_process_logits(tiny, tmp_path):
    config = load_hf_config(tiny)
    rates = config["compress_rates"]
    shortest = min(len(p) for p in PROMPTS)
    assert shortest > 2 * config["sliding_window"] and shortest // rates[CSA] > config["index_topk"]
    assert shortest // rates[HCA] >= 2
    got = spawn_ranks(_sharded_logits, (tiny,), SIZE, tmp_path)
    want = _steps(_load(tiny))
    for step_got, step_want in zip(got, want, strict=True):
        torch.testing.assert_close(step_got, step_want, rtol=1e-5, atol=1e-5)
        assert torch.equal(step_got.argmax(-1), step_want.argmax(-1))


def test_a_rank_reads_only_its_slices(tiny, monkeypatch):
    """Building rank 1 of 2 needs no process group: it reads every sharded
    tensor as a lazy safetensors slice, every replicated one whole, and keeps
    exactly its part of what one process loads."""
    whole = dict(_load(tiny).named_parameters())
    reads = record_reads(monkeypatch)

    rank1 = dict(_load(tiny, tp_rank=1, tp_size=SIZE).named_parameters())
    assert reads.whole and reads.sliced
    assert not [n for n in reads.whole if SHARDED.search(n)]
    assert not [n for n in reads.sliced if not SHARDED.search(n)]
    assert any("indexer.wq_b" in n for n in reads.whole)  # the replicated indexer

    def second_half(name: str, dim: int) -> torch.Tensor:
        full = whole[name]
        return full.narrow(dim, full.shape[dim] // 2, full.shape[dim] // 2)

    attn, mlp = "model.layers.1.self_attn.", "model.layers.1.mlp."
    for name, dim in [(f"{attn}q_b_proj.weight", 0), (f"{attn}o_a_proj.weight", 0),
                      (f"{attn}o_b_proj.weight", 1), (f"{attn}sinks", 0),
                      (f"{mlp}shared_experts.up_proj.weight", 0),
                      (f"{mlp}shared_experts.down_proj.weight", 1), (f"{mlp}experts.w2_weight", 2),
                      ("model.embed_tokens.weight", 0), ("lm_head.weight", 0)]:  # fmt: skip
        torch.testing.assert_close(rank1[name], second_half(name, dim), msg=name)
    # w13 stacks [gate | up] per expert: rank 1 keeps the second half of each.
    gate, up = whole[f"{mlp}experts.w13_weight"].chunk(2, dim=1)
    half = gate.shape[1] // 2
    torch.testing.assert_close(
        rank1[f"{mlp}experts.w13_weight"], torch.cat([gate[:, half:], up[:, half:]], dim=1)
    )
    for name in (f"{attn}kv_proj.weight", f"{attn}compressor.indexer.q_b_proj.weight",
                 f"{mlp}gate.weight", "model.layers.1.attn_hc.fn"):  # fmt: skip
        torch.testing.assert_close(rank1[name], whole[name], msg=name)
    assert rank1[f"{attn}sinks"].dtype == torch.float32


def test_heads_or_groups_that_do_not_split_are_refused(tiny):
    config = load_hf_config(tiny)
    with pytest.raises(ValueError, match="o_groups=2 is not divisible by tensor_parallel_size=4"):
        DeepseekV4ForCausalLM({**config, "num_attention_heads": 8, "o_groups": 2}, 0, 4)
    with pytest.raises(ValueError, match="num_attention_heads=6 is not divisible by"):
        DeepseekV4ForCausalLM({**config, "num_attention_heads": 6, "o_groups": 2}, 0, 4)
