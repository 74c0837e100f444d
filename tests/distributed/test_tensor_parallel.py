"""Tensor-parallel models on CPU processes (gloo): the Llama family and
DeepSeek-V2/V3 (MLA heads split, the latent cache whole on every rank, each
expert's intermediate features split) sharded over 2 (and 4) ranks give the
one-process model's logits, fp32, for a prefill of two sequences (one after
a cached prefix) and a decode step.

Each rank is a real process (torch.multiprocessing spawn) with a gloo
process group; it builds the model with its tp_rank, loads only its slices
of the safetensors checkpoint (models/layers.py's loaders), runs the torch
op set over its own paged KV cache (its KV heads), and the row-parallel
all-reduces, the vocab-parallel embedding and the LM head's all-gather are
torch.distributed collectives. The layer rules (head split, KV heads
replicated when fewer than ranks, uneven splits refused) are checked
without processes."""

from __future__ import annotations

import pytest
import torch

from tests.distributed.checkpoint_reads import record_reads
from tests.distributed.rank_processes import spawn_ranks
from tests.hf_deepseek import make_tiny_deepseek
from tests.hf_models import make_tiny_hf_model
from tinyengine.distributed.tp import shard
from tinyengine.kernels import torch_ops
from tinyengine.models.context import AttentionMetadata, ForwardContext
from tinyengine.models.loader import load_hf_config, load_model
from tinyengine.models.parallel_layers import first_kv_head, kv_heads_per_rank

BLOCK = 8
PROMPTS = [
    [5, 17, 101, 33, 2, 9, 44, 61, 7, 12, 90, 3, 15],
    [8, 21, 300, 4, 4, 19, 250, 77, 31, 6, 140, 2],
]
CACHED = 8  # sequence 1's first 8 tokens are in the cache before the chunk


def _steps(model, num_blocks: int = 16) -> list[torch.Tensor]:
    """Logits of (1) sequence 0's whole prompt and sequence 1's prefix, (2)
    sequence 1's rest after its cached prefix beside sequence 0's first
    decode token (the argmax of step 1), over one paged cache."""
    spec = model.kv_cache_spec()
    caches = [
        (torch.zeros(num_blocks, BLOCK, spec.num_kv_heads, spec.head_dim_k),
         torch.zeros(num_blocks, BLOCK, spec.num_kv_heads, spec.head_dim_v))
        for _ in range(spec.num_layers)
    ]  # fmt: skip
    tables = torch.tensor([[0, 1, 2, 3], [4, 5, 6, 7]], dtype=torch.int32)
    ops = torch_ops()

    def run(rows: list[tuple[int, list[int], int]]) -> torch.Tensor:
        """rows: (sequence, token ids, first position) -> logits of each row's last token."""
        ids, pos, slots, starts, lens = [], [], [], [0], []
        for seq, tokens, first in rows:
            ids += tokens
            for p in range(first, first + len(tokens)):
                pos.append(p)
                slots.append(int(tables[seq, p // BLOCK]) * BLOCK + p % BLOCK)
            starts.append(starts[-1] + len(tokens))
            lens.append(first + len(tokens))
        attn = AttentionMetadata(
            num_tokens=len(ids), num_seqs=len(rows), max_query_len=max(len(r[1]) for r in rows),
            max_seq_len=max(lens), query_start_loc=torch.tensor(starts, dtype=torch.int32),
            seq_lens=torch.tensor(lens, dtype=torch.int32),
            block_tables=tables[[r[0] for r in rows]], slot_mapping=torch.tensor(slots),
            query_start_loc_cpu=starts, seq_lens_cpu=lens,
        )  # fmt: skip
        ctx = ForwardContext(attn, caches, ops)
        with torch.no_grad():
            hidden = model(torch.tensor(ids), torch.tensor(pos), ctx)
            return model.compute_logits(hidden[[s - 1 for s in starts[1:]]], ops)

    first = run([(0, PROMPTS[0], 0), (1, PROMPTS[1][:CACHED], 0)])
    token = int(first[0].argmax())
    second = run([(0, [token], len(PROMPTS[0])), (1, PROMPTS[1][CACHED:], CACHED)])
    return [first, second]


def _sharded_logits(rank: int, size: int, paths: list[str]) -> list[list[torch.Tensor]]:
    """One rank: every model in `paths` in turn, sharded; their logits."""
    return [_steps(load_model(path, load_hf_config(path), torch.float32, "cpu", tp_rank=rank,
                              tp_size=size)) for path in paths]  # fmt: skip


def _tp_logits(paths: list[str], size: int, tmp_path) -> list[list[torch.Tensor]]:
    """Per model, the logits of _steps run by `size` ranks (one process group
    for all of them: process start-ups are the slow part on a small CPU)."""
    return spawn_ranks(_sharded_logits, (paths,), size, tmp_path)


MODELS = ["llama", "qwen2", "qwen3", "deepseek-v3", "deepseek-v2-lite"]


def _build(name: str, folder) -> str:
    if name.startswith("deepseek"):
        return str(make_tiny_deepseek(name.removeprefix("deepseek-"), folder))
    return str(make_tiny_hf_model(name, folder))


def test_two_ranks_give_the_one_process_logits(tmp_path):
    paths = [_build(name, tmp_path / name) for name in MODELS]
    got = _tp_logits(paths, 2, tmp_path)
    for name, path, model_got in zip(MODELS, paths, got, strict=True):
        want = _steps(load_model(path, load_hf_config(path), torch.float32, "cpu"))
        for step_got, step_want in zip(model_got, want, strict=True):
            torch.testing.assert_close(
                step_got, step_want, rtol=1e-5, atol=1e-5, msg=lambda m, name=name: f"{name}: {m}"
            )
            assert torch.equal(step_got.argmax(-1), step_want.argmax(-1)), name


def test_four_ranks_replicate_kv_heads_and_give_the_same_logits(tmp_path):
    path = _build("llama", tmp_path / "llama")
    hf_config = load_hf_config(path)
    assert hf_config["num_key_value_heads"] < 4  # the case: KV heads replicated
    want = _steps(load_model(path, hf_config, torch.float32, "cpu"))
    (got,) = _tp_logits([path], 4, tmp_path)
    for step_got, step_want in zip(got, want, strict=True):
        torch.testing.assert_close(step_got, step_want, rtol=1e-5, atol=1e-5)


def test_head_and_kv_head_split_rules():
    assert shard(32, 1, 4, "heads") == (8, 8)
    with pytest.raises(ValueError, match="num_attention_heads=6 is not divisible by"):
        shard(6, 0, 4, "num_attention_heads")
    # 8 KV heads over 2 ranks: 4 each; 2 over 4 ranks: one each, replicated.
    assert [kv_heads_per_rank(8, 2), first_kv_head(8, 1, 2)] == [4, 4]
    assert [kv_heads_per_rank(2, 4)] + [first_kv_head(2, r, 4) for r in range(4)] == [1, 0, 0, 1, 1]
    with pytest.raises(ValueError, match="must divide or be a multiple"):
        kv_heads_per_rank(3, 4)


@pytest.mark.parametrize("name", ["qwen2", "deepseek-v3"])  # qkv bias; MLA and experts
def test_a_rank_reads_only_its_slices(name, tmp_path, monkeypatch):
    """Building rank 1 of 2 needs no process group: its loaders take lazy
    safetensors slices of every sharded tensor (never the whole tensor) and
    keep exactly their part of what one process loads."""
    path = _build(name, tmp_path / name)
    hf_config = load_hf_config(path)
    whole = dict(load_model(path, hf_config, torch.float32, "cpu").named_parameters())
    reads = record_reads(monkeypatch)

    rank1 = dict(load_model(path, hf_config, torch.float32, "cpu", tp_rank=1,
                            tp_size=2).named_parameters())  # fmt: skip
    # Replicated on every rank: norms, the router, MLA's low-rank down-projections.
    replicated = ("norm", "mlp.gate.", "q_a_proj", "kv_a_proj", "e_score_correction_bias")
    sharded = [n for n in reads.whole if not any(r in n for r in replicated)]
    assert reads.whole and not sharded, sharded
    o_proj = "model.layers.0.self_attn.o_proj.weight"  # row-parallel: rank 1's columns
    half = whole[o_proj].shape[1] // 2
    torch.testing.assert_close(rank1[o_proj], whole[o_proj][:, half:])
    if name == "deepseek-v3":  # each expert's down projection: rank 1's columns
        experts = next(n for n in whole if n.endswith("experts.w2_weight"))
        half = whole[experts].shape[2] // 2
        torch.testing.assert_close(rank1[experts], whole[experts][:, :, half:])
