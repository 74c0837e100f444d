"""The startup state machine (tinyengine/worker/startup.py) through the real
stages (tinyengine/worker/stages.py) and engine on a tiny random Llama (CPU);
test_startup.py drives it with fake stages.

Real engine: the report's stages and notes, the workspace locked on every
path with no growth after KV sizing, warmup leaving no trace (no cached
block, every KV value zero, stats cleared), num_kv_blocks honoured, and a KV
budget too small for one max_model_len sequence failing loudly.
"""

from __future__ import annotations

import pytest
import torch

from tests.hf_models import make_tiny_hf_model
from tinyengine import LLM, SamplingParams
from tinyengine.worker.startup import (
    TRANSITIONS,
    Stage,
    StartupMachine,
    StartupOrderError,
)

ORDER = list(TRANSITIONS)  # load, profile, size_kv, warmup, capture, lock


pytestmark = pytest.mark.usefixtures("one_torch_thread")


# --------------------------------------------------------------------------
# The real engine, tiny llama on CPU.
# --------------------------------------------------------------------------

ENGINE = dict(max_model_len=128, max_num_seqs=4, max_num_batched_tokens=64,
              print_startup_report=False)  # fmt: skip


@pytest.fixture(scope="module")
def llama_path(tmp_path_factory) -> str:
    return str(make_tiny_hf_model("llama", tmp_path_factory.mktemp("llama"), num_hidden_layers=2))


def _workspace_requests(monkeypatch) -> list[tuple[str, int]]:
    """Record (stage, bytes asked) of every workspace request from now on."""
    from tinyengine.kernels import workspace as ws_mod

    log: list[tuple[str, int]] = []
    original = ws_mod.Workspace.get

    def get(self, *specs):
        total = 0
        for shape, dtype in specs:
            n = 1
            for s in shape:
                n *= int(s)
            total = -(-(total + n * torch.empty((), dtype=dtype).element_size()) // 256) * 256
        log.append((self.stage, total))
        return original(self, *specs)

    monkeypatch.setattr(ws_mod.Workspace, "get", get)
    return log


CONFIGS = {
    "auto": {},
    "enforce_eager": {"enforce_eager": True},
    "none": {"graph_backend": "none"},
    "recording": {"graph_backend": "recording"},
    # Graphs only up to 2: decode batches of 3-4 rows run eagerly.
    "recording_partial": {"graph_backend": "recording", "cuda_graph_sizes": [1, 2]},
    "chunked": {"graph_backend": "recording", "max_num_batched_tokens": 16},
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_engine_report_and_workspace(llama_path, monkeypatch, name):
    requests = _workspace_requests(monkeypatch)
    llm = LLM(llama_path, **{**ENGINE, **CONFIGS[name]})
    engine = llm.engine
    report = llm.startup_report()
    assert report is engine.startup.report
    assert engine.startup.ready
    assert report.state == "ready" and report.error is None
    assert [s.name for s in report.stages] == ORDER
    for s in report.stages:
        assert s.seconds >= 0 and s.memory_before >= 0 and s.memory_after >= 0
        assert s.workspace_bytes >= 0 and s.workspace_growths >= 0
    stages = {s.name: s for s in report.stages}

    capture = stages["capture"]
    if name == "auto":
        assert capture.skipped and "CUDA" in capture.note, capture.note
    elif name == "enforce_eager":
        assert capture.skipped and "enforce_eager" in capture.note, capture.note
    elif name == "none":
        assert capture.skipped
    else:
        assert not capture.skipped
        sizes = CONFIGS[name].get("cuda_graph_sizes", [1, 2, 4])
        assert report.captured_sizes == sorted(sizes)
        assert engine.runner.graphs is not None and engine.runner.graphs.sizes == sorted(sizes)
    if capture.skipped:
        assert report.captured_sizes == [] and engine.runner.graphs is None

    # The arena is sized by profile, never after KV sizing, and locked on every path.
    ws = engine.runner.workspace
    assert ws.locked
    assert report.workspace_growth_after_kv_sizing == 0
    assert stages["profile"].workspace_growths >= 1
    for late in ("size_kv", "warmup", "capture", "lock"):
        assert stages[late].workspace_growths == 0, late
    assert {g.stage for g in ws.stats.growths} == {"profile"}
    # Granule-independent: no request after profile asked more than profile did.
    peak_profile = max(n for stage, n in requests if stage == "profile")
    late = [(stage, n) for stage, n in requests if stage != "profile"]
    assert late and max(n for _, n in late) <= peak_profile, late
    assert ws.stats.largest_request_bytes == peak_profile

    table = report.table()
    assert isinstance(table, str)
    for stage_name in ORDER:
        assert stage_name in table
    assert "state=ready" in table

    # A short mixed workload after READY: still no growth, no JIT compile.
    growths, size = ws.stats.num_growths, ws.size
    params = [
        SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True),
        SamplingParams(temperature=0.9, top_k=5, seed=3, max_tokens=5, logprobs=2),
    ]
    prompts = [{"prompt_token_ids": list(range(3, 3 + n))} for n in (1, 5, 40, 100)]
    outs = llm.generate(prompts, [params[i % 2] for i in range(4)], use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [6, 5, 6, 5]
    stats = llm.stats()
    assert stats["jit_compiles_after_ready"] == 0
    assert stats["workspace_growths"] == ws.stats.num_growths == growths
    assert stats["workspace_bytes"] == ws.size == size
    assert stats["captured_graph_sizes"] == report.captured_sizes
    assert ws.locked


def test_engine_prints_startup_table(llama_path, capsys):
    LLM(llama_path, **{**ENGINE, "print_startup_report": True})
    err = capsys.readouterr().err
    for name in ORDER:
        assert name in err
    assert "state=ready" in err


def test_warmup_leaves_no_trace(llama_path, monkeypatch):
    """Right after startup: no cached block, every block free, stats zeroed,
    every KV value zero, no per-request state; and a warmup prompt submitted
    again gets no prefix-cache hit (a warmup block never serves one)."""
    from tinyengine.scheduling.scheduler import Scheduler

    warmup_prompts: list[list[int]] = []
    original = Scheduler.add_request

    def add_request(self, request):
        if request.request_id.startswith("warmup-"):
            warmup_prompts.append(list(request.prompt_token_ids))
        return original(self, request)

    monkeypatch.setattr(Scheduler, "add_request", add_request)
    # 64 tokens per step over 2 sequences: warmup prompts of 32 tokens (2 full blocks).
    llm = LLM(llama_path, **{**ENGINE, "max_num_seqs": 2})
    engine = llm.engine
    assert warmup_prompts, "warmup sent no requests through the scheduler"
    assert len(warmup_prompts[0]) >= 2 * engine.config.block_size

    bm = engine.scheduler.block_manager
    assert bm.cached == {}
    assert bm.num_free_blocks == bm.num_blocks
    assert all(b.ref_count == 0 and b.block_hash is None for b in bm.blocks)
    stats = llm.stats()
    assert stats["num_steps"] == 0
    assert stats["num_preemptions"] == 0
    assert stats["prefix_cache_hit_tokens"] == 0
    assert stats["prefix_cache_query_tokens"] == 0
    assert stats["num_running"] == 0 and stats["num_waiting"] == 0
    assert not engine.states and not engine.runner.request_sampling.generators
    assert not engine.has_unfinished_requests()
    for k_cache, v_cache in engine.runner.kv_caches:
        assert not k_cache.any() and not v_cache.any(), "the KV cache was not zeroed"

    # The proof by use: warmup's own prompt, submitted again, hits nothing...
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    (first,) = llm.generate([{"prompt_token_ids": warmup_prompts[0]}], params, use_tqdm=False)
    assert first.request_id == "0"  # ids restart after warmup
    assert first.num_cached_tokens == 0
    assert llm.stats()["prefix_cache_hit_tokens"] == 0
    # ...while the same prompt once served for real does hit (the control).
    (again,) = llm.generate([{"prompt_token_ids": warmup_prompts[0]}], params, use_tqdm=False)
    assert again.num_cached_tokens >= engine.config.block_size
    assert again.outputs[0].token_ids == first.outputs[0].token_ids


def test_recording_capture_only_writes_the_dummy_block(llama_path):
    """Capture runs the step on CPU; its padding rows may only touch the
    reserved dummy block, so every usable block is still zero at READY."""
    llm = LLM(llama_path, **{**ENGINE, "graph_backend": "recording"})
    runner = llm.engine.runner
    for k_cache, v_cache in runner.kv_caches:
        assert k_cache.shape[0] == runner.num_kv_blocks + 1
        assert not k_cache[: runner.num_kv_blocks].any()
        assert not v_cache[: runner.num_kv_blocks].any()


def test_num_kv_blocks_override(llama_path):
    llm = LLM(llama_path, **{**ENGINE, "num_kv_blocks": 13, "block_size": 8})
    engine = llm.engine
    assert llm.startup_report().num_kv_blocks == 13
    assert engine.runner.num_kv_blocks == 13
    assert engine.scheduler.block_manager.num_blocks == 13
    assert llm.stats()["num_total_blocks"] == 13
    # 13 usable blocks plus the reserved dummy one.
    assert engine.runner.kv_caches[0][0].shape[0] == 14
    notes = {s.name: s.note for s in llm.startup_report().stages}
    assert notes["size_kv"] == "13 blocks"


def test_small_num_kv_blocks_override_survives_warmup(llama_path):
    """An override smaller than warmup's default requests (here 1 block of 16
    tokens, while warmup sends 16-token prompts plus 3 decode steps) must not
    fail startup with an error about an internal 'warmup-0' request: warmup
    has to fit its traffic to the cache it was given."""
    llm = LLM(llama_path, **{**ENGINE, "num_kv_blocks": 1})
    assert llm.startup_report().state == "ready"
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    (out,) = llm.generate([{"prompt_token_ids": [5, 6, 7]}], params, use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 4


def test_cpu_budget_sizes_kv(llama_path):
    """Without the override, CPU KV sizing comes from cpu_kv_cache_gib, capped
    at what max_num_seqs full-length sequences can use."""
    llm = LLM(llama_path, **ENGINE)
    runner = llm.engine.runner
    cap = ENGINE["max_num_seqs"] * runner.max_blocks_per_seq
    assert llm.startup_report().num_kv_blocks == cap
    small = LLM(
        llama_path, **{**ENGINE, "cpu_kv_cache_gib": 20 * runner.kv_bytes_per_block() / 2**30}
    )
    assert small.startup_report().num_kv_blocks == 20


def test_kv_budget_too_small_fails_loudly(llama_path, monkeypatch):
    """A budget that cannot hold one max_model_len sequence: a ValueError naming
    max_model_len and the budget, and the machine left FAILED holding it."""
    import tinyengine.engine as engine_mod

    machines: list[StartupMachine] = []

    class Recorded(StartupMachine):
        def __init__(self, stages) -> None:
            super().__init__(stages)
            machines.append(self)

    monkeypatch.setattr(engine_mod, "StartupMachine", Recorded)
    with pytest.raises(ValueError) as info:
        LLM(llama_path, **{**ENGINE, "cpu_kv_cache_gib": 1e-6})
    msg = str(info.value)
    assert "max_model_len=128" in msg, msg
    assert "cpu_kv_cache_gib" in msg, msg
    (machine,) = machines
    assert machine.state == Stage.FAILED
    assert machine.error is info.value
    assert machine.report.state == "failed"
    assert machine.report.error.startswith("size_kv: ValueError")
    assert [s.name for s in machine.report.stages] == ["load", "profile"]
    with pytest.raises(StartupOrderError):
        machine.warmup()
