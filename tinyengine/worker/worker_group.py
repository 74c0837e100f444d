"""WorkerGroup: rank 0's handle on the other tensor-parallel ranks.

Owns the worker processes (one per rank 1..N-1, each `python -m
tinyengine.worker.worker_main`), the process groups, the messages rank
0 sends them, and their end. Two groups, as vLLM and mini-sglang have them:

- the *device group* (NCCL between GPUs, gloo between CPU processes) carries
  tensors: the model's all-reduces and all-gathers (distributed/tp.py), and
  the sampled token ids rank 0 shares after each step;
- the *metadata group* (always gloo) carries pickled commands — a startup
  stage, a step's StepInputs, shutdown — and the stages' outcomes. Its
  timeout is effectively infinite, because an idle server leaves its workers
  waiting for the next command for as long as nobody sends a request.

Workers are separate interpreters started with `-m` (not multiprocessing's
spawn, which re-runs the user's main module in every child). A worker that
fails while serving writes its error to a file and exits; a monitor thread
here notices any worker's exit, and from then on the engine is dead: the
next (or current) step raises EngineDeadError with that worker's error, and
`shutdown()` ends every process. Workers end themselves when rank 0 goes
away (they watch their parent).
"""

from __future__ import annotations

import os
import pickle
import socket
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from tinyengine.config import EngineConfig
from tinyengine.distributed.tp import init_tp

# The device group's collectives (a step's all-reduces; a startup stage's
# work happens between exchanges, not inside one): long enough for a slow
# stage on another rank, short enough that a stuck peer ends in an error.
COLLECTIVE_TIMEOUT = timedelta(minutes=30)
IDLE_TIMEOUT = timedelta(days=365)  # the metadata group: commands may be hours apart
STARTUP_TIMEOUT_S = 300.0  # for every worker to import torch and reach the rendezvous
_EXIT_GRACE_S = 10.0  # shutdown: how long workers get to leave before they are killed


class RankFailedError(RuntimeError):
    """A startup stage failed on one or more tensor-parallel ranks."""


class EngineDeadError(RuntimeError):
    """A tensor-parallel rank died or a step failed midway on some rank: the
    ranks are out of step and the engine cannot serve any more."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def device_backend(device: str) -> str:
    return "nccl" if device == "cuda" else "gloo"


def init_groups(rank: int, size: int, port: int, device: str) -> Any:
    """Join the process group as `rank` (the device group is the default
    group) and make it the tensor-parallel group; returns the metadata group."""
    dist.init_process_group(
        device_backend(device), init_method=f"tcp://127.0.0.1:{port}", rank=rank,
        world_size=size, timeout=COLLECTIVE_TIMEOUT,
    )  # fmt: skip
    meta = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
    init_tp(rank, size, dist.group.WORLD)
    return meta


class _Processes:
    """The worker processes and what the monitor learned; shared with the
    finalizer and the monitor thread (which must not keep the group alive)."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen] = []
        self.error_files: list[Path] = []
        self.failure: str | None = None  # the first worker exit while serving
        self.stopping = False
        self.dir = tempfile.TemporaryDirectory(prefix="tinyengine-tp-")

    def error_of(self, rank: int) -> str | None:
        """What worker `rank` wrote before it exited ("rank r: Type: message")."""
        path = self.error_files[rank - 1]
        return path.read_text().strip() if path.exists() else None

    def describe_exit(self, rank: int) -> str:
        proc = self.procs[rank - 1]
        error = self.error_of(rank)
        return (f"tensor-parallel worker rank {rank} (pid {proc.pid}) exited with code "
                f"{proc.returncode}" + (f" ({error})" if error else ""))  # fmt: skip

    def end(self, grace_s: float) -> None:
        """Wait up to grace_s for the workers to leave, then kill whoever did not."""
        self.stopping = True
        deadline = time.monotonic() + grace_s
        for proc in self.procs:
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.dir.cleanup()


def _finalize(processes: _Processes) -> None:
    """Garbage collection or interpreter exit without shutdown(): no worker
    outlives rank 0's engine."""
    processes.stopping = True
    for proc in processes.procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    if dist.is_initialized():
        dist.destroy_process_group()
    init_tp(0, 1)


class WorkerGroup:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.size = config.tensor_parallel_size
        self.meta: Any = None
        self._processes = _Processes()
        self._finalizer = weakref.finalize(self, _finalize, self._processes)
        self._live = False  # the process group exists and the workers listen

    # --- life ---

    def start(self) -> None:
        """Start ranks 1..N-1 and form the process groups with them."""
        if dist.is_initialized():
            raise RuntimeError(
                "this process already belongs to a torch.distributed group (another "
                "tensor-parallel engine?); shut that engine down first"
            )
        p = self._processes
        port = free_port()
        config_path = Path(p.dir.name) / "config.pkl"
        config_path.write_bytes(pickle.dumps(self.config))
        env = dict(os.environ)
        package_root = str(Path(__file__).resolve().parents[2])
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [package_root, env.get("PYTHONPATH")]))
        for rank in range(1, self.size):
            error_file = Path(p.dir.name) / f"rank{rank}.err"
            p.error_files.append(error_file)
            p.procs.append(subprocess.Popen(
                [sys.executable, "-m", "tinyengine.worker.worker_main", str(rank),
                 str(self.size), str(port), str(config_path), str(error_file), str(os.getpid())],
                env=env,
            ))  # fmt: skip
        self._wait_until_joining()
        threading.Thread(target=_monitor, args=(p,), daemon=True, name="tp-monitor").start()
        device = self.config.resolved_device()
        if device == "cuda":
            torch.cuda.set_device(0)
        self.meta = init_groups(0, self.size, port, device)
        self._live = True

    def _wait_until_joining(self) -> None:
        """Wait for every worker to reach the process-group rendezvous (it
        writes a .ready file beside its error file first): a worker that
        dies on the way (an import error, a bad config) is an error now,
        not a rendezvous that waits out its timeout. The failed load stage
        ends the others (StartupMachine calls shutdown)."""
        p = self._processes
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        waiting = set(range(1, self.size))
        while waiting:
            for rank in list(waiting):
                if p.error_files[rank - 1].with_suffix(".ready").exists():
                    waiting.discard(rank)
                elif p.procs[rank - 1].poll() is not None:
                    raise RankFailedError(f"rank {rank} could not start: {p.describe_exit(rank)}")
            if waiting and time.monotonic() > deadline:
                raise RankFailedError(f"ranks {sorted(waiting)} did not start within "
                                      f"{STARTUP_TIMEOUT_S:.0f} s")  # fmt: skip
            time.sleep(0.02)

    def shutdown(self, kill: bool = False) -> None:
        """End every worker and leave the process group. Idempotent. Workers
        listen for commands only between steps and stages; after a failure
        (`kill`, or a worker gone) they may wait inside a collective, and
        are killed instead of asked."""
        if not self._finalizer.alive:
            return
        p = self._processes
        graceful = (not kill and self._live and p.failure is None
                    and all(x.poll() is None for x in p.procs))  # fmt: skip
        if graceful:
            try:
                self.send(("shutdown",))
            except EngineDeadError:
                graceful = False
        self._live = False
        p.end(_EXIT_GRACE_S if graceful else 0.0)
        self._finalizer()

    # --- messages ---

    def send(self, command: tuple) -> None:
        """A command to every worker (a pickled object on the metadata group)."""
        self._guard(lambda: dist.broadcast_object_list([command], src=0, group=self.meta))

    def exchange(self, outcome: Any) -> list[Any]:
        """Rank 0's outcome for every rank's, in rank order."""
        out: list[Any] = [None] * self.size
        self._guard(lambda: dist.all_gather_object(out, outcome, group=self.meta))
        return out

    def run_step(self, inputs: Any) -> None:
        """A step's inputs to every worker, which runs its forward."""
        self.send(("step", inputs))

    def share_sampled(self, token_ids: torch.Tensor) -> None:
        """The step's sampled ids to every worker (asynchronous scheduling's
        next step reads them on the device; without it nobody does)."""
        if self.config.async_scheduling:
            self._guard(lambda: dist.broadcast(token_ids, src=0))

    def check(self) -> None:
        """Raise EngineDeadError if a worker has gone."""
        if self._processes.failure is not None:
            raise EngineDeadError(self._processes.failure)

    def dead_error(self, cause: BaseException) -> EngineDeadError:
        """The error for a step that raised midway: the workers have gone or
        are out of step, so the engine cannot go on. Names the workers that
        exited, if any (exit_errors waits briefly: a socket closes first)."""
        p = self._processes
        if p.failure is None:
            failed = self.exit_errors()
            p.failure = "; ".join(failed) or (
                f"a step failed midway on rank 0, leaving the ranks out of step: {cause!r}"
            )
        self.shutdown(kill=True)
        return EngineDeadError(p.failure)

    def exit_errors(self, wait_s: float = 3.0) -> list[str]:
        """The errors of the workers that exited (waiting up to wait_s for a
        first one: a peer's broken connection is seen before its exit)."""
        p = self._processes
        deadline = time.monotonic() + wait_s
        while not any(x.poll() is not None for x in p.procs) and time.monotonic() < deadline:
            time.sleep(0.05)
        return [p.error_of(r) or p.describe_exit(r)
                for r, x in enumerate(p.procs, start=1) if x.poll() is not None]  # fmt: skip

    def _guard(self, op: Any) -> None:
        self.check()
        try:
            op()
        except Exception as exc:
            raise self.dead_error(exc) from exc


def _monitor(p: _Processes) -> None:
    """Record the first worker to exit while the engine was not stopping."""
    while not p.stopping:
        for rank, proc in enumerate(p.procs, start=1):
            if proc.poll() is not None and not p.stopping and p.failure is None:
                p.failure = p.describe_exit(rank)
        if p.failure is not None:
            return
        time.sleep(0.1)
