"""LLM: the offline API, as in vLLM: `LLM(model, **engine_options)` builds an
LLMEngine (startup runs in the constructor) and `generate` / `chat` submit a
batch and step the engine until every request has finished.

Owns only the batch bookkeeping (all-or-nothing submission, outputs in input
order, the progress bar, and on an error none of the call's requests left in
the engine); everything per request lives in tinyengine/engine.py.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from typing import Any

from tqdm.auto import tqdm

from tinyengine.config import EngineConfig
from tinyengine.engine import LLMEngine
from tinyengine.input_processor import PromptType
from tinyengine.models_presets import is_preset, resolve_model
from tinyengine.outputs import RequestOutput
from tinyengine.sampling_params import RequestOutputKind, SamplingParams
from tinyengine.tokenizer import Tokenizer
from tinyengine.worker.startup import StartupReport


class LLM:
    """Offline inference, as in vLLM: `LLM(model, **engine_options).generate(prompts, params)`."""

    def __init__(self, model: str, **kwargs: Any) -> None:
        """`model`: a Hugging Face checkpoint folder, or a preset name
        (tinyengine/models_presets.py), built into the cache on first use as
        the server does (`TINYENGINE_MODEL`)."""
        if is_preset(model) and not os.path.isdir(model):
            model = resolve_model(model)
        self.engine = LLMEngine(EngineConfig.from_kwargs(model, **kwargs))

    def get_tokenizer(self) -> Tokenizer | None:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise ValueError(
                    f"got {len(params_list)} SamplingParams for {len(prompts)} prompts; "
                    "pass one, or one per prompt"
                )
        engine = self.engine
        groups: list[list[str]] = []  # per prompt: its n engine requests
        try:
            for prompt, params in zip(prompts, params_list, strict=True):
                # Only finished outputs are returned, so ask for nothing else
                # (on a copy: the caller's params stay as given).
                params = dataclasses.replace(params, output_kind=RequestOutputKind.FINAL_ONLY)
                groups.append([])
                for child in params.fan_out():
                    groups[-1].append(engine.add_request(prompt, child))
        except Exception:
            for request_id in (r for g in groups for r in g):  # all or nothing
                engine.abort_request(request_id)
            raise

        final: dict[str, RequestOutput] = {}
        total = sum(len(g) for g in groups)
        with tqdm(total=total, desc="generate", disable=not use_tqdm) as bar:
            try:
                while engine.has_unfinished_requests():
                    for output in engine.step():
                        if output.finished:
                            final[output.request_id] = output
                            bar.update(1)
            except BaseException:
                # A failed step dropped what it ran (LLMEngine.drop_failed_step);
                # the rest of this batch goes too, so nothing of it lingers.
                for request_id in (r for g in groups for r in g if r not in final):
                    engine.abort_request(request_id)
                raise
        return [_merge([final[r] for r in group]) for group in groups]

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        *,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation (or a list of
        them) and generate; the keywords are vLLM's (and transformers'). Each
        output's `prompt` is the rendered text."""
        tokenizer = self.engine.tokenizer
        if tokenizer is None:
            raise ValueError("chat needs a tokenizer with a chat template; this model has none")
        conversations = messages if messages and isinstance(messages[0], list) else [messages]
        options = dict(chat_template=chat_template, add_generation_prompt=add_generation_prompt,
                       tools=tools, **(chat_template_kwargs or {}))  # fmt: skip
        texts = [tokenizer.apply_chat_template(c, **options) for c in conversations]
        # Encoded as apply_chat_template(tokenize=True) does: the template
        # already wrote any BOS.
        prompts: list[PromptType] = [
            {"prompt": t, "prompt_token_ids": tokenizer.encode(t, add_special_tokens=False)}
            for t in texts
        ]
        return self.generate(prompts, sampling_params, use_tqdm)

    def stats(self) -> dict[str, Any]:
        return self.engine.stats()

    def shutdown(self) -> None:
        """End the worker processes of a tensor-parallel engine now (as
        `del llm` does once the object is collected)."""
        self.engine.shutdown()

    def startup_report(self) -> StartupReport:
        return self.engine.startup.report

    def step_profile(self, min_batch_size: int = 1) -> dict[str, Any]:
        return self.engine.step_profile(min_batch_size)

    def reset_step_profile(self) -> None:
        self.engine.reset_step_profile()


def _merge(children: list[RequestOutput]) -> RequestOutput:
    """One prompt's n finished requests as one RequestOutput with n
    completions (index i: the i-th), under the first request's id."""
    if len(children) == 1:
        return children[0]
    first = children[0]
    outputs = [dataclasses.replace(c.outputs[0], index=i) for i, c in enumerate(children)]
    return dataclasses.replace(first, outputs=outputs)
