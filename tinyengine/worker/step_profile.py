"""StepProfiler: where the time of each `LLMEngine.step` goes, for the host
overhead target (scheduler + input preparation + sampling + output processing
per decode step, against the GPU time of the step's forward).

Owns the per-step timeline and its summary. The engine and the runner call
its hooks, in this order, only when `EngineConfig.profile_steps` is on:

    begin | schedule | scheduled | prepare | forward_start | forward (+ lm_head)
    | forward_end | sample | executed | wait | waited | output | end

`sample` launches the sampling kernels and starts the copy of the tokens to
the host; `wait` is the one sync of a step call, for the tokens of the step it
finishes; `output` hands those tokens to the scheduler, detokenizes and builds
outputs. Without async scheduling a call finishes the step it launched, so
`wait` is mostly that step's GPU time. With it (the default), a call finishes
the step launched by the previous call while its own step runs, so the host
phases overlap the GPU and `wait` is what is left of the previous step.

Host phases are `time.perf_counter` intervals. The forward's GPU time comes
from a pair of CUDA events recorded around its launch and read only after a
sync the step makes anyway; events still pending are read by `summary`, which
synchronizes. On CPU the forward's wall time is its compute time.

Summary (`LLMEngine.step_profile(min_batch_size=1)`): steps; totals in
seconds wall_s, gpu_forward_s (model + lm_head), launch_s (host time to launch
them), schedule_s, prepare_s, sample_s, sample_wait_s (the wait), output_s,
host_s (schedule + prepare + sample + output); host_fraction_of_gpu (host_s /
gpu_forward_s: the host's work per unit of GPU work, hidden or not);
exposed_fraction_of_gpu ((wall_s - gpu_forward_s) / gpu_forward_s: how much
longer the steps took than their forward passes, the overhead not hidden);
per_step (the same means); mean_batch_size, mean_tokens,
mean_context_tokens (per step, summed over rows: what attention reads, for a
roofline), batch_size_histogram; forward_timing ("cuda_events" or "wall_clock"); and
by_kind {"decode": every row one token, "prefill": the rest}, each with the
same keys. Steps before READY (warmup) and steps that schedule nothing are
not recorded.

Must never synchronize the device inside a step, or cost anything when the
engine runs without it (the engine then holds None and skips every hook).
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

import torch

# Summary order; host_s = schedule + prepare + sample + output.
_PHASES = (
    "wall",
    "gpu_forward",
    "launch",
    "schedule",
    "prepare",
    "sample",
    "sample_wait",
    "output",
)
_HOST = ("schedule", "prepare", "sample", "output")


@dataclass
class _Step:
    # host: begin, scheduled, forward_start, forward_end, executed, waited, end
    times: tuple[float, ...]
    decode: bool  # every row computes one token (the CUDA-graph shape)
    num_seqs: int
    num_tokens: int
    context_tokens: int  # sum over rows of the context each attends over
    events: tuple[torch.cuda.Event, torch.cuda.Event] | None = None
    gpu_forward: float = -1.0  # seconds; -1 while the CUDA events are pending

    def phases(self) -> dict[str, float]:
        begin, scheduled, fwd_start, fwd_end, executed, waited, end = self.times
        return {
            "schedule": scheduled - begin,
            "prepare": fwd_start - scheduled,
            "launch": fwd_end - fwd_start,
            "gpu_forward": self.gpu_forward,
            "sample": executed - fwd_end,
            "sample_wait": waited - executed,
            "output": end - waited,
            "wall": end - begin,
        }


class StepProfiler:
    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self._free_events: list[torch.cuda.Event] = []
        self.reset()

    def reset(self) -> None:
        """Forget every recorded step (the engine calls it when startup ends,
        so warmup steps never count)."""
        self._steps: list[_Step] = []
        self._pending: list[_Step] = []
        self._t: list[float] = []
        self._events: tuple[torch.cuda.Event, torch.cuda.Event] | None = None

    # --- hooks, in step order ---

    def begin(self) -> None:
        self._t = [time.perf_counter()]

    def scheduled(self) -> None:
        self._t.append(time.perf_counter())

    def forward_start(self) -> None:
        self._t.append(time.perf_counter())
        if self.cuda:
            self._events = (self._event(), self._event())
            self._events[0].record()

    def forward_end(self) -> None:
        if self._events is not None:
            self._events[1].record()
        self._t.append(time.perf_counter())

    def executed(self) -> None:
        self._t.append(time.perf_counter())

    def waited(self, synced: bool) -> None:
        """The call's wait for tokens is over; `synced`: it did wait on the
        device, so the events of every step closed before this one are done."""
        if len(self._t) == 5:  # a call that finishes a step without launching one keeps no record
            self._t.append(time.perf_counter())
        if synced and self._pending:
            self._resolve()

    def end(self, plan: Any) -> None:
        """Close the record of the step call that launched SchedulerOutput `plan`."""
        if len(self._t) == 5:  # nothing to finish this call (the first async step)
            self._t.append(self._t[-1])
        self._t.append(time.perf_counter())
        rows = plan.scheduled
        step = _Step(
            tuple(self._t),
            plan.is_decode,
            len(rows),
            sum(s.num_new_tokens for s in rows),
            sum(s.start + s.num_new_tokens for s in rows),
            self._events,
        )
        self._events = None
        if step.events is None:
            step.gpu_forward = step.times[3] - step.times[2]
        else:
            self._pending.append(step)
        self._steps.append(step)

    # --- results ---

    def summary(self, min_batch_size: int = 1) -> dict[str, Any]:
        """Totals and per-step means over the recorded steps with at least
        `min_batch_size` rows, overall and by kind ("decode": every row one
        token; "prefill": some row computes prompt tokens)."""
        if self._pending:
            torch.cuda.synchronize()
            self._resolve()
        steps = [s for s in self._steps if s.num_seqs >= min_batch_size]
        out = _summarize(steps)
        out["forward_timing"] = "cuda_events" if self.cuda else "wall_clock"
        out["by_kind"] = {
            "decode": _summarize([s for s in steps if s.decode]),
            "prefill": _summarize([s for s in steps if not s.decode]),
        }
        return out

    def _resolve(self) -> None:
        for step in self._pending:
            start, stop = step.events
            step.gpu_forward = start.elapsed_time(stop) / 1e3
            self._free_events += step.events  # reused: creating events costs a driver call
            step.events = None
        self._pending.clear()

    def _event(self) -> torch.cuda.Event:
        return (
            self._free_events.pop() if self._free_events else torch.cuda.Event(enable_timing=True)
        )


def _summarize(steps: list[_Step]) -> dict[str, Any]:
    n = len(steps)
    totals = dict.fromkeys(_PHASES, 0.0)
    for step in steps:
        for name, seconds in step.phases().items():
            totals[name] += seconds
    totals["host"] = sum(totals[p] for p in _HOST)
    out: dict[str, Any] = {"steps": n}
    out.update({f"{name}_s": value for name, value in totals.items()})
    gpu = totals["gpu_forward"]
    out["host_fraction_of_gpu"] = totals["host"] / gpu if gpu > 0 else None
    out["exposed_fraction_of_gpu"] = max(totals["wall"] - gpu, 0.0) / gpu if gpu > 0 else None
    out["per_step"] = {f"{k}_s": (v / n if n else 0.0) for k, v in totals.items()}
    out["mean_batch_size"] = sum(s.num_seqs for s in steps) / n if n else 0.0
    out["mean_tokens"] = sum(s.num_tokens for s in steps) / n if n else 0.0
    out["mean_context_tokens"] = sum(s.context_tokens for s in steps) / n if n else 0.0
    out["batch_size_histogram"] = dict(sorted(Counter(s.num_seqs for s in steps).items()))
    return out
