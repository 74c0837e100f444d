"""Expert parallelism (load_model(expert_parallel=True)) on CPU processes
(gloo): DeepSeek-V3 and DeepSeek-V2-Lite with their routed experts split
whole over 2 ranks (4 of 8 experts each; MLA heads and shared experts
tensor-parallel as without it) give the one-process model's logits, fp32.

Also checked without processes: an expert-parallel rank reads only its own
experts' tensors from the checkpoint (the others are never opened, not even
as lazy slices); the local routing (global expert ids -> this rank's, pairs
of other ranks' experts weighted 0) sums over the ranks to the whole
fused_moe in both op sets, tokens with no local expert included; expert
counts that do not split evenly and models without expert parallelism are
refused with clear errors."""

from __future__ import annotations

import re

import pytest
import torch

from tests.distributed.checkpoint_reads import record_reads
from tests.distributed.rank_processes import spawn_ranks
from tests.distributed.test_tensor_parallel import _build, _steps
from tests.hf_deepseek_v4 import make_tiny_v4
from tinyengine.kernels.opset import torch_ops, triton_ops
from tinyengine.models.context import ForwardContext
from tinyengine.models.loader import load_hf_config, load_model
from tinyengine.models.moe import FusedExperts, MoEConfig, expert_range, local_routing

MODELS = ["deepseek-v3", "deepseek-v2-lite"]
NUM_EXPERTS = 8  # tests/hf_deepseek.py's tiny variants


def _expert_parallel_logits(rank: int, size: int, paths: list[str]) -> list[list[torch.Tensor]]:
    """One rank: every model in `paths` in turn, expert-parallel; their logits."""
    logits = []
    for path in paths:
        model = load_model(path, load_hf_config(path), torch.float32, "cpu", tp_rank=rank,
                           tp_size=size, expert_parallel=True)  # fmt: skip
        experts = [m for m in model.modules() if isinstance(m, FusedExperts)]
        assert experts and all(e.w13_weight.shape[0] == NUM_EXPERTS // size for e in experts)
        logits.append(_steps(model))
    return logits


def test_two_expert_parallel_ranks_give_the_one_process_logits(tmp_path):
    paths = [_build(name, tmp_path / name) for name in MODELS]
    got = spawn_ranks(_expert_parallel_logits, (paths,), 2, tmp_path)
    for name, path, model_got in zip(MODELS, paths, got, strict=True):
        want = _steps(load_model(path, load_hf_config(path), torch.float32, "cpu"))
        for step_got, step_want in zip(model_got, want, strict=True):
            torch.testing.assert_close(
                step_got, step_want, rtol=1e-5, atol=1e-5, msg=lambda m, name=name: f"{name}: {m}"
            )
            assert torch.equal(step_got.argmax(-1), step_want.argmax(-1)), name


@pytest.mark.parametrize("name", ["deepseek-v3", "deepseek-v4"])
def test_a_rank_reads_only_its_own_experts(name, tmp_path, monkeypatch):
    """Rank 1 of 2 (no process group needed to load) opens the second half
    of the experts and never touches the first, whole or sliced; its stacked
    weights are exactly those experts of the one-process model."""
    folder = tmp_path / name
    path = str(make_tiny_v4(folder)) if name == "deepseek-v4" else _build(name, folder)
    hf_config = load_hf_config(path)
    whole = dict(load_model(path, hf_config, torch.float32, "cpu").named_parameters())
    reads = record_reads(monkeypatch)

    rank1 = dict(load_model(path, hf_config, torch.float32, "cpu", tp_rank=1, tp_size=2,
                            expert_parallel=True).named_parameters())  # fmt: skip
    expert_of = (re.search(r"experts\.(\d+)\.", n) for n in reads.touched)
    experts_read = {int(m.group(1)) for m in expert_of if m}
    num_experts = hf_config["n_routed_experts"]
    assert experts_read == set(range(num_experts // 2, num_experts))
    stacked = [n for n in whole if n.endswith(("experts.w13_weight", "experts.w2_weight"))]
    assert stacked
    for param in stacked:
        torch.testing.assert_close(rank1[param], whole[param][num_experts // 2 :], rtol=0, atol=0)
    if name == "deepseek-v4":
        return
    shared = "model.layers.1.mlp.shared_experts.down_proj.weight"  # still split by features
    half = whole[shared].shape[1] // 2
    torch.testing.assert_close(rank1[shared], whole[shared][:, half:])


@pytest.mark.parametrize("ops_name", ["torch", "triton"])
def test_local_routing_sums_over_ranks_to_the_whole_moe(ops_name):
    """Two expert-parallel ranks' FusedExperts (4 of 8 experts each, built in
    one process: at one process the all-reduce is the identity) hold whole
    experts and, summed, give the one-rank FusedExperts' output. Token 0
    routes only to rank 1's experts, token 1 only to rank 0's: on the other
    rank they keep valid local ids, weight 0, and rows of exactly zero."""
    ops = torch_ops() if ops_name == "torch" else triton_ops("cpu")
    ctx = ForwardContext(None, [], ops)  # type: ignore[arg-type]
    cfg = MoEConfig(hidden_size=32, moe_intermediate_size=16, num_experts=NUM_EXPERTS, top_k=3,
                    n_shared_experts=0, topk_method="greedy", n_group=None, topk_group=None,
                    norm_topk_prob=False, routed_scaling_factor=1.0, mlp_bias=False)  # fmt: skip
    g = torch.Generator().manual_seed(0)
    whole = FusedExperts(cfg, 0, 1)
    whole.w13_weight.data = torch.randn(whole.w13_weight.shape, generator=g) * 32**-0.5
    whole.w2_weight.data = torch.randn(whole.w2_weight.shape, generator=g) * 16**-0.5
    x = torch.randn(6, 32, generator=g)
    ids = torch.tensor([[4, 6, 7], [0, 3, 1], [2, 5, 7], [7, 0, 4], [1, 6, 3], [5, 2, 0]])
    weights = torch.rand(6, 3, generator=g)

    parts = []
    for rank in range(2):
        local = expert_range(NUM_EXPERTS, rank, 2)
        w, i = local_routing(weights, ids, local)
        mine = (ids >= local.start) & (ids < local.stop)
        assert torch.equal(w, torch.where(mine, weights, 0.0))
        assert torch.equal(i, torch.where(mine, ids - local.start, 0))
        experts = FusedExperts(cfg, rank, 2, expert_parallel=True)
        assert experts.local == local and not experts.w13_weight.reads_part  # whole experts
        experts.w13_weight.data = whole.w13_weight.data[local.start : local.stop]
        experts.w2_weight.data = whole.w2_weight.data[local.start : local.stop]
        parts.append(experts(x, weights, ids, ctx))
    assert torch.equal(parts[0][0], torch.zeros(32))  # token 0: rank 1's experts only
    assert torch.equal(parts[1][1], torch.zeros(32))  # token 1: rank 0's experts only
    torch.testing.assert_close(parts[0] + parts[1], whole(x, weights, ids, ctx),
                               rtol=1e-5, atol=1e-5)  # fmt: skip


def test_expert_count_not_divisible_is_refused(tmp_path):
    path = _build("deepseek-v2-lite", tmp_path / "v2")
    with pytest.raises(ValueError, match=r"n_routed_experts=8 is not divisible by the "
                                         r"expert-parallel size 3"):  # fmt: skip
        load_model(path, load_hf_config(path), torch.float32, "cpu", tp_rank=0, tp_size=3,
                   expert_parallel=True)  # fmt: skip


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "Qwen3ForCausalLM"])
def test_models_without_expert_parallelism_refuse_it(arch, tmp_path):
    # Refused before anything is built or read: no checkpoint needed.
    with pytest.raises(ValueError, match=f"{arch} does not support expert parallelism"):
        load_model(str(tmp_path), {"architectures": [arch]}, torch.float32, "cpu",
                   expert_parallel=True)  # fmt: skip
