"""InflightTokens (worker/inflight.py): the rows whose token the last launch
sampled read it on the device, by request — the steady batch's one-copy path
and the general index path give the same input ids."""

from __future__ import annotations

import torch

from tinyengine.worker.inflight import InflightTokens


def _filled(inflight: InflightTokens, waiting: list[tuple[int, str]]) -> list[int]:
    ids = torch.full((8,), -1, dtype=torch.int64)
    inflight.fill(ids, inflight.rows(waiting))
    return ids.tolist()


def test_rows_read_the_ids_their_requests_sampled():
    inflight = InflightTokens()
    inflight.remember(torch.tensor([10, 11, 12, 13]), ["a", "b", "c", "d"])
    # The steady batch (row i is the request sampled at i): one copy.
    assert _filled(inflight, [(0, "a"), (1, "b"), (2, "c")]) == [10, 11, 12] + [-1] * 5
    # Reordered, with a new request at row 1 (its token is known on the host).
    assert _filled(inflight, [(0, "c"), (2, "a"), (3, "d")]) == [12, -1, 10, 13] + [-1] * 4
    # The same ends as the steady batch but a swap inside.
    swapped = [(0, "a"), (1, "c"), (2, "b"), (3, "d")]
    assert _filled(inflight, swapped) == [10, 12, 11, 13] + [-1] * 4
    assert _filled(inflight, []) == [-1] * 8


def test_discard_forgets_them():
    inflight = InflightTokens()
    inflight.remember(torch.tensor([1]), ["a"])
    inflight.discard()
    assert inflight.sampled is None and inflight.row_of == {}
