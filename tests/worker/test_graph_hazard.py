"""The late-workspace-growth hazard, on CPU, with the recording graph backend.

The recording backend (tinyengine/worker/cuda_graphs.py) "captures" a decode
step by running it once and remembering the workspace arena's address, and
checks that address at every replay: a real CUDA graph would read the freed
old buffer if the arena had grown since. So on CPU we can show:

(a) detection: grow the arena after capture with the lock bypassed, and the
    next decode replay raises StaleGraphAddressError; with the lock in place,
    the growth itself raises WorkspaceLockedError naming the caller, and the
    engine keeps serving correct tokens;
(b) the engine's own startup sizes the arena for every shape: a soak of
    thousands of random scheduler steps after READY (random lengths up to the
    limits, prefix hits, preemptions, chunking, aborts, seeded sampling) never
    grows it and never raises, and every step's output equals an eager twin
    engine's, step for step;
(c) padded replays are correct: greedy with graphs == eager == HF for a batch
    size that is not captured.
"""

from __future__ import annotations

import random
import time

import pytest
import torch

from tests.hf_models import hf_greedy, make_tiny_hf_model
from tinyengine import LLM, SamplingParams
from tinyengine.kernels.workspace import WorkspaceLockedError
from tinyengine.worker.cuda_graphs import RecordingGraphBackend, StaleGraphAddressError

pytestmark = pytest.mark.usefixtures("one_torch_thread")


GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
BASE = dict(max_model_len=128, max_num_seqs=8, print_startup_report=False)


@pytest.fixture(scope="module")
def llama_path(tmp_path_factory) -> str:
    return str(make_tiny_hf_model("llama", tmp_path_factory.mktemp("llama"), num_hidden_layers=2))


def _prompts(lengths: list[int], seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 500) for _ in range(n)] for n in lengths]


def _tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def _record_replays(llm) -> list[int]:
    """Log the captured size every decode replay uses (llm: an LLM or an LLMEngine)."""
    engine = getattr(llm, "engine", llm)
    graphs = engine.runner.graphs
    sizes: list[int] = []
    replay = graphs.replay

    def logged(size, step):
        sizes.append(size)
        return replay(size, step)

    graphs.replay = logged
    return sizes


# --------------------------------------------------------------------------
# (a) detection
# --------------------------------------------------------------------------


def test_growth_after_capture_is_detected_as_stale_address(llama_path):
    llm = LLM(llama_path, **BASE, graph_backend="recording", cuda_graph_sizes=[1, 2, 4])
    runner = llm.engine.runner
    backend = runner.graphs.backend
    assert isinstance(backend, RecordingGraphBackend)
    ws = runner.workspace
    assert ws.locked
    captured_at = ws.buffer.data_ptr()

    # Bypass the lock (what a bug in a late code path would amount to) and grow.
    ws.unlock()
    ws.get(((ws.size + 1,), torch.uint8))
    assert ws.stats.growths[-1].stage == "serving"
    moved_to = ws.buffer.data_ptr()
    assert moved_to != captured_at

    # The prefill step runs eagerly (no graph); the first decode step replays
    # the size-1 graph, whose captured address is gone.
    with pytest.raises(StaleGraphAddressError) as info:
        llm.generate([{"prompt_token_ids": [5, 6, 7]}], GREEDY, use_tqdm=False)
    msg = str(info.value)
    assert f"0x{captured_at:x}" in msg and f"0x{moved_to:x}" in msg, msg
    assert backend.num_replays == 0


def test_lock_turns_growth_into_an_error_and_serving_stays_correct(llama_path):
    config = dict(BASE, cuda_graph_sizes=[1, 2, 4])
    llm = LLM(llama_path, **config, graph_backend="recording")
    eager = LLM(llama_path, **config, graph_backend="none")
    ws = llm.engine.runner.workspace
    held, ptr, growths = ws.size, ws.buffer.data_ptr(), ws.stats.num_growths

    with pytest.raises(WorkspaceLockedError) as info:
        ws.get(((held + 1,), torch.uint8))
    msg = str(info.value)
    assert "test_graph_hazard.py:" in msg and "test_lock_turns_growth_into_an_error" in msg, msg
    assert f"{held + 256} bytes" in msg and f"{held} bytes" in msg, msg
    assert (ws.size, ws.buffer.data_ptr(), ws.stats.num_growths) == (held, ptr, growths)

    prompts = [{"prompt_token_ids": p} for p in _prompts([3, 9, 20])]  # 3 rows: padded to 4
    replays = _record_replays(llm)
    got = llm.generate(prompts, GREEDY, use_tqdm=False)
    want = eager.generate(prompts, GREEDY, use_tqdm=False)
    assert _tokens(got) == _tokens(want)
    assert replays and set(replays) == {4}
    assert ws.buffer.data_ptr() == ptr and ws.stats.num_growths == growths


# --------------------------------------------------------------------------
# (c) padded replays are correct
# --------------------------------------------------------------------------


def test_padded_replay_greedy_matches_eager_and_hf(llama_path):
    prompts = _prompts([1, 7, 16, 17, 33])  # 5 rows: not a captured size
    config = dict(BASE, cuda_graph_sizes=[1, 2, 4, 8], max_num_batched_tokens=128)
    graphs = LLM(llama_path, **config, graph_backend="recording")
    eager = LLM(llama_path, **config, graph_backend="none")
    assert 5 not in graphs.engine.runner.graphs.sizes
    replays = _record_replays(graphs)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=3)
    batch = [{"prompt_token_ids": p} for p in prompts]
    got, want = (
        graphs.generate(batch, params, use_tqdm=False),
        eager.generate(batch, params, use_tqdm=False),
    )
    hf_tokens, hf_logits = hf_greedy(llama_path, prompts, 8)
    assert _tokens(want) == hf_tokens
    assert _tokens(got) == hf_tokens
    assert replays == [8] * 7  # one prefill step, then 7 decode steps of 5 rows padded to 8
    for out, ref in zip(got, hf_logits, strict=True):
        for step, entries in enumerate(out.outputs[0].logprobs):
            ref_lp = torch.log_softmax(ref[step], dim=-1)
            for token_id, lp in entries.items():
                assert abs(lp.logprob - ref_lp[token_id].item()) <= 1e-4


def test_decode_shaped_batch_with_a_prefill_chunk_samples_only_finished_rows(llama_path):
    """A step whose every row computes one token is replayed as a decode graph,
    but one of those rows may be a 1-token *chunk* of a prompt that is not done
    yet (the token budget ran out). That row must not sample: its hidden state
    is a mid-prompt position. Here max_num_batched_tokens=3 makes the first step
    [A: 1-token prompt, B: 1-token prompt, C: first token of 6] — all rows one
    token long, so the graph path runs it."""
    prompts = _prompts([1, 1, 6], seed=1)
    config = dict(BASE, max_num_seqs=4, cuda_graph_sizes=[1, 2, 4], max_num_batched_tokens=3)
    graphs = LLM(llama_path, **config, graph_backend="recording")
    eager = LLM(llama_path, **config, graph_backend="none")
    batch = [{"prompt_token_ids": p} for p in prompts]
    hf_tokens, _ = hf_greedy(llama_path, prompts, 8)
    assert _tokens(eager.generate(batch, GREEDY, use_tqdm=False)) == hf_tokens
    replays = _record_replays(graphs)
    got = graphs.generate(batch, GREEDY, use_tqdm=False)
    assert replays, "the scenario needs a replayed step"
    assert _tokens(got) == hf_tokens


# --------------------------------------------------------------------------
# (b) the soak
# --------------------------------------------------------------------------

SOAK_STEPS = 2000
SOAK = dict(
    max_model_len=64,
    block_size=8,
    max_num_seqs=8,
    cuda_graph_sizes=[1, 2, 4, 8],
    num_kv_blocks=16,  # 8 blocks per full-length sequence: preemptions
    max_num_batched_tokens=24,  # long prompts in chunks, mixed with decodes
    print_startup_report=False,
)


def _random_request(rng: random.Random, prefixes: list[list[int]], n: int):
    max_len = SOAK["max_model_len"]
    kind = rng.random()
    if kind < 0.4:  # a shared prefix plus a suffix: prefix-cache hits
        prompt = rng.choice(prefixes) + [rng.randrange(3, 500) for _ in range(rng.randint(1, 8))]
    elif kind < 0.7:
        prompt = [rng.randrange(3, 500) for _ in range(rng.randint(1, 12))]
    else:  # up to the limit: one token of room left
        prompt = [rng.randrange(3, 500) for _ in range(rng.randint(1, max_len - 1))]
    max_tokens = rng.randint(1, max(1, min(24, max_len - len(prompt))))
    if rng.random() < 0.5:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    else:
        params = SamplingParams(temperature=0.8, top_k=rng.choice([0, 10]), top_p=0.9,
                                seed=rng.randrange(1 << 30), max_tokens=max_tokens,
                                ignore_eos=True)  # fmt: skip
    return {"prompt_token_ids": prompt}, params, f"r{n}"


def _summary(outputs) -> list[tuple]:
    return [(o.request_id, tuple(o.outputs[0].token_ids), o.finished, o.outputs[0].finish_reason)
            for o in outputs]  # fmt: skip


def test_soak_random_batches_never_grow_the_workspace(llama_path):
    """Thousands of random scheduler steps after READY, on the engine's own
    startup, driven through add_request/step/abort_request exactly as a server
    would; an eager twin engine gets the same calls and must produce the same
    outputs at every step (graph replays, padding included, change nothing)."""
    engine = LLM(llama_path, **SOAK, graph_backend="recording").engine
    twin = LLM(llama_path, **SOAK, graph_backend="none").engine
    ws = engine.runner.workspace
    backend = engine.runner.graphs.backend
    assert ws.locked and twin.runner.workspace.locked
    ready = (ws.size, ws.buffer.data_ptr(), ws.stats.num_growths, ws.stats.largest_request_bytes)
    replays = _record_replays(engine)

    rng = random.Random(1234)
    prefixes = [[rng.randrange(3, 500) for _ in range(n)] for n in (8, 16, 24, 40)]
    bm = engine.scheduler.block_manager
    steps = idle_checks = n = 0
    live: set[str] = set()

    def step() -> None:
        nonlocal steps
        if live and rng.random() < 0.03:  # an abort between steps
            victim = rng.choice(sorted(live))
            engine.abort_request(victim)
            twin.abort_request(victim)
            live.discard(victim)
        got, want = engine.step(), twin.step()
        assert _summary(got) == _summary(want), f"step {steps}: graphs and eager disagree"
        steps += 1
        live.difference_update(o.request_id for o in got if o.finished)
        assert set(engine.scheduler.requests) == live
        if steps % 97 == 0:
            bm.check_invariants(list(engine.scheduler.requests.values()))
        if not engine.has_unfinished_requests():  # idle => every block free
            assert bm.num_free_blocks == bm.num_blocks, f"idle at step {steps} with blocks held"

    start = time.perf_counter()
    while steps < SOAK_STEPS:
        # A burst of arrivals over a random number of steps, then a drain to idle.
        for _ in range(rng.randint(1, 40)):
            for _ in range(rng.choice([0, 0, 0, 1, 1, 2, 4]) if len(live) < 12 else 0):
                prompt, params, request_id = _random_request(rng, prefixes, n)
                n += 1
                engine.add_request(prompt, params, request_id)
                twin.add_request(prompt, params, request_id)
                live.add(request_id)
            step()
        while engine.has_unfinished_requests():
            step()
        assert not twin.has_unfinished_requests()
        assert bm.num_free_blocks == bm.num_blocks, f"idle at step {steps} with blocks held"
        assert twin.scheduler.block_manager.num_free_blocks == bm.num_blocks
        idle_checks += 1
    seconds = time.perf_counter() - start

    assert not twin.has_unfinished_requests()
    assert bm.num_free_blocks == bm.num_blocks
    bm.check_invariants([])
    # The arena never grew, moved, or was asked for more than profile reached.
    assert (ws.size, ws.buffer.data_ptr(), ws.stats.num_growths,
            ws.stats.largest_request_bytes) == ready  # fmt: skip
    assert {g.stage for g in ws.stats.growths} == {"profile"}
    assert ws.locked
    stats = engine.stats()
    print(
        f"soak: {steps} steps, {n} requests, {backend.num_replays} replays, "
        f"{stats['num_preemptions']} preemptions, {stats['prefix_cache_hit_tokens']} hit tokens, "
        f"{idle_checks} idle checks, {seconds:.1f}s"
    )
    assert steps >= SOAK_STEPS
    assert backend.num_replays == len(replays) > SOAK_STEPS // 10
    assert set(replays) == set(SOAK["cuda_graph_sizes"])  # every graph replayed
    assert stats["num_preemptions"] > 0
    assert stats["prefix_cache_hit_tokens"] > 0
    assert stats["jit_compiles_after_ready"] == 0
    assert stats == {**twin.stats(), "workspace_bytes": stats["workspace_bytes"],
                     "workspace_growths": stats["workspace_growths"],
                     "captured_graph_sizes": stats["captured_graph_sizes"],
                     "piecewise_graph_sizes": stats["piecewise_graph_sizes"]}  # fmt: skip
