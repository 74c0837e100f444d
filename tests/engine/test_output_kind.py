"""RequestOutputKind: FINAL_ONLY requests (what LLM.generate submits) give one
output, when finished, with the same text and tokens as CUMULATIVE streaming
(whose text is built incrementally); stop strings still cut FINAL_ONLY text."""

from __future__ import annotations

import dataclasses

import pytest

from tinyengine import LLM, SamplingParams
from tinyengine.sampling_params import RequestOutputKind
from tinyengine.tools.make_proxy import ensure_preset

PROMPTS = ["The capital of France is", "def fib(n):", "1, 2, 3,", "你好，世界"]


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> str:
    cache = str(tmp_path_factory.mktemp("cache"))
    ensure_preset("deepseek-v3-tiny", cache)
    return cache


@pytest.fixture(scope="module")
def llm(cache_dir: str) -> LLM:
    path = ensure_preset("deepseek-v3-tiny", cache_dir)  # built by cache_dir: returns at once
    return LLM(path, dtype="float32", max_model_len=128, print_startup_report=False)


def _run(llm: LLM, params: SamplingParams) -> dict[str, list]:
    """Drive the engine directly; every output it returns, per request."""
    engine, seen = llm.engine, {}
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(prompt, dataclasses.replace(params, seed=i), request_id=str(i))
    while engine.has_unfinished_requests():
        for out in engine.step():
            seen.setdefault(out.request_id, []).append(out)
    return seen


@pytest.mark.parametrize("stop", [None, ["e"]])
def test_final_only_matches_cumulative(llm, stop):
    base = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True, stop=stop)
    cumulative = _run(llm, base)
    final = _run(llm, dataclasses.replace(base, output_kind=RequestOutputKind.FINAL_ONLY))
    assert sorted(final) == sorted(cumulative) == [str(i) for i in range(len(PROMPTS))]
    for rid, outs in final.items():
        assert len(outs) == 1 and outs[0].finished  # nothing before the end
        want = cumulative[rid][-1].outputs[0]
        got = outs[0].outputs[0]
        assert (got.text, got.token_ids, got.finish_reason, got.stop_reason) == (
            want.text,
            want.token_ids,
            want.finish_reason,
            want.stop_reason,
        )
        if stop is None:
            assert len(got.token_ids) == 12
            assert got.text == llm.get_tokenizer().decode(got.token_ids)
            assert len(cumulative[rid]) == 12  # one cumulative output per token


@pytest.mark.parametrize("stop", [None, ["e"], [", 3", "e f"]])
def test_delta_outputs_join_to_the_cumulative_ones(llm, stop):
    """DELTA (vLLM's): one output per token with only what is new; joined
    they are the CUMULATIVE output, token for token and character for
    character. With stop strings no delta carries text a stop string later
    cuts, and the last delta flushes what was held back."""
    base = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True, stop=stop, logprobs=2)
    cumulative = _run(llm, base)
    delta = _run(llm, dataclasses.replace(base, output_kind=RequestOutputKind.DELTA))
    assert sorted(delta) == sorted(cumulative)
    for rid, outs in delta.items():
        full = cumulative[rid]
        assert len(outs) == len(full) and [o.finished for o in outs] == [o.finished for o in full]
        text, ids, logprobs = "", [], []
        for d, c in zip(outs, full, strict=True):
            got = d.outputs[0]
            text, ids, logprobs = text + got.text, ids + got.token_ids, logprobs + got.logprobs
            want = c.outputs[0]
            assert ids == want.token_ids and logprobs == want.logprobs
            assert full[-1].outputs[0].text.startswith(text)  # nothing sent is taken back
            assert got.cumulative_logprob == want.cumulative_logprob
            assert d.prompt_token_ids == c.prompt_token_ids
        last, want = outs[-1].outputs[0], full[-1].outputs[0]
        assert text == want.text and ids == want.token_ids
        assert (last.finish_reason, last.stop_reason) == (want.finish_reason, want.stop_reason)


def test_delta_holds_back_a_stop_strings_start(llm):
    """Text that may be the start of a stop string stays back until the stop
    string completes (and cuts it) or cannot: here the stop string is
    everything the greedy run writes after its first two characters, so it
    completes only with the last token, and no delta before the last may
    carry more than those two characters."""
    greedy = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    text = llm.generate(PROMPTS[2], greedy, use_tqdm=False)[0].outputs[0].text
    assert len(text) >= 6
    stop = text[2:]
    params = dataclasses.replace(greedy, stop=[stop], output_kind=RequestOutputKind.DELTA)
    engine = llm.engine
    engine.add_request(PROMPTS[2], params, request_id="held")
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert len(outs) == 10 and outs[-1].outputs[0].finish_reason == "stop"
    joined = ""
    for out in outs:
        joined += out.outputs[0].text
        assert text[:2].startswith(joined), joined
    assert joined == text[:2]


def test_delta_prompt_logprobs_come_once(llm):
    params = SamplingParams(temperature=0.0, max_tokens=3, prompt_logprobs=1,
                            output_kind=RequestOutputKind.DELTA)  # fmt: skip
    engine = llm.engine
    engine.add_request(PROMPTS[0], params, request_id="plp")
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert len(outs) == 3 and outs[0].prompt_logprobs is not None
    assert len(outs[0].prompt_logprobs) == len(outs[0].prompt_token_ids)
    assert all(o.prompt_logprobs is None for o in outs[1:])


def test_generate_leaves_callers_params_alone(llm):
    params = SamplingParams(temperature=0.0, max_tokens=4)
    (out,) = llm.generate(PROMPTS[:1], params, use_tqdm=False)
    assert out.finished and len(out.outputs[0].token_ids) <= 4
    assert params.output_kind is RequestOutputKind.CUMULATIVE


def test_output_kind_is_validated():
    with pytest.raises(ValueError, match="output_kind"):
        SamplingParams(output_kind="final_only")


def test_llm_takes_a_preset_name(cache_dir, monkeypatch, llm):
    """LLM("deepseek-v3-tiny") finds the preset in $TINYENGINE_CACHE, as the
    server does, and is the same model as the folder."""
    monkeypatch.setenv("TINYENGINE_CACHE", cache_dir)
    by_name = LLM(
        "deepseek-v3-tiny", dtype="float32", max_model_len=128, print_startup_report=False
    )
    params = SamplingParams(temperature=0.0, max_tokens=6)
    (a,) = by_name.generate(PROMPTS[:1], params, use_tqdm=False)
    (b,) = llm.generate(PROMPTS[:1], params, use_tqdm=False)
    assert a.outputs[0].token_ids == b.outputs[0].token_ids and len(a.outputs[0].token_ids) == 6


def test_llm_names_an_unknown_model():
    with pytest.raises(ValueError, match="not-a-model"):
        LLM("not-a-model", print_startup_report=False)


def test_a_tokenizer_asked_for_must_exist(cache_dir, tmp_path):
    path = ensure_preset("deepseek-v3-tiny", cache_dir)
    with pytest.raises(ValueError, match="EngineConfig.tokenizer=.*no tokenizer files"):
        LLM(path, tokenizer=str(tmp_path / "nowhere"), print_startup_report=False)


def test_generate_with_n_returns_n_completions_per_prompt(llm):
    """LLM.generate fans n out: one RequestOutput per prompt whose completion
    i is what an n=1 request with seed + i gives; the engine itself refuses n
    > 1 (it runs one sequence per request) rather than ignoring it."""
    params = SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=6)
    outs = llm.generate(PROMPTS[:2], params, use_tqdm=False)
    assert [len(o.outputs) for o in outs] == [3, 3]
    for out, prompt in zip(outs, PROMPTS[:2], strict=True):
        assert [c.index for c in out.outputs] == [0, 1, 2]
        for i, c in enumerate(out.outputs):
            single = llm.generate(prompt, dataclasses.replace(params, n=1, seed=11 + i),
                                  use_tqdm=False)[0].outputs[0]  # fmt: skip
            assert c.token_ids == single.token_ids and c.text == single.text
    assert len({tuple(c.token_ids) for c in outs[0].outputs}) > 1
    with pytest.raises(ValueError, match="one sequence per request"):
        llm.engine.add_request(PROMPTS[0], params)
    assert not llm.engine.has_unfinished_requests()


def test_strict_max_tokens_refuses_what_the_default_cuts(llm):
    engine = llm.engine
    with pytest.raises(ValueError, match="'max_tokens' is too large: 500"):
        engine.add_request(PROMPTS[0], SamplingParams(max_tokens=500), strict_max_tokens=True)
    assert not engine.has_unfinished_requests()
    out = llm.generate(PROMPTS[0], SamplingParams(max_tokens=500, ignore_eos=True),
                       use_tqdm=False)[0]  # fmt: skip
    assert len(out.prompt_token_ids) + len(out.outputs[0].token_ids) == 128  # max_model_len
    assert out.outputs[0].finish_reason == "length"


@pytest.mark.parametrize("kind", [RequestOutputKind.CUMULATIVE, RequestOutputKind.FINAL_ONLY])
def test_stop_token_text_is_dropped_unless_asked_for(llm, kind):
    """vLLM's rule: a stop token id ends the token ids, its text is left out
    unless include_stop_str_in_output; a stop token that is also the last
    allowed one is "stop", not "length"."""
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, output_kind=kind)
    free = llm.generate(PROMPTS[0], greedy, use_tqdm=False)[0].outputs[0]
    tok = llm.get_tokenizer()
    stop = free.token_ids[2]
    for include in (False, True):
        params = dataclasses.replace(greedy, stop_token_ids=[stop],
                                     include_stop_str_in_output=include)  # fmt: skip
        out = llm.generate(PROMPTS[0], params, use_tqdm=False)[0].outputs[0]
        kept = free.token_ids[: 3 if include else 2]
        assert out.token_ids == free.token_ids[:3]
        assert (out.finish_reason, out.stop_reason) == ("stop", stop)
        assert out.text == tok.decode(kept)
    last = dataclasses.replace(greedy, max_tokens=3, stop_token_ids=[stop])
    out = llm.generate(PROMPTS[0], last, use_tqdm=False)[0].outputs[0]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop)


def test_cumulative_logprob(llm):
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=5, logprobs=1)
    out = llm.generate(PROMPTS[1], params, use_tqdm=False)[0].outputs[0]
    want = sum(e[t].logprob for t, e in zip(out.token_ids, out.logprobs, strict=True))
    assert out.cumulative_logprob == pytest.approx(want) and out.cumulative_logprob < 0
    plain = llm.generate(PROMPTS[1], dataclasses.replace(params, logprobs=None),
                         use_tqdm=False)[0].outputs[0]  # fmt: skip
    assert plain.cumulative_logprob is None


def test_chat_reports_its_rendered_prompt_and_takes_vllms_keywords(llm):
    tok = llm.get_tokenizer()
    conversation = [{"role": "user", "content": "hi"}]
    params = SamplingParams(temperature=0.0, max_tokens=2)
    (out,) = llm.chat(conversation, params, use_tqdm=False)
    assert out.prompt == tok.apply_chat_template(conversation)
    assert out.prompt_token_ids == tok.apply_chat_template(conversation, tokenize=True)
    (bare,) = llm.chat(conversation, params, use_tqdm=False, add_generation_prompt=False)
    assert bare.prompt == tok.apply_chat_template(conversation, add_generation_prompt=False)
    assert bare.prompt != out.prompt


def test_default_max_tokens_fits_a_kv_cache_smaller_than_the_context(cache_dir, caplog):
    # 4 blocks of 16 = 64 cached tokens under max_model_len 128: startup warns,
    # and "up to the context" (max_tokens None, the server's chat default)
    # means up to what the cache holds, instead of refusing every request.
    path = ensure_preset("deepseek-v3-tiny", cache_dir)
    with caplog.at_level("WARNING", logger="tinyengine.engine"):
        small = LLM(path, dtype="float32", max_model_len=128, num_kv_blocks=4, block_size=16,
                    print_startup_report=False)  # fmt: skip
    assert "holds 64 tokens, fewer than max_model_len=128" in caplog.text
    params = SamplingParams(max_tokens=None, ignore_eos=True, temperature=0)
    out = small.generate(["The capital of France is"], params)[0]
    assert out.outputs[0].finish_reason == "length"
    assert len(out.prompt_token_ids) + len(out.outputs[0].token_ids) == 64
    with pytest.raises(ValueError, match="KV blocks"):  # an explicit ask beyond it is refused
        small.generate(["The capital of France is"], SamplingParams(max_tokens=100))
