"""Precompile (worker/precompile.py, kernels/compile_ahead.py): the dry run
of the startup's dummy forwards, whose Triton kernels compile in parallel
threads instead of running; load starts it before reading the weights and
profile waits for it.

On the GPU, each architecture in a fresh process with an empty Triton cache:
  * every variant compiles in load or profile (the dry run hands them all
    to the pool): warmup, capture and serving compile none;
  * the dry run leaves nothing behind: greedy tokens and logprobs equal those
    of an engine started with compile_threads=0 (each variant compiled at its
    first launch, nothing run dry).
  * the pool also loads each variant and builds its host launcher, which
    Triton otherwise does at the variant's first real launch.
On the CPU: the setting's validation and resolution, that nothing runs
dry off the GPU, and where in load and profile the compiles start, end or
are cancelled.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import triton
import triton.language as tl

from tests.hf_deepseek import make_tiny_deepseek
from tests.hf_deepseek_v4 import make_tiny_v4
from tests.hf_models import make_tiny_hf_model
from tinyengine import LLM
from tinyengine.config import EngineConfig
from tinyengine.worker.precompile import compile_threads


def test_compile_threads_setting():
    assert compile_threads(0) == 0 and compile_threads(5) == 5
    assert 1 <= compile_threads(None) <= 16
    for bad in (-1, 1.5, True, "4"):
        with pytest.raises(ValueError, match="compile_threads"):
            EngineConfig(model="m", compile_threads=bad)


def test_nothing_runs_dry_on_cpu(tmp_path, monkeypatch):
    """Off the GPU Triton compiles nothing: profile never enters the dry run."""
    import tinyengine.worker.precompile as precompile

    def refuse(threads):
        raise AssertionError("a compile pool was made on a CPU")

    monkeypatch.setattr(precompile, "AheadCompiles", refuse)
    path = make_tiny_hf_model("qwen3", tmp_path / "qwen3", num_hidden_layers=1)
    llm = LLM(str(path), max_model_len=64, max_num_seqs=2, compile_threads=4,
              print_startup_report=False)  # fmt: skip
    assert llm.startup_report().stages


class _Compiles:
    """Stands in for the dry run's pending compiles (kernels/compile_ahead.py),
    recording into `events` when it starts, finishes or is cancelled."""

    def __init__(self, events, runner):
        self.events = events
        events.append("dry run" if runner.model is not None else "dry run without a model")

    def finish(self):
        self.events.append("finish")
        return 0

    def cancel(self):
        self.events.append("cancel")


def _fake_dry_run(monkeypatch):
    """Fake the dry run; record it, the weights' read and profile's first
    forward in the order they happen."""
    import tinyengine.models.loader as loader
    import tinyengine.worker.stages as stages

    events = []
    monkeypatch.setattr(stages, "start_precompile", lambda runner: _Compiles(events, runner))
    read, decode = loader.load_weights, stages.largest_decode

    def load_weights(*args, **kwargs):
        events.append("weights")
        return read(*args, **kwargs)

    def largest_decode(runner):
        events.append("profile forward")
        return decode(runner)

    monkeypatch.setattr(loader, "load_weights", load_weights)
    monkeypatch.setattr(stages, "largest_decode", largest_decode)
    return events


def test_the_dry_run_starts_before_the_weights_and_profile_waits(tmp_path, monkeypatch):
    """load starts the dry run's compiles between building the model and
    reading its weights; profile waits for them before its forwards."""
    events = _fake_dry_run(monkeypatch)
    path = make_tiny_hf_model("qwen3", tmp_path / "qwen3", num_hidden_layers=1)
    LLM(str(path), max_model_len=64, max_num_seqs=2, print_startup_report=False)
    assert events == ["dry run", "weights", "finish", "profile forward"]


def test_a_load_that_fails_cancels_the_compiles(tmp_path, monkeypatch):
    from safetensors.torch import load_file, save_file

    events = _fake_dry_run(monkeypatch)
    path = make_tiny_hf_model("qwen3", tmp_path / "qwen3", num_hidden_layers=1)
    (weights,) = path.glob("*.safetensors")
    tensors = load_file(weights)
    lost = next(name for name in tensors if "down_proj" in name)
    del tensors[lost]
    save_file(tensors, weights)
    with pytest.raises(Exception, match="lacks 1 tensor"):
        LLM(str(path), max_model_len=64, max_num_seqs=2, print_startup_report=False)
    assert events == ["dry run", "weights", "cancel"]


_STARTUP = """
import json, sys
from tinyengine import LLM, SamplingParams
llm = LLM(sys.argv[1], dtype="bfloat16", max_model_len=256, max_num_seqs=8,
          compile_threads=int(sys.argv[2]), num_kv_blocks=int(sys.argv[3]) or None,
          print_startup_report=False)
kernels = {s.name: s.kernels for s in llm.startup_report().stages}
prompts = [{"prompt_token_ids": list(range(3, 3 + n))} for n in (5, 40, 90)]
outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True,
                                            logprobs=1), use_tqdm=False)
print(json.dumps({
    "kernels": kernels,
    "after_ready": llm.stats()["jit_compiles_after_ready"],
    "tokens": [o.outputs[0].token_ids for o in outs],
    "logprobs": [[{str(t): lp.logprob for t, lp in step.items()} for step in o.outputs[0].logprobs]
                 for o in outs],
}))
"""


def _start(path, threads: int, cache, num_kv_blocks: int = 0) -> dict:
    env = dict(os.environ, TRITON_CACHE_DIR=str(cache))
    argv = [sys.executable, "-c", _STARTUP, str(path), str(threads), str(num_kv_blocks)]
    run = subprocess.run(argv, env=env,
                         capture_output=True, text=True, timeout=600)  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_dry_run_meets_warmups_request_shapes(tmp_path, monkeypatch):
    """The dry run's stand-in for warmup's requests has warmup's shapes with
    an ample KV cache, and runs as dummy forwards: one prefill of every
    prompt, then one decode step per context length."""
    from tinyengine.scheduling.block_manager import BlockManager
    from tinyengine.worker import precompile as pc
    from tinyengine.worker.warmup import workload

    path = make_tiny_hf_model("qwen3", tmp_path / "qwen3", num_hidden_layers=1)
    llm = LLM(str(path), max_model_len=64, max_num_seqs=2, print_startup_report=False)
    runner = llm.engine.runner
    ample = BlockManager(10_000, runner.config.block_size)
    assert workload(runner, None) == workload(runner, ample)
    num_seqs, prompt_len, steps = workload(runner, None)
    forwards = []
    monkeypatch.setattr(runner, "dummy_forward", lambda q, s=None: forwards.append((q, s)))
    pc.warmup_requests(runner)
    decodes = [([1] * num_seqs, [prompt_len + 1 + i] * num_seqs) for i in range(steps)]
    assert forwards == [([prompt_len] * num_seqs, None), *decodes]
    # A tiny cache shrinks warmup's requests to fit.
    assert workload(runner, BlockManager(2, runner.config.block_size)) < (
        num_seqs,
        prompt_len,
        steps,
    )


def test_wide_offset_variants_are_compiled_when_the_cache_may_need_them(tmp_path, monkeypatch):
    """The dry run's second pass (64-bit cache offsets) runs exactly when the
    KV cache size_kv may allocate reaches past int32 offsets in a layer:
    with num_kv_blocks set, judged on that count, laid out as allocated."""
    import dataclasses

    from tinyengine.models.context import KVCacheSpec
    from tinyengine.worker.precompile import kv_cache_may_need_wide_offsets

    path = make_tiny_hf_model("qwen3", tmp_path / "qwen3", num_hidden_layers=2)
    llm = LLM(str(path), max_model_len=64, max_num_seqs=2, print_startup_report=False)
    runner = llm.engine.runner
    spec = runner.model.kv_cache_spec()
    # One layer's K view spans every block's rows of K and V (kv_cache.py).
    per_block = runner.block_size * spec.num_kv_heads * (spec.head_dim_k + spec.head_dim_v)
    limit = 2**31 // per_block
    for blocks, wide in ((limit - 1, False), (limit + 1, True), (16, False)):
        monkeypatch.setattr(
            runner, "config", dataclasses.replace(runner.config, num_kv_blocks=blocks)
        )
        assert kv_cache_may_need_wide_offsets(runner) is wide, blocks
    # MLA's latent cache is never read by those kernels (its prefill expands
    # each step's blocks into a small K/V of its own): no second pass.
    huge = dataclasses.replace(runner.config, num_kv_blocks=10**7)
    monkeypatch.setattr(runner, "config", huge)
    assert kv_cache_may_need_wide_offsets(runner)
    latent = KVCacheSpec(spec.num_layers, 1, 576, 0)
    monkeypatch.setattr(runner.model, "kv_cache_spec", lambda: latent)
    assert not kv_cache_may_need_wide_offsets(runner)


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["qwen3", "qwen3-wide", "deepseek-v3", "deepseek-v4"])
def test_gpu_precompile_compiles_everything_before_warmup(tmp_path, arch):
    # qwen3-wide: a KV cache past int32 offsets in a layer (2.2M blocks of
    # 16 x 2 heads x (16 + 16), 18 GB), whose attention variants profile's
    # one-block cache never meets: the dry run's second pass compiles them.
    blocks = 2_200_000 if arch == "qwen3-wide" else 0
    if arch.startswith("qwen3"):
        path = make_tiny_hf_model("qwen3", tmp_path / arch, num_hidden_layers=4)
    elif arch == "deepseek-v3":
        path = make_tiny_deepseek("v3", tmp_path / arch, num_hidden_layers=4)
    else:
        path = make_tiny_v4(tmp_path / arch, num_hidden_layers=3,
                            layer_types=["sliding_attention", "compressed_sparse_attention",
                                         "heavily_compressed_attention"])  # fmt: skip
    dry = _start(path, 8, tmp_path / "cache_dry", blocks)
    # The dry run's compiles start in load and profile waits for them.
    assert dry["kernels"]["load"] + dry["kernels"]["profile"] > 0
    assert dry["kernels"]["warmup"] == 0 and dry["kernels"]["capture"] == 0, dry["kernels"]
    assert dry["after_ready"] == 0
    plain = _start(path, 0, tmp_path / "cache_plain", blocks)
    assert dry["tokens"] == plain["tokens"]
    assert dry["logprobs"] == plain["logprobs"]


def test_launches_share_a_compile_only_where_triton_would():
    """compile_ahead's deduplication key follows Triton's default
    specialization: integer values share a compile unless one is 1 or a
    multiple of 16; dtypes, alignment and keyword arguments separate."""
    import torch

    from tinyengine.kernels.compile_ahead import _variant_key

    x = torch.zeros(64)
    key = _variant_key(len, (x, 5, 7), {"BLOCK": 32, "num_warps": 4})
    assert _variant_key(len, (x, 9, 3), {"BLOCK": 32, "num_warps": 4}) == key
    assert _variant_key(len, (x, 1, 7), {"BLOCK": 32, "num_warps": 4}) != key
    assert _variant_key(len, (x, 32, 7), {"BLOCK": 32, "num_warps": 4}) != key
    assert _variant_key(len, (x.half(), 5, 7), {"BLOCK": 32, "num_warps": 4}) != key
    assert _variant_key(len, (x[1:], 5, 7), {"BLOCK": 32, "num_warps": 4}) != key
    assert _variant_key(len, (x, 5, 7), {"BLOCK": 64, "num_warps": 4}) != key
    assert _variant_key(max, (x, 5, 7), {"BLOCK": 32, "num_warps": 4}) != key


@triton.jit
def _double(x_ptr, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=offs < n) * 2, mask=offs < n)


@pytest.mark.gpu
def test_gpu_compile_ahead_loads_each_variant():
    from tinyengine.kernels.compile_ahead import AheadCompiles

    x = torch.ones(100, device="cuda")
    compiles = AheadCompiles(2)
    with compiles.dry() as futures:
        _double[(1,)](x, 100, BLOCK=128)
        _double[(1,)](x, 100, BLOCK=256)
    assert compiles.finish() == 2
    kernels = [f.result() for f in futures]
    assert len(kernels) == 2 and all(k.module is not None for k in kernels)
    assert torch.equal(x, torch.ones_like(x))  # nothing ran inside the block
    _double[(1,)](x, 100, BLOCK=128)
    assert torch.equal(x, torch.full_like(x, 2.0))
