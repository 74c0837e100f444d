"""The startup state machine (tinyengine/worker/startup.py), first against
fake stages that record what they are asked to do, then through the real
stages (tinyengine/worker/stages.py) and engine on a tiny random Llama (CPU).

Fake stages: every out-of-order transition, from every state, raises
StartupOrderError naming the stage it needs and changes nothing; a stage that
raises lands the machine in FAILED with its error kept; the report lists the
stages in order with non-negative figures; capture returning None is recorded
as skipped; each stage's result is handed to the next as an argument.

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
from tinyengine.worker.stages import ProfileResult
from tinyengine.worker.startup import (
    TRANSITIONS,
    Stage,
    StartupMachine,
    StartupOrderError,
)

ORDER = list(TRANSITIONS)  # load, profile, size_kv, warmup, capture, lock
REACHED = [Stage.CREATED] + [TRANSITIONS[name][1] for name in ORDER]  # state after k stages
MIB = 1 << 20


@pytest.fixture(scope="module", autouse=True)
def _one_torch_thread():
    """Tiny tensors gain nothing from threads, and on a loaded machine
    OpenMP's spinning threads make each op ~30x slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


class FakeStages:
    """Stages that record every call; `fail` names a stage that raises."""

    def __init__(self, fail: str | None = None, capture_sizes: list[int] | None = None):
        self.fail = fail
        self.capture_sizes = capture_sizes
        self.calls: list[str] = []
        self.stages_set: list[str] = []
        self.capture_skip_reason = "fake: no graphs"
        self._ws_bytes = 0
        self._ws_growths = 0
        self._memory = 1000

    # --- the probes the machine reads around each stage ---
    def workspace_bytes(self) -> int:
        return self._ws_bytes

    def workspace_growths(self) -> int:
        return self._ws_growths

    def memory_in_use(self) -> int:
        return self._memory

    def set_stage(self, name: str) -> None:
        self.stages_set.append(name)

    # --- the stages ---
    def _do(self, name: str) -> None:
        self.calls.append(name)
        self._memory += 100
        if self.fail == name:
            raise RuntimeError(f"boom in {name}")

    def load(self) -> None:
        self._do("load")

    def profile(self) -> ProfileResult:
        self._do("profile")
        self._ws_bytes, self._ws_growths = 2 * MIB, self._ws_growths + 2
        self.profiled = ProfileResult(peak_bytes=12345, decode_peak_bytes=345)
        return self.profiled

    def size_kv(self, profile: ProfileResult) -> int:
        self._do("size_kv")
        assert profile is self.profiled  # the machine hands profile's result over
        return 77

    def warmup(self, num_kv_blocks: int) -> None:
        self._do("warmup")
        assert num_kv_blocks == 77  # ...and size_kv's

    def capture(self) -> list[int] | None:
        self._do("capture")
        return self.capture_sizes

    def lock(self) -> None:
        self._do("lock")


def _machine_at(k: int, **target_kwargs) -> StartupMachine:
    """A machine that ran the first k stages, in order."""
    machine = StartupMachine(FakeStages(**target_kwargs))
    for name in ORDER[:k]:
        getattr(machine, name)()
    assert machine.state == REACHED[k]
    return machine


def test_wrong_pairs_cover_every_state_and_transition():
    assert len(WRONG) == len(ORDER) * (len(ORDER) + 1) - len(ORDER)


def test_right_order_reaches_ready():
    target = FakeStages(capture_sizes=[8, 4, 2, 1])
    machine = StartupMachine(target)
    assert machine.state == Stage.CREATED and not machine.ready
    for k, name in enumerate(ORDER, start=1):
        getattr(machine, name)()
        assert machine.state == REACHED[k]
        assert machine.report.state == REACHED[k].value
    assert machine.ready and machine.state == Stage.READY
    assert machine.error is None and machine.report.error is None
    assert target.calls == ORDER
    # The workspace learns the stage before each one runs, and "serving" at the end.
    expected = [s for name in ORDER for s in (name, f"after_{name}")]
    assert target.stages_set == expected[:-1] + ["serving"]


def test_run_all_equals_stepwise():
    report = StartupMachine(FakeStages(capture_sizes=[1, 2])).run_all()
    assert report.state == "ready"
    assert [s.name for s in report.stages] == ORDER


# Every (transition, state) pair except the six right ones: 6 * 7 - 6 = 36.
WRONG = [(name, done) for done in range(len(ORDER) + 1) for name in ORDER
         if ORDER[done : done + 1] != [name]]  # fmt: skip


@pytest.mark.parametrize(
    ("name", "done"), WRONG, ids=[f"{name}-at-{REACHED[done].name}" for name, done in WRONG]
)
def test_every_out_of_order_transition_raises(name, done):
    """From the state reached after `done` stages, every transition but the
    next one raises, names the stage it needs, and changes nothing."""
    machine = _machine_at(done, capture_sizes=[1])
    target = machine.stages
    calls, stages_set = list(target.calls), list(target.stages_set)
    num_records = len(machine.report.stages)
    needed, _ = TRANSITIONS[name]

    with pytest.raises(StartupOrderError) as info:
        getattr(machine, name)()
    msg = str(info.value)
    assert f"{name}()" in msg, msg
    assert needed.name in msg, msg  # the stage it needs...
    assert REACHED[done].name in msg, msg  # ...and where the machine is
    if needed != Stage.CREATED:
        # ...and which transition must come first.
        assert f"reached by {ORDER[ORDER.index(name) - 1]}()" in msg, msg

    # A wrong call is not a failure: nothing ran, nothing was recorded.
    assert machine.state == REACHED[done]
    assert machine.error is None and machine.report.error is None
    assert target.calls == calls and target.stages_set == stages_set
    assert len(machine.report.stages) == num_records
    # ...and the right order still works from here.
    for next_name in ORDER[done:]:
        getattr(machine, next_name)()
    assert machine.ready


@pytest.mark.parametrize("failing", ORDER)
def test_failing_stage_lands_in_failed_with_its_error(failing):
    target = FakeStages(fail=failing, capture_sizes=[1])
    machine = StartupMachine(target)
    k = ORDER.index(failing)
    for name in ORDER[:k]:
        getattr(machine, name)()
    with pytest.raises(RuntimeError, match=f"boom in {failing}") as info:
        getattr(machine, failing)()
    assert machine.state == Stage.FAILED and not machine.ready
    assert machine.error is info.value  # the very exception, kept
    report = machine.report
    assert report.state == "failed"
    assert report.error is not None
    assert report.error.startswith(f"{failing}:"), report.error
    assert "RuntimeError" in report.error and f"boom in {failing}" in report.error
    assert [s.name for s in report.stages] == ORDER[:k]  # the failed one is not a success
    assert "error:" in report.table() and f"boom in {failing}" in report.table()

    # Every later call, the failed stage included, is refused without running.
    calls = list(target.calls)
    for name in ORDER:
        with pytest.raises(StartupOrderError, match="FAILED"):
            getattr(machine, name)()
    assert target.calls == calls
    assert machine.state == Stage.FAILED and machine.error is info.value


def test_failure_keeps_non_exception_base_errors_too():
    """A KeyboardInterrupt in a stage must not leave the machine mid-stage."""

    class Interrupting(FakeStages):
        def warmup(self, num_kv_blocks: int) -> None:
            raise KeyboardInterrupt

    machine = StartupMachine(Interrupting())
    with pytest.raises(KeyboardInterrupt):
        machine.run_all()
    assert machine.state == Stage.FAILED
    assert isinstance(machine.error, KeyboardInterrupt)


def test_report_lists_stages_in_order_with_non_negative_figures():
    machine = StartupMachine(FakeStages(capture_sizes=[8, 4, 2, 1]))
    report = machine.run_all()
    assert [s.name for s in report.stages] == ORDER
    for s in report.stages:
        assert s.seconds >= 0
        assert s.memory_before >= 0 and s.memory_after >= 0
        assert s.workspace_bytes >= 0 and s.workspace_growths >= 0
        assert not s.skipped
    by_name = {s.name: s for s in report.stages}
    assert by_name["profile"].workspace_growths == 2
    assert by_name["profile"].workspace_bytes == 2 * MIB
    assert all(by_name[n].workspace_growths == 0 for n in ORDER if n != "profile")
    # memory_before/after bracket each stage (the fake adds 100 per stage).
    for s in report.stages:
        assert s.memory_after - s.memory_before == 100
    assert report.profiled_peak_bytes == 12345
    assert report.num_kv_blocks == 77
    assert report.captured_sizes == [8, 4, 2, 1]
    assert report.workspace_bytes_at_kv_sizing == 2 * MIB
    assert report.workspace_growth_after_kv_sizing == 0
    assert by_name["capture"].note == "4 graphs"
    d = report.as_dict()
    assert d["state"] == "ready" and [s["name"] for s in d["stages"]] == ORDER
    table = report.table()
    for name in ORDER:
        assert name in table
    assert "state=ready" in table and "kv_blocks=77" in table


def test_workspace_growth_after_kv_sizing_is_reported():
    class LateGrowth(FakeStages):
        def warmup(self, num_kv_blocks: int) -> None:
            super().warmup(num_kv_blocks)
            self._ws_bytes += MIB
            self._ws_growths += 1

    report = StartupMachine(LateGrowth()).run_all()
    assert report.workspace_growth_after_kv_sizing == MIB
    assert {s.name: s.workspace_growths for s in report.stages}["warmup"] == 1


def test_capture_returning_none_is_recorded_as_skipped():
    report = StartupMachine(FakeStages(capture_sizes=None)).run_all()
    assert report.state == "ready"
    capture = report.stages[ORDER.index("capture")]
    assert capture.skipped
    assert capture.note == "fake: no graphs"
    assert report.captured_sizes == []
    assert "skipped: fake: no graphs" in report.table()
    assert all(not s.skipped for s in report.stages if s.name != "capture")


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
