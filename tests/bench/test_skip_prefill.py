"""bench latency --skip-prefill (tinyengine/bench/skip_prefill.py): requests
land in the running batch at their context, blocks held as after a chunked
prefill (the sliding group already released), and then decode to the end."""

from __future__ import annotations

from tinyengine import LLM, SamplingParams
from tinyengine.bench.skip_prefill import assume_prefilled
from tinyengine.models_presets import resolve_model


def test_requests_decode_from_their_context_without_a_prefill():
    llm = LLM(resolve_model("deepseek-v4-tiny"), print_startup_report=False, max_model_len=256)
    engine = llm.engine
    params = SamplingParams(max_tokens=3, ignore_eos=True, temperature=0)
    ids = [engine.add_request({"prompt_token_ids": list(range(5, 205))}, params) for _ in range(2)]
    assume_prefilled(engine, ids, chunk=64)
    for request_id in ids:
        request = engine.states[request_id].request
        assert request.num_computed_tokens == 199 and request in engine.scheduler.running
        assert len(request.block_ids) == -(-199 // engine.config.block_size)
        live = [b for b in request.window_block_ids if b >= 0]
        assert len(live) < len(request.window_block_ids)  # older sliding blocks released
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = len(out.outputs[0].token_ids)
    assert finished == {request_id: 3 for request_id in ids}
    stats = engine.stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"]
