"""Scheduler: driven exactly as the engine drives it, with a fake model that
reads its context back from a shadow KV cache (tests/scheduling/sim.py).

Targeted tests pin chunked prefill, FCFS admission, preemption, prefix-cache
stats, add_request validation and abort. The random-workload property lives in
test_scheduler_property.py.
"""

from __future__ import annotations

import pytest

from tests.scheduling.sim import Sim, make_request, next_token, reference_output
from tinyengine.scheduling.request import Request, RequestStatus


def rows(out) -> list[tuple[str, int, int]]:
    return [(s.request.request_id, s.start, s.num_new_tokens) for s in out.scheduled]


def assert_matches_reference(sim: Sim, requests: list[Request]) -> None:
    for r in requests:
        want, status = reference_output(r)
        assert sim.finished[r.request_id] is r
        assert r.output_token_ids == want, r
        assert r.status == status


# --- the fake model and the driver itself ---


def test_reference_is_what_a_request_generates_alone() -> None:
    prompt = [3, 1, 4, 1, 5, 9, 2, 6, 5]
    r = make_request("a", prompt, max_tokens=12)
    sim = Sim(num_blocks=64, block_size=4, max_num_seqs=4, max_num_batched_tokens=64)
    sim.add(r)
    sim.run()
    tokens = list(prompt)
    for _ in range(12):
        tokens.append(next_token(tokens))
    assert r.all_token_ids == tokens
    assert r.status == RequestStatus.FINISHED_LENGTH and r.finish_reason == "length"
    assert sim.bm.num_free_blocks == 64


def test_eos_and_stop_token_ids_finish_with_stop() -> None:
    prompt = [1, 2, 3]
    first = next_token(prompt)
    sim = Sim(num_blocks=16, block_size=4, max_num_seqs=4, max_num_batched_tokens=16)
    eos = make_request("eos", prompt, 10, ignore_eos=False, eos=frozenset({first}))
    ignored = make_request("ignored", prompt, 5, ignore_eos=True, eos=frozenset({first}))
    stop = make_request("stop", prompt, 10, stop_token_ids=[first])
    for r in (eos, ignored, stop):
        sim.add(r)
    sim.run()
    assert eos.output_token_ids == [first] and eos.finish_reason == "stop"
    assert eos.stop_reason is None
    assert ignored.num_output_tokens == 5 and ignored.finish_reason == "length"
    assert stop.output_token_ids == [first] and stop.stop_reason == first
    assert_matches_reference(sim, [eos, ignored, stop])


# --- chunked prefill ---


def test_long_prompt_is_chunked_alongside_decode_rows() -> None:
    sim = Sim(num_blocks=64, block_size=4, max_num_seqs=4, max_num_batched_tokens=8)
    a = make_request("a", [1, 2, 3], max_tokens=10)
    sim.add(a)
    assert rows(sim.step()) == [("a", 0, 3)]
    b = make_request("b", list(range(20)), max_tokens=3)  # 20 > the 8-token budget
    sim.add(b)
    out = sim.step()
    assert rows(out) == [("a", 3, 1), ("b", 0, 7)]
    assert sim.last_samples() == [True, False]
    assert b.num_output_tokens == 0 and b.num_computed_tokens == 7
    out = sim.step()
    assert rows(out) == [("a", 4, 1), ("b", 7, 7)]
    out = sim.step()
    assert rows(out) == [("a", 5, 1), ("b", 14, 6)]  # b's last chunk samples
    assert sim.last_samples() == [True, True]
    assert b.num_output_tokens == 1
    assert rows(sim.step()) == [("a", 6, 1), ("b", 20, 1)]
    sim.run()
    assert_matches_reference(sim, [a, b])


def test_budget_is_shared_oldest_running_first() -> None:
    sim = Sim(num_blocks=64, block_size=4, max_num_seqs=8, max_num_batched_tokens=6)
    reqs = [make_request(f"r{i}", [i] * 10, max_tokens=2) for i in range(3)]
    for r in reqs:
        sim.add(r)
    assert rows(sim.step()) == [("r0", 0, 6)]
    assert rows(sim.step()) == [("r0", 6, 4), ("r1", 0, 2)]
    assert rows(sim.step()) == [("r0", 10, 1), ("r1", 2, 5)]
    sim.run()
    assert_matches_reference(sim, reqs)


# --- admission ---


def test_fcfs_nobody_overtakes_the_head_of_the_queue() -> None:
    sim = Sim(num_blocks=8, block_size=4, max_num_seqs=8, max_num_batched_tokens=64)
    running = make_request("running", list(range(16)), max_tokens=8)  # 4 blocks
    sim.add(running)
    sim.step()
    big = make_request("big", [7] * 20, max_tokens=4)  # needs 5 blocks, 3-4 free
    small = make_request("small", [5, 5], max_tokens=2)  # would fit right now
    sim.add(big)
    sim.add(small)
    for _ in range(7):  # `running` decodes its 8 tokens; nobody else is admitted
        out = sim.step()
        assert rows(out)[0][0] == "running"
        assert [r.request_id for r in sim.sched.waiting] == ["big", "small"]
        if running.is_finished:
            break
        assert [s.request.request_id for s in out.scheduled] == ["running"]
    sim.run()
    assert running.is_finished
    # big is admitted before small once `running` has freed its blocks.
    first = {}
    for step, out in enumerate(sim.history):
        for s in out.scheduled:
            first.setdefault(s.request.request_id, step)
    assert first["big"] <= first["small"]
    assert_matches_reference(sim, [running, big, small])


def test_max_num_seqs_caps_running() -> None:
    sim = Sim(num_blocks=64, block_size=4, max_num_seqs=2, max_num_batched_tokens=64)
    reqs = [make_request(f"r{i}", [i, i, i], max_tokens=3) for i in range(4)]
    for r in reqs:
        sim.add(r)
    out = sim.step()
    assert rows(out) == [("r0", 0, 3), ("r1", 0, 3)]
    assert [r.request_id for r in sim.sched.waiting] == ["r2", "r3"]
    sim.run()
    assert all(len(out.scheduled) <= 2 for out in sim.history)
    assert_matches_reference(sim, reqs)


def test_add_request_rejects_duplicate_id() -> None:
    sim = Sim(num_blocks=8, block_size=4, max_num_seqs=4, max_num_batched_tokens=16)
    sim.add(make_request("x", [1, 2], max_tokens=2))
    with pytest.raises(ValueError, match="'x' is already in use"):
        sim.sched.add_request(make_request("x", [3], max_tokens=2))
    assert len(sim.sched.waiting) == 1
    sim.run()
    # A finished request's id may be reused.
    sim.add(make_request("x", [3], max_tokens=2))
    sim.run()


def test_add_request_rejects_a_request_that_can_never_fit() -> None:
    sim = Sim(num_blocks=4, block_size=4, max_num_seqs=4, max_num_batched_tokens=16)
    with pytest.raises(ValueError, match=r"needs up to 5 KV blocks .*the cache has 4"):
        sim.sched.add_request(make_request("big", list(range(10)), max_tokens=7))
    assert not sim.sched.has_unfinished_requests() and not sim.sched.waiting
    # 16 tokens fit exactly.
    ok = make_request("ok", list(range(10)), max_tokens=6)
    sim.add(ok)
    sim.run()
    assert_matches_reference(sim, [ok])


def test_request_rejects_empty_prompt() -> None:
    with pytest.raises(ValueError, match="empty"):
        make_request("e", [], max_tokens=1)


# --- preemption ---


def test_preemption_picks_the_newest_running_request() -> None:
    sim = Sim(num_blocks=4, block_size=2, max_num_seqs=8, max_num_batched_tokens=64)
    a = make_request("a", [1, 2, 3], max_tokens=5)  # 3 + 5 tokens: 4 blocks
    b = make_request("b", [4], max_tokens=3)
    c = make_request("c", [5], max_tokens=3)
    for r in (a, b, c):
        sim.add(r)
    assert rows(sim.step()) == [("a", 0, 3), ("b", 0, 1), ("c", 0, 1)]  # 2 + 1 + 1 blocks
    assert sim.bm.num_free_blocks == 0
    out = sim.step()  # a: 4 tokens fit its 2 blocks; b, c: 2 tokens fit 1 block
    assert rows(out) == [("a", 3, 1), ("b", 1, 1), ("c", 1, 1)] and not out.preempted
    # a needs a 3rd block: c, the newest, is preempted for it. Then b needs a
    # 2nd block and is itself the newest running request: it preempts itself.
    out = sim.step()
    assert [r.request_id for r in out.preempted] == ["c", "b"]
    assert rows(out) == [("a", 4, 1)]
    assert sim.sched.stats.num_preemptions == 2
    for r in (b, c):
        assert r.num_preemptions == 1 and r.num_computed_tokens == 0 and r.block_ids == []
        assert r.status == RequestStatus.WAITING
    assert [r.request_id for r in sim.sched.waiting] == ["b", "c"]  # oldest first
    assert sim.bm.num_free_blocks == 1
    sim.run()
    assert sum(len(o.preempted) for o in sim.history) == sim.sched.stats.num_preemptions
    assert_matches_reference(sim, [a, b, c])  # recompute is invisible in the output
    assert sim.bm.num_free_blocks == 4


def test_older_request_preempts_newer_and_newest_preempts_itself() -> None:
    sim = Sim(num_blocks=3, block_size=2, max_num_seqs=8, max_num_batched_tokens=64)
    a = make_request("a", [1], max_tokens=3)
    b = make_request("b", [2, 3, 4], max_tokens=3)  # 3 + 3 tokens: 3 blocks
    sim.add(a)
    sim.add(b)
    sim.step()  # a: 1 block, b: 2 blocks
    out = sim.step()  # a: 2 tokens fit; b: 4 tokens fit
    assert not out.preempted
    out = sim.step()  # a at 3 tokens needs a 2nd block -> b preempted
    assert [r.request_id for r in out.preempted] == ["b"]
    assert rows(out) == [("a", 2, 1)]
    sim.run()
    assert_matches_reference(sim, [a, b])

    # Now the newest running request is the one that cannot grow, while the
    # older one fits: the newest preempts itself and the older one still runs.
    sim = Sim(num_blocks=2, block_size=4, max_num_seqs=8, max_num_batched_tokens=64)
    a = make_request("a", [1, 2], max_tokens=2)  # never needs a 2nd block
    b = make_request("b", [5, 6, 7, 8], max_tokens=3)
    sim.add(a)
    sim.add(b)
    sim.step()  # a: 1 block, b: 1 block
    out = sim.step()  # b at 5 tokens needs a 2nd block; nobody newer to preempt
    assert [r.request_id for r in out.preempted] == ["b"]
    assert rows(out) == [("a", 2, 1)]
    assert b.num_output_tokens == 1 and b.block_ids == []
    sim.run()
    assert_matches_reference(sim, [a, b])


def test_no_admission_in_a_step_that_preempted() -> None:
    sim = Sim(num_blocks=4, block_size=2, max_num_seqs=8, max_num_batched_tokens=64)
    a = make_request("a", [1, 2, 3], max_tokens=5)
    b = make_request("b", [4, 5, 6], max_tokens=1)
    sim.add(a)
    sim.add(b)
    sim.step()  # a: 2 blocks; b: 2 blocks, samples its only token and finishes
    assert b.is_finished
    c = make_request("c", [7, 8, 9], max_tokens=3)
    sim.add(c)
    sim.step()  # a decodes in its 2 blocks, c takes the other 2
    d = make_request("d", [1], max_tokens=1)
    sim.add(d)
    out = sim.step()  # a needs a 3rd block: c preempted; d must not be admitted
    assert [r.request_id for r in out.preempted] == ["c"]
    assert rows(out) == [("a", 4, 1)]
    assert [r.request_id for r in sim.sched.waiting] == ["c", "d"]
    sim.run()
    assert_matches_reference(sim, [a, b, c, d])


# --- prefix caching ---


def test_prefix_cache_hit_after_the_first_request_computed_it() -> None:
    sim = Sim(num_blocks=32, block_size=4, max_num_seqs=8, max_num_batched_tokens=64)
    shared = list(range(100, 112))  # 3 full blocks
    a = make_request("a", shared + [1], max_tokens=2)
    sim.add(a)
    sim.step()
    stats = sim.sched.stats
    assert stats.prefix_cache_hit_tokens == 0 and stats.prefix_cache_query_tokens == 13
    assert a.num_cached_tokens == 0
    a_prefix = a.block_ids[:3]
    b = make_request("b", shared + [2, 3], max_tokens=2)
    sim.add(b)
    out = sim.step()
    assert ("b", 12, 2) in rows(out)
    assert b.num_cached_tokens == 12 and b.block_ids[:3] == a_prefix
    assert stats.prefix_cache_hit_tokens == 12 and stats.prefix_cache_query_tokens == 13 + 14
    sim.run()
    # Still cached after both finished: a third request hits without recompute.
    c = make_request("c", shared + [9], max_tokens=2)
    sim.add(c)
    assert rows(sim.step()) == [("c", 12, 1)]
    assert stats.prefix_cache_hit_tokens == 24
    sim.run()
    assert_matches_reference(sim, [a, b, c])


def test_same_step_identical_prompts_hit_each_other() -> None:
    # b is admitted after a in the same step: a's chunk fills two blocks,
    # indexed as the chunk is planned, so b computes only its last token.
    sim = Sim(num_blocks=32, block_size=4, max_num_seqs=8, max_num_batched_tokens=64)
    a = make_request("a", list(range(9)), max_tokens=2)
    b = make_request("b", list(range(9)), max_tokens=2)
    sim.add(a)
    sim.add(b)
    assert rows(sim.step()) == [("a", 0, 9), ("b", 8, 1)]
    assert sim.sched.stats.prefix_cache_hit_tokens == 8 and b.block_ids[:2] == a.block_ids[:2]
    sim.run()
    assert a.output_token_ids == b.output_token_ids
    assert_matches_reference(sim, [a, b])


def test_same_step_hits_follow_a_chunked_writer_block_by_block() -> None:
    # a's prompt goes in 6-token chunks: b, admitted beside each chunk, hits
    # only the blocks a's chunks so far fill.
    sim = Sim(num_blocks=32, block_size=4, max_num_seqs=8, max_num_batched_tokens=8)
    a = make_request("a", list(range(14)), max_tokens=2)
    sim.add(a)
    assert rows(sim.step()) == [("a", 0, 8)]
    b = make_request("b", list(range(14)) + [99], max_tokens=2)
    sim.add(b)
    # a's second chunk (6 tokens) fills block 2 and part of 3; b hits blocks 0-2.
    assert rows(sim.step()) == [("a", 8, 6), ("b", 12, 2)]
    sim.run()
    assert_matches_reference(sim, [a, b])


def test_a_same_step_hit_survives_its_writer_aborted_while_the_step_runs() -> None:
    sim = Sim(num_blocks=32, block_size=4, max_num_seqs=8, max_num_batched_tokens=64)
    a = make_request("a", list(range(12)) + [1], max_tokens=3)
    b = make_request("b", list(range(12)) + [2], max_tokens=3)
    sim.add(a)
    sim.add(b)
    sim.step(abort_mid_step="a")  # the step computed a's blocks; b holds them
    assert b.num_cached_tokens == 12
    sim.run()
    assert_matches_reference(sim, [b])


def test_a_failed_step_leaves_no_uncomputed_block_to_hit() -> None:
    # The engine drops a failed step's requests (LLMEngine.drop_failed_step),
    # uncaching their blocks first: the K/V the step was to write may be missing.
    sim = Sim(num_blocks=32, block_size=4, max_num_seqs=8, max_num_batched_tokens=64)
    a = make_request("a", list(range(12)) + [1], max_tokens=3)
    b = make_request("b", list(range(12)) + [2], max_tokens=3)
    sim.add(a)
    sim.add(b)
    out = sim.sched.schedule()  # planned, never run
    assert b.num_cached_tokens == 12 and len(sim.bm.cached) == 3
    for s in out.scheduled:
        sim.bm.uncache(s.request)
        sim.abort(s.request.request_id)
    assert not sim.bm.cached
    c = make_request("c", list(range(12)) + [3], max_tokens=2)
    sim.add(c)
    assert rows(sim.step()) == [("c", 0, 13)]
    sim.run()
    assert_matches_reference(sim, [c])


def test_a_sliding_group_indexes_blocks_only_after_their_step() -> None:
    # DeepSeek-V4's cache groups (BlockManager docstring): no same-step hits.
    sim = Sim(num_blocks=32, block_size=4, max_num_seqs=8, max_num_batched_tokens=64,
              sliding_keep=4)  # fmt: skip
    a = make_request("a", list(range(9)), max_tokens=2)
    b = make_request("b", list(range(9)), max_tokens=2)
    sim.add(a)
    sim.add(b)
    assert rows(sim.step()) == [("a", 0, 9), ("b", 0, 9)]
    c = make_request("c", list(range(9)), max_tokens=2)
    sim.add(c)
    assert ("c", 8, 1) in rows(sim.step())  # after the step: a hit
    sim.run()
    assert_matches_reference(sim, [a, b, c])


def test_preempted_request_resumes_from_its_own_cached_blocks() -> None:
    sim = Sim(num_blocks=6, block_size=2, max_num_seqs=8, max_num_batched_tokens=64)
    a = make_request("a", [1, 2, 3, 4, 5], max_tokens=6)  # 11 tokens: 6 blocks
    b = make_request("b", [6, 7, 8, 9, 6], max_tokens=4)
    sim.add(a)
    sim.add(b)
    sim.run()
    preempted = [r.request_id for o in sim.history for r in o.preempted]
    assert "b" in preempted
    assert b.num_preemptions >= 1
    assert sim.sched.stats.prefix_cache_hit_tokens > 0  # b's re-admission hit
    assert_matches_reference(sim, [a, b])


def test_prefix_caching_disabled_recomputes() -> None:
    sim = Sim(
        num_blocks=32,
        block_size=4,
        max_num_seqs=8,
        max_num_batched_tokens=64,
        enable_prefix_caching=False,
    )
    a = make_request("a", list(range(13)), max_tokens=2)
    sim.add(a)
    sim.run()
    b = make_request("b", list(range(13)), max_tokens=2)
    sim.add(b)
    assert rows(sim.step()) == [("b", 0, 13)]
    sim.run()
    assert sim.sched.stats.prefix_cache_hit_tokens == 0
    assert_matches_reference(sim, [a, b])


# --- abort ---


def test_abort_waiting_and_running_requests_free_their_blocks() -> None:
    sim = Sim(num_blocks=8, block_size=4, max_num_seqs=1, max_num_batched_tokens=64)
    a = make_request("a", list(range(10)), max_tokens=5)
    b = make_request("b", [1, 2], max_tokens=5)
    sim.add(a)
    sim.add(b)
    sim.step()
    assert a.status == RequestStatus.RUNNING and b.status == RequestStatus.WAITING
    assert sim.bm.num_free_blocks == 5
    sim.abort("b")
    assert b.status == RequestStatus.FINISHED_ABORTED and b.finish_reason == "abort"
    assert list(sim.sched.waiting) == [] and "b" not in sim.sched.requests
    sim.abort("a")
    assert a.status == RequestStatus.FINISHED_ABORTED and a.block_ids == []
    assert sim.sched.running == [] and not sim.sched.has_unfinished_requests()
    assert sim.bm.num_free_blocks == 8
    assert sim.sched.abort("a") is None and sim.sched.abort("nope") is None
    assert sim.step().is_empty


def test_abort_a_preempted_request_in_the_waiting_queue() -> None:
    sim = Sim(num_blocks=3, block_size=2, max_num_seqs=8, max_num_batched_tokens=64)
    a = make_request("a", [1, 2, 3], max_tokens=3)
    b = make_request("b", [4], max_tokens=3)
    sim.add(a)
    sim.add(b)
    sim.step()
    sim.step()
    assert [r.request_id for r in sim.step().preempted] == ["b"]
    sim.abort("b")
    assert b.status == RequestStatus.FINISHED_ABORTED and not sim.sched.waiting
    sim.run()
    assert_matches_reference(sim, [a])
    assert sim.bm.num_free_blocks == 3


def test_abort_while_the_step_runs_drops_its_token() -> None:
    sim = Sim(num_blocks=16, block_size=4, max_num_seqs=8, max_num_batched_tokens=64)
    a = make_request("a", [1, 2, 3], max_tokens=4)
    b = make_request("b", [4, 5, 6], max_tokens=4)
    sim.add(a)
    sim.add(b)
    sim.step()
    sim.step(abort_mid_step="a")
    assert a.status == RequestStatus.FINISHED_ABORTED
    assert a.num_output_tokens == 1  # the token of the aborted step was dropped
    assert b.num_output_tokens == 2
    sim.run()
    assert_matches_reference(sim, [b])
    assert sim.bm.num_free_blocks == 16
