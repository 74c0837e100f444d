"""Real CUDA graphs on the GPU (`pytest -m gpu`; skipped without CUDA).

(a) The hazard, reproduced with the raw pieces: a graph captured over a
    workspace view keeps writing to that address after the arena has grown and
    freed it, corrupting whatever tensor now lives there. Then the same
    sequence through the engine, where the lock turns it into an error.
(b) Greedy outputs with graphs == eager == HF, batches padded to captured sizes.
(c) No Triton kernel compiles after READY.
"""

from __future__ import annotations

import pytest
import torch

from tests.hf_models import hf_greedy, make_tiny_hf_model
from tinyengine import LLM, SamplingParams
from tinyengine.kernels.workspace import Workspace, WorkspaceLockedError

pytestmark = pytest.mark.gpu


def _late_compiles(llm) -> list[str]:
    from tinyengine.kernels import jit_monitor

    return jit_monitor.compiled_since(llm.engine._jit_compiles_at_ready)


BACKENDS = ["torch", "triton"]


def test_hazard_reproduced_with_raw_graph():
    ws = Workspace("cuda")
    n = 1 << 20  # 4 MiB of fp32: large enough for the allocator to reuse the block exactly
    scratch = ws.get(((n,), torch.float32))[0]
    out = torch.empty((), device="cuda")

    def step() -> None:
        (scratch,) = ws.get(((n,), torch.float32))
        scratch.fill_(7.0)
        out.copy_(scratch.sum())

    step()  # warm up outside the graph (no growth during capture)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    del scratch
    old_ptr = ws.buffer.data_ptr()
    old_bytes = ws.buffer.untyped_storage().nbytes()
    ws.get(((4 * n,), torch.float32))  # lock bypassed (never locked): the arena grows
    assert ws.buffer.data_ptr() != old_ptr
    # New tensors of the old allocation's size: the caching allocator hands the
    # freed block to one of them (other tests may have left other free blocks
    # of that size in the pool, so allow a few tries).
    victims = []
    for _ in range(64):
        victims.append(torch.zeros(old_bytes // 4, device="cuda"))
        if victims[-1].data_ptr() == old_ptr:
            break
    victim = victims[-1]
    assert victim.data_ptr() == old_ptr, "the allocator did not reuse the freed block"
    graph.replay()
    torch.cuda.synchronize()
    assert (victim[:n] == 7.0).all(), "the replay wrote into the freed (now reused) block"


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return str(make_tiny_hf_model("llama", tmp_path_factory.mktemp("llama")))


@pytest.mark.parametrize("backend", BACKENDS)
def test_engine_lock_turns_hazard_into_error(tiny_model, backend):
    llm = LLM(tiny_model, max_model_len=256, max_num_seqs=8, attention_backend=backend,
              dtype="float32", print_startup_report=False)  # fmt: skip
    ws = llm.engine.runner.workspace
    assert llm.startup_report().captured_sizes, "graphs were captured"
    assert ws.locked
    with pytest.raises(WorkspaceLockedError, match="test_engine_lock_turns_hazard_into_error"):
        ws.get(((ws.size + 1,), torch.uint8))
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": [1, 2, 3]}], params, use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4


PROMPTS = [[5, 6, 7], list(range(3, 40)), [9] * 20, [11, 12], list(range(100, 117))]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_graphs_equal_eager_equal_hf(tmp_path, arch, backend):
    path = make_tiny_hf_model(arch, tmp_path)
    hf_tokens, _ = hf_greedy(path, PROMPTS, 12)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    results = {}
    for eager in (False, True):
        llm = LLM(str(path), max_model_len=256, max_num_seqs=8, cuda_graph_sizes=[1, 2, 4, 8],
                  attention_backend=backend, dtype="float32", enforce_eager=eager,
                  print_startup_report=False)  # fmt: skip
        outs = llm.generate(prompts, params, use_tqdm=False)
        results[eager] = [o.outputs[0].token_ids for o in outs]
        if not eager:
            assert llm.startup_report().captured_sizes == [1, 2, 4, 8]
            assert llm.stats()["jit_compiles_after_ready"] == 0, _late_compiles(llm)
    assert results[False] == results[True] == hf_tokens  # 5 sequences: padded to 8


@pytest.mark.parametrize("backend", BACKENDS)
def test_no_jit_compiles_after_ready_bf16(tiny_model, backend):
    llm = LLM(tiny_model, max_model_len=512, max_num_seqs=16, attention_backend=backend,
              max_num_batched_tokens=256, print_startup_report=False)  # fmt: skip
    rng = torch.Generator().manual_seed(0)
    prompts, params = [], []
    for i in range(40):
        n = int(torch.randint(1, 300, (1,), generator=rng))
        prompts.append({"prompt_token_ids": torch.randint(3, 500, (n,), generator=rng).tolist()})
        max_tokens = int(torch.randint(1, 40, (1,), generator=rng))
        params.append(
            SamplingParams(temperature=0.0 if i % 2 else 0.8, top_p=0.9, seed=i, ignore_eos=True,
                           max_tokens=max_tokens, logprobs=2 if i % 3 == 0 else None)
        )  # fmt: skip
    llm.generate(prompts, params, use_tqdm=False)
    stats = llm.stats()
    assert stats["jit_compiles_after_ready"] == 0, _late_compiles(llm)
    assert stats["workspace_bytes"] == llm.startup_report().stages[-1].workspace_bytes
    report = llm.startup_report()
    assert report.workspace_growth_after_kv_sizing == 0
    # Every captured shape ran eagerly before capture (decode sizes in
    # profile, piecewise counts in warmup): capture itself compiles nothing.
    assert {s.name: s for s in report.stages}["capture"].kernels == 0
