"""Asynchronous scheduling's hand-over between steps: the ids the last
launched step sampled, still on the device, which the next step's rows read
as their input tokens before the host has seen them.

Owns those ids and which request each belongs to. It never waits for them:
the copy into input_ids is stream-ordered after the step that sampled them.
"""

from __future__ import annotations

import torch


class InflightTokens:
    def __init__(self) -> None:
        self.sampled: torch.Tensor | None = None  # the last launch's ids, one per request
        self.row_of: dict[str, int] = {}  # request id -> its index in `sampled`

    def remember(self, token_ids: torch.Tensor, request_ids: list[str]) -> None:
        """Workers get rank 0's ids without the request ids (rank 0 plans)."""
        self.sampled = token_ids
        self.row_of = {request_id: i for i, request_id in enumerate(request_ids)}

    def rows(self, waiting: list[tuple[int, str]]) -> list[tuple[int, int]]:
        """(input row, index into the last sampled ids) for each (row, request
        id) whose token is still in flight."""
        return [(row, self.row_of[request_id]) for row, request_id in waiting]

    def fill(self, input_ids: torch.Tensor, inflight: list[tuple[int, int]]) -> None:
        """input_ids[row] = the id the last launch sampled at `index`."""
        if not inflight:
            return
        n = len(inflight)
        if n <= len(self.sampled) and inflight == _identity(n):
            # The steady decode batch: row i reads id i. One device copy, no
            # index tensor to send.
            input_ids[:n].copy_(self.sampled[:n])
            return
        index = torch.tensor(list(zip(*inflight, strict=True)), dtype=torch.long)
        index = index.to(input_ids.device, non_blocking=True)
        ids = self.sampled.index_select(0, index[1]).to(input_ids.dtype)
        input_ids.index_copy_(0, index[0], ids)

    def discard(self) -> None:
        """Forget them (their step failed): no later step may read them."""
        self.sampled = None
        self.row_of = {}


_IDENTITY: list[tuple[int, int]] = []


def _identity(n: int) -> list[tuple[int, int]]:
    """[(0, 0), (1, 1), ..., (n - 1, n - 1)], from one growing list."""
    if len(_IDENTITY) < n:
        _IDENTITY.extend((i, i) for i in range(len(_IDENTITY), max(n, 2 * len(_IDENTITY))))
    return _IDENTITY[:n]
