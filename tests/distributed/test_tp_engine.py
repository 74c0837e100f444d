"""The tensor-parallel engine end to end on CPU processes (gloo): `LLM(...,
tensor_parallel_size=N)` starts N - 1 worker processes, runs every startup
stage on every rank in lockstep, and serves with rank 0 scheduling and
sampling while every rank runs the forward over its shard.

Greedy tokens with 2 ranks (and 4 for one model), tensor- or (DeepSeek)
expert-parallel, equal one process's, fp32,
under a configuration that chunks prompts, hits the prefix cache and
preempts (the stats prove each happened), with asynchronous scheduling
(rank 0 shares each step's sampled ids). A worker killed mid-run gives a
clear error on rank 0 within seconds and leaves no process; a stage failing
on one rank fails startup on all of them with that rank's error; `del llm`
and shutdown() end every worker."""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import time

import pytest

from tests.distributed.test_tensor_parallel import _build
from tests.hf_deepseek_v4 import make_tiny_v4
from tinyengine import LLM, SamplingParams
from tinyengine.worker.lockstep import RankFailedError
from tinyengine.worker.worker_group import EngineDeadError

# Chunks of 24 tokens, 4 sequences, a cache of 14 blocks of 8 tokens: six
# prompts of 34-57 tokens sharing a 24-token prefix, 12 new tokens each.
ENGINE = dict(
    max_num_batched_tokens=24, max_num_seqs=4, block_size=8, num_kv_blocks=14,
    max_model_len=96, print_startup_report=False, device="cpu",
)  # fmt: skip
PREFIX = [11, 23, 5, 87, 140, 3, 66, 9, 250, 31, 7, 18, 44, 2, 91, 120, 8, 77, 6, 39, 15, 4, 20, 13]
PROMPTS = [PREFIX + [(17 * i + 3 * j) % 300 + 1 for j in range(10 + 5 * i)] for i in range(6)]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
# Piecewise graphs on every rank (the recording backend: the CPU stand-in).
PIECEWISE = {"graph_backend": "recording", "cudagraph_mode": "full_and_piecewise",
             "cuda_graph_sizes": [1, 2]}  # fmt: skip


def _generate(llm: LLM) -> list[list[int]]:
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs]


def _workers(llm: LLM) -> list[subprocess.Popen]:
    return llm.engine.startup.stages.workers._processes.procs


@pytest.mark.parametrize(
    "name,options",
    [
        ("llama", {}),
        ("qwen3", {}),
        ("deepseek-v3", {}),
        ("deepseek-v4", {}),
        ("deepseek-v3", {"enable_expert_parallel": True}),
        ("deepseek-v2-lite", {"enable_expert_parallel": True}),
        ("deepseek-v4", {"enable_expert_parallel": True}),
        ("llama", PIECEWISE),
    ],
    ids=[
        "llama",
        "qwen3",
        "deepseek-v3",
        "deepseek-v4",
        "deepseek-v3-ep",
        "deepseek-v2-lite-ep",
        "deepseek-v4-ep",
        "llama-piecewise",
    ],
)
def test_two_ranks_generate_the_one_process_tokens(name, options, tmp_path):
    folder = tmp_path / name
    path = str(make_tiny_v4(folder)) if name == "deepseek-v4" else _build(name, folder)
    one = LLM(path, **ENGINE)
    want = _generate(one)
    stats = one.stats()
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hit_tokens"] > 0
    del one
    llm = LLM(path, tensor_parallel_size=2, **options, **ENGINE)
    procs = _workers(llm)
    assert len(procs) == 1 and procs[0].poll() is None
    assert _generate(llm) == want
    got = llm.stats()
    assert got["tensor_parallel_size"] == 2
    assert got["num_preemptions"] == stats["num_preemptions"]
    assert got["prefix_cache_hit_tokens"] == stats["prefix_cache_hit_tokens"]
    assert got["num_free_blocks"] == got["num_total_blocks"]
    if options is PIECEWISE:  # every rank replayed its chain; rank 0's are counted
        assert llm.startup_report().piecewise_sizes == got["piecewise_graph_sizes"] != []
        assert llm.engine.runner.piecewise.backend.num_replays > 0
    del llm
    gc.collect()
    assert procs[0].wait(timeout=15) is not None  # `del llm` ends the worker


def test_four_ranks_and_a_shutdown(tmp_path):
    path = _build("llama", tmp_path / "llama")
    want = _generate(LLM(path, **ENGINE))
    llm = LLM(path, tensor_parallel_size=4, **ENGINE)
    procs = _workers(llm)
    assert len(procs) == 3
    report = llm.startup_report()  # every rank ran every stage method; all planned 14 blocks
    methods = ["load", "profile", "plan_kv", "allocate_kv", "warmup", "capture", "lock"]
    for rank in range(4):
        assert [r["name"] for r in report.ranks if r["rank"] == rank] == methods
    assert [r["value"] for r in report.ranks if r["name"] == "plan_kv"] == [14] * 4
    assert "rank 3: load" in report.table()
    assert _generate(llm) == want
    llm.shutdown()
    assert all(p.poll() is not None for p in procs)
    llm.shutdown()  # idempotent


def test_a_killed_worker_is_a_clear_error_and_leaves_no_process(tmp_path):
    path = _build("llama", tmp_path / "llama")
    llm = LLM(path, tensor_parallel_size=2, **ENGINE)
    (proc,) = _workers(llm)
    engine = llm.engine
    engine.add_request({"prompt_token_ids": PROMPTS[0]},
                       SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True))  # fmt: skip
    engine.step()
    os.kill(proc.pid, signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(EngineDeadError, match=r"worker rank 1 \(pid \d+\) exited with code -9"):
        for _ in range(100):
            engine.step()
    assert time.monotonic() - start < 10
    assert proc.poll() is not None
    with pytest.raises(EngineDeadError, match="rank 1"):  # and it stays dead
        engine.add_request({"prompt_token_ids": PROMPTS[1]}, GREEDY)
        engine.step()
    llm.shutdown()


FAIL_ON_RANK_1 = """
import sys
if sys.argv[:2] == ["-m", "1"]:  # the worker of rank 1 (tinyengine/worker/worker_main.py)
    from tinyengine.worker.stages import StartupStages

    def warmup(self, num_kv_blocks):
        raise RuntimeError("injected warmup failure")

    StartupStages.warmup = warmup
"""


def test_a_stage_failing_on_one_rank_fails_startup_everywhere(tmp_path, monkeypatch):
    path = _build("llama", tmp_path / "llama")
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(FAIL_ON_RANK_1)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]))
    from tinyengine.config import EngineConfig
    from tinyengine.engine import LLMEngine
    from tinyengine.worker.startup import StartupMachine

    config = EngineConfig.from_kwargs(path, tensor_parallel_size=2, **ENGINE)
    machine = StartupMachine.for_config(config)
    with pytest.raises(RankFailedError, match="rank 1: RuntimeError: injected warmup failure"):
        LLMEngine(config, machine)
    assert machine.state.value == "failed"
    error = "warmup: RankFailedError: rank 1: RuntimeError: injected warmup failure"
    assert machine.report.error == error
    assert [s.name for s in machine.report.stages] == ["load", "profile", "size_kv"]
    procs = machine.stages.workers._processes.procs
    assert all(p.poll() is not None for p in procs)
    assert not [line for line in _ps() if "tinyengine.worker.worker_main" in line]
    # The process group is gone: a new engine can start in this process.
    monkeypatch.delenv("PYTHONPATH")
    llm = LLM(path, tensor_parallel_size=2, **ENGINE)
    assert len(_generate(llm)) == len(PROMPTS)
    llm.shutdown()


def test_a_worker_that_dies_while_starting_is_an_error_at_once(tmp_path, monkeypatch):
    path = _build("llama", tmp_path / "llama")
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(
        'import os, sys\nif sys.argv[:2] == ["-m", "1"]:\n    os._exit(7)\n'
    )
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]))
    start = time.monotonic()
    with pytest.raises(RankFailedError, match=r"rank 1 could not start: .*code 7"):
        LLM(path, tensor_parallel_size=2, **ENGINE)
    assert time.monotonic() - start < 30


def test_a_stage_failing_on_rank_0_ends_the_workers_waiting_for_it(tmp_path, monkeypatch):
    """Rank 0 fails before warmup's first forward; the worker, already in
    that forward's all-reduce, would wait for it forever: it is killed."""
    from tinyengine.worker.stages import StartupStages

    def warmup(self, num_kv_blocks):
        raise RuntimeError("injected on rank 0")

    monkeypatch.setattr(StartupStages, "warmup", warmup)
    path = _build("llama", tmp_path / "llama")
    start = time.monotonic()
    with pytest.raises(RankFailedError, match="rank 0: RuntimeError: injected on rank 0"):
        LLM(path, tensor_parallel_size=2, **ENGINE)
    gc.collect()
    assert time.monotonic() - start < 60
    assert not [line for line in _ps() if "tinyengine.worker.worker_main" in line]


def _ps() -> list[str]:
    return subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout.splitlines()


@pytest.mark.gpu
def test_more_ranks_than_gpus_is_a_clear_error(tmp_path):
    import torch

    path = _build("llama", tmp_path / "llama")
    ranks = torch.cuda.device_count() + 1
    with pytest.raises(ValueError, match=f"tensor_parallel_size={ranks} needs one GPU per rank"):
        LLM(path, tensor_parallel_size=ranks, max_model_len=96)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_the_lockstep_path_at_one_rank_matches_the_plain_engine(device, tmp_path):
    """The multi-rank machinery with a single rank (a process group of one,
    NCCL on a GPU): every stage through LockstepStages, CUDA graphs captured
    on a GPU (their steps carry no collective), steps through WorkerGroup.
    Tokens equal the plain engine's."""
    from tinyengine.config import EngineConfig
    from tinyengine.engine import LLMEngine
    from tinyengine.worker.lockstep import LockstepStages
    from tinyengine.worker.stages import StartupStages
    from tinyengine.worker.startup import StartupMachine
    from tinyengine.worker.worker_group import WorkerGroup

    path = _build("llama", tmp_path / "llama")
    options = {**ENGINE, "device": device}
    want = _generate(LLM(path, **options))
    config = EngineConfig.from_kwargs(path, **options)
    machine = StartupMachine(LockstepStages(StartupStages.for_config(config), WorkerGroup(config)))
    engine = LLMEngine(config, machine)
    ids = [engine.add_request({"prompt_token_ids": p}, GREEDY) for p in PROMPTS]
    done = {}
    while engine.has_unfinished_requests():
        done.update((o.request_id, o.outputs[0].token_ids) for o in engine.step() if o.finished)
    assert [done[i] for i in ids] == want
    assert engine.runner.peers is machine.stages.workers
    if device == "cuda":
        assert machine.report.captured_sizes  # graphs replayed by the steps above
    engine.shutdown()


def test_logprobs_and_prompt_logprobs_with_two_ranks(tmp_path):
    """Prompt logprobs take logits on every rank (the LM head's all-gather is
    a collective), sampled logprobs come from rank 0's sampler: both match
    one process (to rounding: the all-reduce sums in another order)."""
    path = _build("qwen3", tmp_path / "qwen3")
    params = SamplingParams(temperature=0.0, max_tokens=6, logprobs=3, prompt_logprobs=2)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS[:3]]

    def run(llm: LLM) -> list:
        outs = llm.generate(prompts, params, use_tqdm=False)
        llm.shutdown()
        return outs

    want = run(LLM(path, **ENGINE))
    got = run(LLM(path, tensor_parallel_size=2, **ENGINE))
    for g, w in zip(got, want, strict=True):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        pairs = list(zip(g.prompt_logprobs[1:], w.prompt_logprobs[1:], strict=True))
        pairs += list(zip(g.outputs[0].logprobs, w.outputs[0].logprobs, strict=True))
        assert len(pairs) > len(PROMPTS[0])
        for g_entry, w_entry in pairs:
            assert g_entry.keys() == w_entry.keys()
            for token, lp in w_entry.items():
                assert g_entry[token].logprob == pytest.approx(lp.logprob, abs=1e-4)
