"""The startup machine's stages run on every tensor-parallel rank in lockstep.

Owns, on rank 0, `LockstepStages`: the object the StartupMachine drives when
tensor_parallel_size > 1. Each stage is sent to the worker ranks as a
command and run by rank 0's own StartupStages; then the ranks exchange their
results (a gloo all-gather of small objects), so all agree on what happened
before anyone moves on: KV sizing takes the minimum of the ranks' block
counts (each measured its own memory) and every rank allocates that many;
capture must record the same graph sizes everywhere; each rank sizes its KV
cache from its own profile, whose result travels to rank 0 and back.

A stage that fails on ANY rank fails startup on ALL ranks, with the failing
rank's error in the message (and so in the startup report), and no rank is
left hanging. A failure can strike in the middle of a stage's collectives
(warmup's forwards all-reduce), where the other ranks wait for a peer that
will never come; so a failing worker does not report back, it exits
(worker/worker_main.py), which breaks every collective it was part of
on the other ranks, and rank 0, failing itself or seeing a worker go, kills
the rest.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Any

from tinyengine.worker.stages import ProfileResult, StartupStages
from tinyengine.worker.worker_group import EngineDeadError, RankFailedError


@dataclass
class RankProfiles:
    """Every rank's ProfileResult (index = rank); what profile hands to size_kv."""

    per_rank: list[ProfileResult]

    @property
    def peak_bytes(self) -> int:
        return max(p.peak_bytes for p in self.per_rank)


@dataclass
class RankStage:
    """One stage method as one rank ran it, for the startup report."""

    rank: int
    name: str
    seconds: float
    memory_after: int
    workspace_bytes: int
    value: Any = None  # the method's result if a number or sizes (plan_kv's, capture's dict)


def run_stage(stages: StartupStages, rank: int, name: str, args: tuple) -> tuple[Any, RankStage]:
    """Run one stage's method on this rank; its result and its record."""
    stages.set_stage(name)
    start = time.perf_counter()
    if name == "plan_kv":  # this rank's own profile
        value = stages.plan_kv(args[0].per_rank[rank])
    else:
        value = getattr(stages, name)(*args)
    seconds = time.perf_counter() - start
    memory, workspace = stages.memory_in_use(), stages.workspace_bytes()
    shown = value if isinstance(value, (int, list, dict)) else None
    record = RankStage(rank, name, seconds, memory, workspace, shown)
    return value, record


class LockstepStages:
    """The Stages protocol (worker/startup.py) over all ranks; rank 0's own
    StartupStages does rank 0's share and answers the report's probes."""

    def __init__(self, local: StartupStages, workers: Any) -> None:
        self.local = local
        self.workers = workers  # worker/worker_group.py's WorkerGroup
        self.records: list[RankStage] = []  # every rank's, in the order they ran

    @property
    def runner(self) -> Any:
        return self.local.runner

    @property
    def capture_skip_reason(self) -> str:
        return self.local.capture_skip_reason

    # --- the stages ---

    def load(self) -> None:
        self.workers.start()  # the processes and the process groups, then the weights
        self._everywhere("load")

    def profile(self) -> RankProfiles:
        return RankProfiles(self._everywhere("profile"))

    def size_kv(self, profiles: RankProfiles) -> int:
        num_blocks = min(self._everywhere("plan_kv", profiles))
        self._everywhere("allocate_kv", num_blocks)
        return num_blocks

    def warmup(self, num_kv_blocks: int) -> None:
        self._everywhere("warmup", num_kv_blocks)

    def capture(self) -> dict[str, list[int]] | None:
        sizes = self._everywhere("capture")
        if any(s != sizes[0] for s in sizes):  # a bug, not a user error
            self.workers.shutdown(kill=True)
            raise RankFailedError(f"the ranks captured different graph sizes: {sizes}")
        return sizes[0]

    def lock(self) -> None:
        self._everywhere("lock")
        # READY from here on: every step goes to the workers first.
        self.local.runner.peers = self.workers

    def shutdown(self) -> None:
        self.local.shutdown()
        self.workers.shutdown()

    def rank_records(self) -> list[dict[str, Any]]:
        """Every rank's stage records (StartupReport.ranks)."""
        return [asdict(r) for r in self.records]

    # --- the probes (rank 0's; the report is rank 0's) ---

    def set_stage(self, name: str) -> None:
        self.local.set_stage(name)

    def workspace_bytes(self) -> int:
        return self.local.workspace_bytes()

    def workspace_growths(self) -> int:
        return self.local.workspace_growths()

    def memory_in_use(self) -> int:
        return self.local.memory_in_use()

    def _everywhere(self, name: str, *args: Any) -> list[Any]:
        """Run stage method `name` on every rank; their results in rank order."""
        workers = self.workers
        try:
            workers.send(("stage", name, args))
            results = workers.exchange(run_stage(self.local, 0, name, args))
        except Exception as exc:
            # A worker that failed has exited (and broken our collectives); if
            # none did, the failure is rank 0's own and the workers, maybe
            # waiting inside a collective for it, are killed.
            failed = workers.exit_errors()
            workers.shutdown(kill=True)
            if isinstance(exc, EngineDeadError) or failed:
                raise RankFailedError("; ".join(failed) or str(exc)) from exc
            raise RankFailedError(f"rank 0: {type(exc).__name__}: {exc}") from exc
        self.records += [record for _, record in results]
        return [value for value, _ in results]
