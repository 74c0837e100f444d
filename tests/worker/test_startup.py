"""The startup state machine (tinyengine/worker/startup.py) against fake
stages that record what they are asked to do. The real stages
(tinyengine/worker/stages.py) and engine on a tiny random Llama (CPU) are
tested in test_startup_engine.py.

Fake stages: every out-of-order transition, from every state, raises
StartupOrderError naming the stage it needs and changes nothing; a stage that
raises lands the machine in FAILED with its error kept; the report lists the
stages in order with non-negative figures; capture returning None is recorded
as skipped; each stage's result is handed to the next as an argument; each
stage logs one line as it begins and one as it ends (logger
"tinyengine.startup"), with its seconds and what it decided.
"""

from __future__ import annotations

import logging

import pytest

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


class FakeStages:
    """Stages that record every call; `fail` names a stage that raises."""

    def __init__(self, fail: str | None = None, capture_sizes: list[int] | None = None):
        self.fail = fail
        self.capture_sizes = capture_sizes
        self.piecewise_sizes = [512, 8]
        self.calls: list[str] = []
        self.stages_set: list[str] = []
        self.capture_skip_reason = "fake: no graphs"
        self._ws_bytes = 0
        self._ws_growths = 0
        self._memory = 1000
        self.ended = False  # shutdown() was called

    # --- the probes the machine reads around each stage ---
    def workspace_bytes(self) -> int:
        return self._ws_bytes

    def workspace_growths(self) -> int:
        return self._ws_growths

    def memory_in_use(self) -> int:
        return self._memory

    def set_stage(self, name: str) -> None:
        self.stages_set.append(name)

    def shutdown(self) -> None:
        self.ended = True

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

    def capture(self) -> dict[str, list[int]] | None:
        self._do("capture")
        if self.capture_sizes is None:
            return None
        return {"full": self.capture_sizes, "piecewise": self.piecewise_sizes}

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
    assert target.ended  # what the stages started (worker processes) is ended

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
    assert report.piecewise_sizes == [512, 8]
    assert report.workspace_bytes_at_kv_sizing == 2 * MIB
    assert report.workspace_growth_after_kv_sizing == 0
    assert by_name["capture"].note == "4 full, 2 piecewise"
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


class _Times:
    """The part of Triton's CompileTimes the listener reads (microseconds)."""

    def __init__(self, total: int) -> None:
        self.total = total


def test_triton_kernels_and_compile_seconds_are_reported_per_stage(caplog):
    """Each stage's record counts (and names) the kernel variants built or
    loaded during it and the seconds of those the on-disk cache missed; the log line says
    so. (The counters are process-wide: the machine takes differences.)"""
    from tinyengine.kernels import jit_monitor

    class Compiling(FakeStages):
        def profile(self) -> ProfileResult:
            for total_us, hit in ((1_500_000, False), (500_000, False), (9_000_000, True)):
                jit_monitor._on_compile(repr="k")
                jit_monitor._on_listen(times=_Times(total_us), cache_hit=hit)
            return super().profile()

        def warmup(self, num_kv_blocks: int) -> None:
            jit_monitor._on_compile(repr="late[(*bf16, i32)]")
            jit_monitor._on_listen(times=_Times(250_000), cache_hit=False)
            super().warmup(num_kv_blocks)

    with caplog.at_level(logging.INFO, logger="tinyengine.startup"):
        report = StartupMachine(Compiling()).run_all()
    by_name = {s.name: s for s in report.stages}
    assert by_name["profile"].kernels == 3
    assert by_name["profile"].compile_seconds == pytest.approx(2.0)  # the hit costs nothing
    assert by_name["warmup"].kernels == 1
    assert by_name["warmup"].compile_seconds == pytest.approx(0.25)
    # Which variants: Triton's names for them, so a late one can be found.
    assert by_name["profile"].kernel_variants == ["k"] * 3
    assert by_name["warmup"].kernel_variants == ["late[(*bf16, i32)]"]
    for name in ("load", "size_kv", "capture", "lock"):
        assert by_name[name].kernels == 0 and by_name[name].compile_seconds == 0.0
        assert by_name[name].kernel_variants == []
    assert "compile s" in report.table()
    done = [r.getMessage() for r in caplog.records if "profile: done" in r.getMessage()]
    assert done and "3 Triton kernels (2.0 s compiling)" in done[0]


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
# Progress: one log line as each stage begins and ends, from the machine.
# --------------------------------------------------------------------------


def _startup_lines(caplog) -> list[tuple[int, str]]:
    return [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "tinyengine.startup"]


@pytest.mark.parametrize("capture_sizes", [None, [4, 2, 1]], ids=["skipped", "captured"])
def test_each_stage_logs_its_start_and_end_in_order(caplog, capture_sizes):
    caplog.set_level(logging.INFO, logger="tinyengine.startup")
    StartupMachine(FakeStages(capture_sizes=capture_sizes)).run_all()
    lines = _startup_lines(caplog)
    assert all(level == logging.INFO for level, _ in lines)
    messages = [m for _, m in lines]
    assert len(messages) == 2 * len(ORDER), messages
    for k, name in enumerate(ORDER):
        start, end = messages[2 * k], messages[2 * k + 1]
        prefix = f"startup [{k + 1}/{len(ORDER)}] {name}: "
        assert start == prefix + "started", start
        assert end.startswith(prefix + "done in ") and " s" in end, end
    done = {name: messages[2 * k + 1] for k, name in enumerate(ORDER)}
    # What each stage decided is on its line.
    assert "77 KV blocks" in done["size_kv"]
    assert "peak 0.0 MiB" in done["profile"]  # the fake's 12345 bytes
    if capture_sizes is None:
        assert "graphs skipped: fake: no graphs" in done["capture"]
    else:
        decided = "captured 3 decode graphs, sizes [4, 2, 1]; piecewise token counts [512, 8]"
        assert decided in done["capture"]
    assert "workspace locked at 2.0 MiB" in done["lock"] and "READY after" in done["lock"]


def test_a_failing_stage_logs_its_error_and_no_end(caplog):
    caplog.set_level(logging.INFO, logger="tinyengine.startup")
    machine = StartupMachine(FakeStages(fail="warmup"))
    with pytest.raises(RuntimeError):
        machine.run_all()
    lines = _startup_lines(caplog)
    level, last = lines[-1]
    assert level == logging.ERROR
    assert last.startswith("startup [4/6] warmup: failed after ")
    assert "RuntimeError: boom in warmup" in last
    assert [m for _, m in lines[:-1]][-1] == "startup [4/6] warmup: started"
    assert not any("warmup: done" in m for _, m in lines)
