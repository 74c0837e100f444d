"""The startup state machine: load -> profile -> size KV -> warmup -> capture -> lock.

Owns the ORDER of startup, the hand-over of each stage's result to the next,
and the report. The work of each stage is done by a `StartupStages` object
(tinyengine/worker/stages.py for the real one; tests pass a fake). The
machine must never let a stage run out of order, and never swallow a failure.

    CREATED -> LOADED -> PROFILED -> KV_READY -> WARM -> CAPTURED -> READY
       load      profile    size_kv    warmup    capture     lock
    any stage that raises -> FAILED (holding the error)

Results flow through the machine, one stage to the next: profile returns a
`ProfileResult`, which size_kv receives and turns into a number of KV blocks,
which warmup receives (it sizes its traffic to that cache). After READY the
machine holds what an engine is built from: the stages' runner and
`report.num_kv_blocks`.

Why this order (see docs/startup.md): a CUDA graph bakes in the addresses of
every buffer it touches, the shared workspace arena included. Profiling sizes
the arena for the worst step before KV sizing (so the KV budget accounts for
it); warmup runs every shape that will be captured (a smaller batch may want
more scratch) so capture itself allocates nothing new; locking after capture
turns any later growth — which would free memory the graphs still use — into a
WorkspaceLockedError instead of silent corruption.
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

from tinyengine.config import EngineConfig
from tinyengine.kernels import jit_monitor
from tinyengine.worker.stages import StartupStages

# One line as each stage begins and one as it ends (seconds, what it decided),
# so a slow start is never silent. INFO level: shown wherever the application
# shows INFO logs (e.g. logging.basicConfig(level=logging.INFO)).
log = logging.getLogger("tinyengine.startup")


def show_progress() -> None:
    """Print the startup lines on stderr: the demo and the server call this (a
    library user configures logging as they like). Idempotent."""
    if not log.handlers:
        log.setLevel(logging.INFO)
        log.addHandler(logging.StreamHandler())


class Stage(enum.Enum):
    CREATED = "created"
    LOADED = "loaded"
    PROFILED = "profiled"
    KV_READY = "kv_ready"
    WARM = "warm"
    CAPTURED = "captured"
    READY = "ready"
    FAILED = "failed"


class StartupOrderError(RuntimeError):
    """A startup transition was called out of order."""


# transition name -> (state it needs, state it reaches)
TRANSITIONS: dict[str, tuple[Stage, Stage]] = {
    "load": (Stage.CREATED, Stage.LOADED),
    "profile": (Stage.LOADED, Stage.PROFILED),
    "size_kv": (Stage.PROFILED, Stage.KV_READY),
    "warmup": (Stage.KV_READY, Stage.WARM),
    "capture": (Stage.WARM, Stage.CAPTURED),
    "lock": (Stage.CAPTURED, Stage.READY),
}
_NEEDS = {after: name for name, (_, after) in TRANSITIONS.items()}


class Profiled(Protocol):
    """What profile hands to size_kv (worker/stages.py's ProfileResult)."""

    @property
    def peak_bytes(self) -> int: ...


class Stages(Protocol):
    """What the machine drives: one method per stage, plus the probes it reads
    around each stage for the report."""

    capture_skip_reason: str  # why capture() returned None

    def load(self) -> None: ...
    def profile(self) -> Profiled: ...
    def size_kv(self, profile: Any) -> int: ...  # profile's result -> usable KV blocks
    def warmup(self, num_kv_blocks: int) -> None: ...
    # {"full": decode sizes, "piecewise": token counts}; None = skipped
    def capture(self) -> dict[str, list[int]] | None: ...
    def lock(self) -> None: ...
    def shutdown(self) -> None: ...  # ends what the stages started (worker processes)
    def set_stage(self, name: str) -> None: ...  # tells the workspace who is growing it
    def workspace_bytes(self) -> int: ...
    def workspace_growths(self) -> int: ...
    def memory_in_use(self) -> int: ...


@dataclass
class StageRecord:
    name: str
    seconds: float
    memory_before: int
    memory_after: int
    workspace_bytes: int
    workspace_growths: int  # growths during this stage
    skipped: bool = False
    note: str = ""
    # Triton kernel variants this stage built or loaded in this process (on
    # rank 0 with several ranks), and the seconds spent compiling those the
    # on-disk cache did not have (kernels/jit_monitor.py; 0 without Triton).
    kernels: int = 0
    compile_seconds: float = 0.0
    # Those variants as Triton names them (kernel and specialization): which
    # shape classes a stage met first (after profile: ones its forwards missed).
    kernel_variants: list[str] = field(default_factory=list)


@dataclass
class StartupReport:
    state: str = Stage.CREATED.value
    stages: list[StageRecord] = field(default_factory=list)
    profiled_peak_bytes: int = 0
    num_kv_blocks: int = 0
    captured_sizes: list[int] = field(default_factory=list)  # full decode graphs
    piecewise_sizes: list[int] = field(default_factory=list)  # prefill/mixed token counts
    workspace_bytes_at_kv_sizing: int = 0
    workspace_growth_after_kv_sizing: int = 0  # bytes; 0 when profile reached the worst case
    error: str | None = None
    # With several tensor-parallel ranks: every rank's record of each stage
    # method it ran (worker/lockstep.py's RankStage, as dicts).
    ranks: list[dict[str, Any]] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def table(self) -> str:
        mib = 2**20
        lines = [
            f"{'stage':<9} {'seconds':>8} {'mem before':>11} {'mem after':>10} "
            f"{'workspace':>10} {'growths':>7} {'kernels':>7} {'compile s':>9}  note",
        ]
        for s in self.stages:
            note = "skipped: " + s.note if s.skipped else s.note
            lines.append(
                f"{s.name:<9} {s.seconds:>8.3f} {s.memory_before / mib:>8.1f}MiB "
                f"{s.memory_after / mib:>7.1f}MiB {s.workspace_bytes / mib:>7.2f}MiB "
                f"{s.workspace_growths:>7} {s.kernels:>7} {s.compile_seconds:>9.2f}  {note}"
            )
        lines.append(
            f"state={self.state} kv_blocks={self.num_kv_blocks} "
            f"captured={self.captured_sizes or 'none'} "
            f"piecewise={self.piecewise_sizes or 'none'} "
            f"workspace_growth_after_kv_sizing={self.workspace_growth_after_kv_sizing}B"
        )
        by_rank: dict[int, list[str]] = {}
        for r in self.ranks:
            value = f"={r['value']}" if r["value"] is not None else ""
            by_rank.setdefault(r["rank"], []).append(f"{r['name']}{value} {r['seconds']:.3f}s")
        for rank, stages in by_rank.items():
            last = [r for r in self.ranks if r["rank"] == rank][-1]
            lines.append(f"rank {rank}: " + ", ".join(stages)
                         + f"; memory {last['memory_after'] / mib:.1f}MiB")  # fmt: skip
        if self.error:
            lines.append(f"error: {self.error}")
        return "\n".join(lines)


class StartupMachine:
    def __init__(self, stages: Stages) -> None:
        self.stages = stages
        self.state = Stage.CREATED
        self.error: BaseException | None = None
        self.report = StartupReport()
        self.running: str | None = None  # the transition in progress ("profile", ...), if any
        self.profile_result: Profiled | None = None  # profile's result, for size_kv

    @classmethod
    def for_config(cls, config: EngineConfig) -> StartupMachine:
        """A machine at CREATED over the real stages for `config` (resolved in
        place for its model and device; nothing is loaded yet). With
        tensor_parallel_size > 1 every stage runs on every rank in lockstep
        (worker/lockstep.py); the worker processes start in `load`."""
        stages = StartupStages.for_config(config)
        if config.tensor_parallel_size > 1:
            from tinyengine.worker.lockstep import LockstepStages
            from tinyengine.worker.worker_group import WorkerGroup

            return cls(LockstepStages(stages, WorkerGroup(config)))
        return cls(stages)

    # --- the transitions, one method each ---

    def load(self) -> None:
        self._run("load", self.stages.load)

    def profile(self) -> None:
        def work() -> str:
            self.profile_result = self.stages.profile()
            self.report.profiled_peak_bytes = self.profile_result.peak_bytes
            return f"peak {self.report.profiled_peak_bytes / 2**20:.1f} MiB"

        self._run("profile", work)

    def size_kv(self) -> None:
        def work() -> str:
            self.report.num_kv_blocks = self.stages.size_kv(self.profile_result)
            self.report.workspace_bytes_at_kv_sizing = self.stages.workspace_bytes()
            return f"{self.report.num_kv_blocks} blocks"

        self._run("size_kv", work)

    def warmup(self) -> None:
        self._run("warmup", lambda: self.stages.warmup(self.report.num_kv_blocks))

    def capture(self) -> None:
        def work() -> str | None:
            sizes = self.stages.capture()
            if sizes is None:
                return None
            self.report.captured_sizes = list(sizes["full"])
            self.report.piecewise_sizes = list(sizes["piecewise"])
            # The sizes themselves are in the report.
            return f"{len(sizes['full'])} full, {len(sizes['piecewise'])} piecewise"

        self._run("capture", work)

    def lock(self) -> None:
        def work() -> str:
            self.stages.lock()
            growth = self.stages.workspace_bytes() - self.report.workspace_bytes_at_kv_sizing
            self.report.workspace_growth_after_kv_sizing = growth
            return "workspace locked"

        self._run("lock", work)

    def run_all(self) -> StartupReport:
        for name in TRANSITIONS:
            getattr(self, name)()
        return self.report

    @property
    def ready(self) -> bool:
        return self.state == Stage.READY

    # --- machinery ---

    def _run(self, name: str, work: Callable[[], str | None]) -> None:
        needed, reached = TRANSITIONS[name]
        if self.state == Stage.FAILED:
            raise StartupOrderError(
                f"startup failed earlier ({self.error!r}); {name}() cannot run on a FAILED machine"
            )
        if self.state != needed:
            how = f"reached by {_NEEDS[needed]}()" if needed in _NEEDS else "a fresh machine"
            raise StartupOrderError(
                f"{name}() needs stage {needed.name} ({how}), but the machine is "
                f"at {self.state.name}"
            )
        stages = self.stages
        stages.set_stage(name)
        growths_before = stages.workspace_growths()
        memory_before = stages.memory_in_use()
        kernels_before = jit_monitor.num_compiles()
        compile_before = jit_monitor.compile_seconds()
        step = f"startup [{list(TRANSITIONS).index(name) + 1}/{len(TRANSITIONS)}] {name}"
        log.info("%s: started", step)
        start = time.perf_counter()
        self.running = name
        try:
            result = work()
        except BaseException as exc:
            self.running = None
            log.error(
                "%s: failed after %.2f s: %s: %s",
                step, time.perf_counter() - start, type(exc).__name__, exc,
            )  # fmt: skip
            self.state = Stage.FAILED
            self.error = exc
            self.report.state = Stage.FAILED.value
            self.report.error = f"{name}: {type(exc).__name__}: {exc}"
            stages.shutdown()  # a FAILED machine goes no further: end what the stages started
            raise
        self.running = None
        rank_records = getattr(stages, "rank_records", None)  # several ranks only
        if rank_records is not None:
            self.report.ranks = rank_records()
        skipped = name == "capture" and result is None
        self.report.stages.append(
            StageRecord(
                name=name,
                seconds=time.perf_counter() - start,
                memory_before=memory_before,
                memory_after=stages.memory_in_use(),
                workspace_bytes=stages.workspace_bytes(),
                workspace_growths=stages.workspace_growths() - growths_before,
                skipped=skipped,
                note=stages.capture_skip_reason if skipped else result or "",
                kernels=jit_monitor.num_compiles() - kernels_before,
                compile_seconds=jit_monitor.compile_seconds() - compile_before,
                kernel_variants=jit_monitor.compiled_since(kernels_before),
            )
        )
        self.state = reached
        self.report.state = reached.value
        stages.set_stage("serving" if reached == Stage.READY else f"after_{name}")
        log.info("%s: done in %.2f s%s", step, self.report.stages[-1].seconds, self._decided(name))

    def _decided(self, name: str) -> str:
        """What the stage just recorded decided, for its log line, and the
        Triton kernels it compiled, if any."""
        record, report = self.report.stages[-1], self.report
        if name == "size_kv":
            text = f"; {report.num_kv_blocks} KV blocks"
        elif name == "capture" and record.skipped:
            text = f"; graphs skipped: {record.note}"
        elif name == "capture":
            text = (f"; captured {len(report.captured_sizes)} decode graphs, sizes "
                    f"{report.captured_sizes}; piecewise token counts "
                    f"{report.piecewise_sizes or 'none'}")  # fmt: skip
        elif name == "lock":
            total = sum(s.seconds for s in report.stages)
            text = (
                f"; workspace locked at {record.workspace_bytes / 2**20:.1f} MiB, "
                f"growth after KV sizing {report.workspace_growth_after_kv_sizing} B; "
                f"READY after {total:.2f} s"
            )
        else:
            text = f"; {record.note}" if record.note else ""
        if record.kernels:
            text += f"; {record.kernels} Triton kernels ({record.compile_seconds:.1f} s compiling)"
        return text
