"""Fair admission across groups (scheduling/waiting_queue.py and the
scheduler's fair share): a group of requests submitted together cannot hold
the engine while another group's request waits. Driven by the same
engine-shaped simulator as the other scheduler tests, so every step also
checks the block invariants and that outputs equal each request run alone."""

from __future__ import annotations

from tests.scheduling.sim import Sim, make_request, reference_output
from tinyengine.scheduling.request import Request


def admitted_at(sim: Sim, request_id: str) -> int:
    """The step at which `request_id` was first scheduled."""
    for step_no, out in enumerate(sim.history):
        if any(s.request.request_id == request_id for s in out.scheduled):
            return step_no
    raise AssertionError(f"{request_id} was never scheduled")


def assert_all_match_reference(sim: Sim, requests: list[Request]) -> None:
    for r in requests:
        want, status = reference_output(r)
        assert r.output_token_ids == want, r
        assert r.status == status, r


def big_group(n: int, max_tokens: int = 6) -> list[Request]:
    return [make_request(f"big-{i}", [1, 2, i % 7], max_tokens, group="big") for i in range(n)]


def test_a_late_small_request_runs_the_next_step_not_after_the_big_group() -> None:
    sim = Sim(num_blocks=256, block_size=4, max_num_seqs=4, max_num_batched_tokens=64)
    big = big_group(40)
    for r in big:
        sim.add(r)
    sim.step()
    sim.step()
    small = make_request("small", [5, 5, 5], max_tokens=3, group="small")
    sim.add(small)
    out = sim.step()
    # All four slots were the big group's: its newest running request made room.
    assert [r.request_id for r in out.preempted] == ["big-3"]
    assert "small" in [s.request.request_id for s in out.scheduled]
    sim.run()
    assert admitted_at(sim, "small") == 2
    assert sim.finished["small"].num_output_tokens == 3
    assert_all_match_reference(sim, [*big, small])  # the recompute is invisible
    assert sim.bm.num_free_blocks == sim.bm.num_blocks


def test_without_groups_a_late_request_waits_its_turn() -> None:
    """The default group (offline LLM.generate) stays strictly FCFS."""
    sim = Sim(num_blocks=256, block_size=4, max_num_seqs=4, max_num_batched_tokens=64)
    big = [make_request(f"big-{i}", [1, 2, i % 7], 6) for i in range(12)]
    for r in big:
        sim.add(r)
    sim.step()
    late = make_request("late", [5, 5, 5], max_tokens=3)
    sim.add(late)
    sim.run()
    assert sim.sched.stats.num_preemptions == 0
    assert admitted_at(sim, "late") > max(admitted_at(sim, r.request_id) for r in big)


def test_freed_slots_go_to_the_group_running_fewer() -> None:
    sim = Sim(num_blocks=256, block_size=4, max_num_seqs=4, max_num_batched_tokens=64)
    a = [make_request(f"a{i}", [1, i], 2 if i < 2 else 8, group="a") for i in range(10)]
    for r in a:
        sim.add(r)
    sim.step()  # a0..a3 run
    b = [make_request(f"b{i}", [2, i], 8, group="b") for i in range(4)]
    for r in b:
        sim.add(r)
    out = sim.step()  # b is idle: a3, the newest of a's four, makes room for b0
    assert [r.request_id for r in out.preempted] == ["a3"]
    assert [s.request.request_id for s in out.scheduled if s.start == 0] == ["b0"]
    # a0 and a1 finished: two free slots, a and b run one each. The tie goes
    # to the group whose head came first (a3, back at a's head), then b runs
    # fewer and takes the second slot, although a4..a9 arrived before b1.
    out = sim.step()
    assert [s.request.request_id for s in out.scheduled if s.start == 0] == ["a3", "b1"]
    sim.run()
    assert_all_match_reference(sim, [*a, *b])


def test_a_groups_last_running_request_is_never_preempted_for_fairness() -> None:
    """With every slot held by a different group, a new group waits: taking a
    group's only running request would just move the starvation."""
    sim = Sim(num_blocks=256, block_size=4, max_num_seqs=3, max_num_batched_tokens=64)
    owners = [make_request(f"g{i}", [i, 1], 5, group=f"g{i}") for i in range(3)]
    for r in owners:
        sim.add(r)
    sim.step()
    late = make_request("late", [3, 3], 2, group="late")
    sim.add(late)
    sim.run()
    assert sim.sched.stats.num_preemptions == 0
    assert admitted_at(sim, "late") == 5  # when the first slot frees
    assert_all_match_reference(sim, [*owners, late])


def test_fair_share_frees_blocks_not_only_slots() -> None:
    """The big group holds every block but not every slot: the small group's
    head still gets the blocks for its prompt."""
    sim = Sim(num_blocks=8, block_size=2, max_num_seqs=8, max_num_batched_tokens=64)
    big = [make_request(f"big-{i}", [1, i, 2, i], 4, group="big") for i in range(8)]
    for r in big:
        sim.add(r)
    sim.step()  # four run, two blocks each: the cache is full
    assert sim.bm.num_free_blocks == 0 and len(sim.sched.running) == 4
    small = make_request("small", [4, 4, 4], 2, group="small")
    sim.add(small)
    out = sim.step()
    assert "small" in [s.request.request_id for s in out.scheduled]
    assert out.preempted and all(r.group == "big" for r in out.preempted)
    sim.run()
    assert_all_match_reference(sim, [*big, small])
    assert sim.bm.num_free_blocks == sim.bm.num_blocks
