"""HostBlockTable (tinyengine/worker/block_table.py): the persistent host copy
of every live request's block ids must always equal the requests' lists, as
the block manager appends to them, replaces them (preemption, finish) and
requests come and go."""

from __future__ import annotations

import random

import numpy as np

from tinyengine.sampling_params import SamplingParams
from tinyengine.scheduling.request import Request
from tinyengine.worker.block_table import HostBlockTable


def request(rid: str) -> Request:
    return Request(rid, [1, 2, 3], SamplingParams(), max_tokens=8)


def expected(requests: list[Request], pad_to: int, pad_block: int) -> np.ndarray:
    width = max([1] + [len(r.block_ids) for r in requests])
    table = np.full((max(len(requests), pad_to), width), -1, dtype=np.int32)
    for i, r in enumerate(requests):
        table[i, : len(r.block_ids)] = r.block_ids
    table[len(requests) :] = pad_block
    return table


def check(bt: HostBlockTable, requests: list[Request], pad_to: int = 0) -> None:
    slots, width = bt.slots(requests)
    got = bt.gather(slots, width, pad_to, pad_block=99)
    want = expected(requests, pad_to, 99)
    assert got.shape == want.shape
    # Entries right of a row's length are never read by the kernels: only
    # the live prefix of each row (and whole padding rows) must match.
    for i in range(len(want)):
        n = len(requests[i].block_ids) if i < len(requests) else want.shape[1]
        assert got[i, :n].tolist() == want[i, :n].tolist(), i


def test_rows_follow_appends_replacements_and_reuse() -> None:
    bt = HostBlockTable(max_blocks_per_seq=32, num_slots=2)  # forces growth
    rng = random.Random(0)
    live: list[Request] = []
    next_block, next_id = 0, 0
    for _ in range(400):
        op = rng.random()
        if op < 0.15 or not live:
            live.append(request(f"r{next_id}"))
            next_id += 1
        elif op < 0.25:  # finished: the engine releases it
            gone = live.pop(rng.randrange(len(live)))
            bt.release(gone.request_id)
        elif op < 0.35:  # preempted: the block manager replaces the list
            victim = rng.choice(live)
            victim.block_ids = []
        else:  # decode steps: some rows grow by a block, in place
            for r in live:
                if len(r.block_ids) < 32 and rng.random() < 0.3:
                    r.block_ids.append(next_block)
                    next_block += 1
        batch = rng.sample(live, rng.randint(1, len(live)))  # any order, any subset
        check(bt, batch, pad_to=rng.choice([0, len(batch) + 3]))


def test_a_reused_request_id_gets_its_own_blocks() -> None:
    bt = HostBlockTable(max_blocks_per_seq=8)
    first = request("same")
    first.block_ids.extend([5, 6, 7])
    check(bt, [first])
    second = request("same")  # the id reused without a release (an abort race)
    second.block_ids.extend([1, 2, 3])  # same length, other blocks
    check(bt, [second])


def test_padding_rows_only_read_the_pad_block() -> None:
    bt = HostBlockTable(max_blocks_per_seq=8)
    slots, width = bt.slots([])
    assert width == 1
    assert bt.gather(slots, width, 4, pad_block=42).tolist() == [[42]] * 4
