"""LLMEngine: the engine loop (the offline `LLM` API wraps it, in llm.py).

Owns the life of a request from its arrival to its final output: a Request
and its state on the way in (tokenization and the checks against the
engine's limits are input_processor.py's); per step, scheduler -> runner ->
scheduler update; then detokenization and stop checks on the way out (the
outputs of each kind are request_state.py's). One step reads top-down in
`LLMEngine.step`.

It is built from a startup machine run to READY (tinyengine/worker/startup.py):
the runner comes from the machine's stages and the scheduler is made over the
KV blocks they allocated, so an LLMEngine is never half-built. It never does a
startup stage's work itself.
"""

from __future__ import annotations

import itertools
import logging
import sys
from collections.abc import Hashable
from typing import Any

from tinyengine.config import EngineConfig
from tinyengine.detokenizer import IncrementalDetokenizer, find_stop_string
from tinyengine.input_processor import (
    PromptType,
    RequestLimits,
    load_engine_tokenizer,
    tokenize_prompt,
)
from tinyengine.kernels import jit_monitor
from tinyengine.outputs import Logprob, RequestOutput
from tinyengine.request_state import RequestState
from tinyengine.sampling_params import RequestOutputKind, SamplingParams
from tinyengine.scheduling.block_manager import BlockManager
from tinyengine.scheduling.request import Request, RequestStatus
from tinyengine.scheduling.scheduler import Scheduler, SchedulerOutput
from tinyengine.tokenizer import Tokenizer
from tinyengine.worker.startup import StartupMachine
from tinyengine.worker.step_profile import StepProfiler

logger = logging.getLogger("tinyengine.engine")


class LLMEngine:
    """Complete once constructed: its runner has passed every startup stage
    (READY) and its scheduler owns exactly the KV blocks startup allocated.
    Nothing in it is filled in later."""

    def __init__(self, config: EngineConfig, startup: StartupMachine | None = None) -> None:
        """`startup`: a machine from `StartupMachine.for_config(config)`, at
        CREATED or READY. A server builds it first, so /health can read its
        state while this constructor (on the engine thread) runs it to READY;
        without one the engine builds its own. A failing stage raises here,
        and the machine holds FAILED with the error."""
        self.config = config
        if startup is None:
            startup = StartupMachine.for_config(config)
        runner = startup.stages.runner
        if runner.config is not config:
            raise ValueError("the startup machine was built for another EngineConfig")
        self.hf_config = runner.hf_config
        self.max_model_len: int = config.max_model_len  # type: ignore[assignment]
        # Before the stages run: a wrong tokenizer path fails before the weights load.
        self.tokenizer: Tokenizer | None
        self.tokenizer, self.eos_token_ids = load_engine_tokenizer(config, self.hf_config)

        if not startup.ready:
            startup.run_all()
        if config.print_startup_report:
            print(startup.report.table(), file=sys.stderr)
        self.startup = startup
        self.runner = runner
        self._jit_compiles_at_ready = jit_monitor.num_compiles()
        num_blocks = startup.report.num_kv_blocks
        blocks = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching,
                              runner.sliding_group())  # fmt: skip
        self.scheduler = Scheduler(blocks, config.max_num_seqs, config.max_num_batched_tokens)
        cache_tokens = num_blocks * config.block_size
        if cache_tokens < self.max_model_len:
            # vLLM refuses to start here; we serve, with a smaller usable
            # context (add_request caps a default max_tokens to it).
            logger.warning(
                "the KV cache holds %d tokens, fewer than max_model_len=%d: one request can "
                "use at most %d tokens (raise num_kv_blocks / gpu_memory_utilization, or lower "
                "max_model_len)", cache_tokens, self.max_model_len, cache_tokens,
            )  # fmt: skip
        self._limits = RequestLimits(
            self.max_model_len, runner.vocab_size, cache_tokens, self.tokenizer is not None
        )
        self.states: dict[str, RequestState] = {}
        self._ids = itertools.count()
        # Asynchronous scheduling: the launched step whose tokens the next
        # step() call processes, as (plan, StepLaunch).
        self._inflight: tuple[Any, Any] | None = None
        # A StepProfiler when config.profile_steps; its forward hooks in the
        # runner bracket each launch (None: not profiling, no cost).
        self._profiler = StepProfiler(runner.device) if config.profile_steps else None
        runner.profiler = self._profiler

    # --- requests in ---

    def add_request(
        self,
        prompt: PromptType,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        *,
        strict_max_tokens: bool = False,
        group: Hashable = None,
    ) -> str:
        """Queue one request. A max_tokens that overshoots max_model_len is cut
        to the room left (as vLLM's offline LLM does), or, with
        strict_max_tokens, refused (the OpenAI server's rule, as vLLM's):
        RequestLimits.max_tokens (input_processor.py) decides. Requests that
        share a `group` (one caller's prompts x n) take turns with other groups
        for admission (scheduling/waiting_queue.py); None is the default group."""
        params = params or SamplingParams()
        if params.n != 1:
            raise ValueError(
                f"SamplingParams.n={params.n}: the engine runs one sequence per request; "
                "submit params.fan_out() (LLM.generate and the server do)"
            )
        request_id = request_id if request_id is not None else str(next(self._ids))
        text, token_ids = tokenize_prompt(self.tokenizer, prompt)
        max_tokens = self._limits.max_tokens(token_ids, params, strict_max_tokens)
        request = Request(
            request_id, token_ids, params, max_tokens, self.eos_token_ids, group=group
        )
        self.scheduler.add_request(request)  # validates; raises before we keep any state
        final_only = params.output_kind is RequestOutputKind.FINAL_ONLY
        detok = None
        # Stop strings are matched on text as it grows, so only they need the
        # incremental detokenizer when nobody streams this request's output.
        if self.tokenizer is not None and (params.stop or not final_only):
            detok = IncrementalDetokenizer(self.tokenizer, token_ids, params.skip_special_tokens)
        state = RequestState(request, text, detok, kind=params.output_kind)
        if params.logprobs is not None:
            state.logprobs = []
        if params.prompt_logprobs is not None:
            state.prompt_logprobs = [None]
        self.states[request_id] = state
        return request_id

    def abort_request(self, request_id: str) -> None:
        self.scheduler.abort(request_id)
        self.runner.free_request(request_id)
        self.states.pop(request_id, None)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or self._inflight is not None

    # --- one step ---

    def step(self) -> list[RequestOutput]:
        """Schedule and launch one forward pass, and return an output for every
        request that got a new token (of its RequestOutputKind: cumulative
        text and token ids, or only the new ones; FINAL_ONLY requests only
        when they finish).

        With async_scheduling the tokens returned are those of the step
        launched by the *previous* call: this call schedules and launches the
        next step first, so the GPU computes it while the host processes the
        previous one's tokens. A request that finished in the previous step may
        have been scheduled once more; its extra token is dropped.

        A step that raises drops the requests it was running (drop_failed_step)
        and re-raises: the engine stays usable for everything else."""
        prof = self._profiler
        if prof is not None:
            prof.begin()
        previous = self._inflight  # async: the launched step this call finishes
        plan = None
        try:
            plan = self.scheduler.schedule()
            launched = None
            if not plan.is_empty:
                if prof is not None:
                    prof.scheduled()
                launched = (plan, self.runner.launch(plan))
                if prof is not None:
                    prof.executed()
            if self.config.async_scheduling:
                finishing, self._inflight = self._inflight, launched
            else:
                finishing = launched
            outputs = self._finish(*finishing, prof) if finishing is not None else []
        except BaseException as exc:
            dropped = self.drop_failed_step(plan, previous[0] if previous else None)
            if dropped:
                more = ", ..." if len(dropped) > 8 else ""
                exc.add_note(f"tinyengine: the step failed; its {len(dropped)} requests were "
                             f"dropped: {', '.join(dropped[:8])}{more}")  # fmt: skip
            raise
        if prof is not None and launched is not None:
            prof.end(plan)
        return outputs

    def drop_failed_step(
        self, plan: SchedulerOutput | None, previous: SchedulerOutput | None = None
    ) -> list[str]:
        """Make the engine consistent after a step raised; returns the ids of
        the requests it dropped (aborted: blocks freed, every per-request state
        gone), which get no further output.

        A failed step leaves its requests with tokens counted as computed whose
        K/V may be missing and with in-flight tokens that will never land; kept,
        they would be scheduled forever. So the engine drops the requests of
        `plan` (the step that failed; None when schedule() itself raised: then
        every running request, as the scheduler may have touched any, and the
        head of the queue, the one it may have been admitting) and of
        `previous` (async scheduling: the step launched before it, discarded
        unprocessed), and any request still counting an in-flight token.
        Other waiting requests are kept and run on later steps. The request
        that broke the step is among those dropped, so a caller that keeps
        stepping (the server) makes progress instead of failing on it forever."""
        self._inflight = None
        self.runner.discard_inflight()
        scheduler = self.scheduler
        if plan is None:
            victims = [*scheduler.running, *list(scheduler.waiting)[:1]]
        else:
            victims = [s.request for s in plan.scheduled]
        if previous is not None:
            victims += [s.request for s in previous.scheduled]
        victims += [r for r in scheduler.requests.values() if r.num_inflight]
        dropped: list[str] = []
        for request in victims:
            # By identity: a request finished during the step may have had its
            # id reused since, by one that must not be dropped.
            if scheduler.requests.get(request.request_id) is request:
                # Its blocks may be indexed for prefix hits that the failed step
                # never computed (BlockManager.cache_scheduled_blocks).
                scheduler.block_manager.uncache(request)
                self.abort_request(request.request_id)
                dropped.append(request.request_id)
        return dropped

    def _finish(self, plan, launch, prof) -> list[RequestOutput]:
        """Wait for a launched step's tokens, hand them to the scheduler, and
        process each: stop checks, text, outputs."""
        token_ids, sampled = launch.result()
        if prof is not None:
            prof.waited(synced=sampled is not None)
        self.scheduler.update_from_output(plan, token_ids)
        for request_id, (first, rows) in launch.prompt_logprobs.items():
            state = self.states.get(request_id)
            if state is None or state.prompt_logprobs is None:
                continue  # aborted or finished meanwhile
            # Entry i is prompt token i's. A request recomputing its prompt
            # after preemption sends rows it already has: keep the first ones.
            have = len(state.prompt_logprobs)
            state.prompt_logprobs += [self._logprobs(r) for r in rows[max(0, have - first) :]]

        outputs: list[RequestOutput] = []
        row = 0  # the sampler's rows are the scheduled requests that sampled, in order
        for sched, token_id in zip(plan.scheduled, token_ids, strict=True):
            if token_id is None:
                continue
            row += 1
            state = self.states.get(sched.request.request_id)
            if state is None or state.request is not sched.request or state.request.is_finished:
                continue  # aborted (its id maybe reused since), or finished earlier: dropped
            if state.logprobs is not None and sampled is not None:
                entry = self._logprobs(sampled.logprobs[row - 1])
                state.logprobs.append(entry)
                if token_id in entry:
                    state.cumulative_logprob += entry[token_id].logprob
            self._process_token(state, token_id)
            if state.final_only and not state.request.is_finished:
                continue  # nobody reads the intermediate outputs of this request
            outputs.append(state.make_output())
        return outputs

    def _process_token(self, state: RequestState, token_id: int) -> None:
        request = state.request
        status = request.check_token_stop()
        params = request.sampling_params
        # A stop token (EOS or stop_token_ids) ends the ids but not the text,
        # unless include_stop_str_in_output (vLLM's rule).
        hide_last = (
            status is RequestStatus.FINISHED_STOPPED and not params.include_stop_str_in_output
        )
        if state.detokenizer is not None:
            delta = "" if hide_last else state.detokenizer.step(token_id)
            if status is not None:
                delta += state.detokenizer.flush()  # release a trailing partial character
            state.text += delta
            if params.stop and request.num_output_tokens >= params.min_tokens:
                hit = find_stop_string(state.text, params.stop, len(delta))
                if hit is not None:
                    cut, stop = hit
                    keep = cut + len(stop) if params.include_stop_str_in_output else cut
                    state.text = state.text[:keep]
                    request.stop_reason = stop
                    status = RequestStatus.FINISHED_STOPPED
        elif status is not None and self.tokenizer is not None:
            # FINAL_ONLY without stop strings: one decode at the end gives the
            # text the incremental detokenizer would have built token by token.
            ids = request.output_token_ids[:-1] if hide_last else request.output_token_ids
            state.text = self.tokenizer.decode(ids, params.skip_special_tokens)
        if status is not None:
            self.scheduler.finish(request, status)
            self.runner.free_request(request.request_id)
            del self.states[request.request_id]

    def _logprobs(self, row: list[tuple[int, float, int]] | None) -> dict[int, Logprob]:
        entries: dict[int, Logprob] = {}
        for token_id, logprob, rank in row or []:
            if token_id not in entries:
                text = self.tokenizer.decode([token_id]) if self.tokenizer is not None else None
                entries[token_id] = Logprob(logprob, rank, text)
        return entries

    def shutdown(self) -> None:
        """End what the engine started besides this thread: the other
        tensor-parallel ranks' processes (nothing with one rank). Idempotent;
        garbage collection and interpreter exit do it too."""
        self.startup.stages.shutdown()

    # --- introspection ---

    def step_profile(self, min_batch_size: int = 1) -> dict[str, Any]:
        """Phase times of the steps since startup (or the last reset) with at
        least `min_batch_size` rows: totals, per_step means, host_s and
        host_fraction_of_gpu, overall and by_kind (decode / prefill); the keys
        and what each phase spans are in tinyengine/worker/step_profile.py."""
        if self._profiler is None:
            raise ValueError("step profiling is off; build the engine with profile_steps=True")
        return self._profiler.summary(min_batch_size)

    def reset_step_profile(self) -> None:
        if self._profiler is not None:
            self._profiler.reset()

    def stats(self) -> dict[str, Any]:
        s = self.scheduler.stats
        bm = self.scheduler.block_manager
        return {
            "num_preemptions": s.num_preemptions,
            "prefix_cache_hit_tokens": s.prefix_cache_hit_tokens,
            "prefix_cache_query_tokens": s.prefix_cache_query_tokens,
            "num_free_blocks": bm.num_free_blocks,
            "num_total_blocks": bm.num_blocks,
            # Per cache group (block_manager.py): "full" (the blocks above)
            # and, for DeepSeek-V4, "sliding".
            "cache_groups": {
                name: {"free_blocks": free, "total_blocks": total}
                for name, (free, total) in bm.group_usage().items()
            },
            "num_steps": s.num_steps,
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
            "jit_compiles_after_ready": jit_monitor.num_compiles() - self._jit_compiles_at_ready,
            "workspace_bytes": self.runner.workspace.size,
            "workspace_growths": self.runner.workspace.stats.num_growths,
            "captured_graph_sizes": self.startup.report.captured_sizes,
            "piecewise_graph_sizes": self.startup.report.piecewise_sizes,
            "batch_invariant": self.config.batch_invariant,
            "tensor_parallel_size": self.config.tensor_parallel_size,
        }
