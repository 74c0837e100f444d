"""HostBlockTable: every live request's block ids, kept in one persistent
numpy table on the host and updated only where they changed.

Owns the host side of the step's block table. Rebuilding a [rows, width]
table from one Python list per row every step costs host time that grows with
the batch (a real share of a decode step at large batches); but a request's
block list only grows by one entry every block_size tokens. So each request
keeps a row ("slot") of this table, its new entries are copied in when its
list grew, and a step's table is one fancy-index gather of the scheduled
requests' rows.

Change detection relies on how the block manager edits `Request.block_ids`:
entries are only ever appended to the list in place, and freeing (finish,
preemption) replaces it with a new list. A slot remembers the list object it
copied from and how many entries; a different object means "rewrite the
row". Stale entries right of a row's length are never read: the attention
kernels only look at a row's entries below its sequence length.
"""

from __future__ import annotations

import numpy as np

from tinyengine.scheduling.request import Request


class HostBlockTable:
    def __init__(self, max_blocks_per_seq: int, num_slots: int = 64) -> None:
        self.table = np.zeros((num_slots, max_blocks_per_seq), dtype=np.int32)
        self._slot_of: dict[str, int] = {}
        self._free: list[int] = list(range(num_slots - 1, -1, -1))
        # Per slot: the block_ids list last copied from, and its length then.
        self._source: list[tuple[list[int] | None, int]] = [(None, 0)] * num_slots

    def slots(self, requests: list[Request]) -> tuple[np.ndarray, int]:
        """Bring the scheduled requests' rows up to date; returns their slots
        (in order) and the widest row's length (at least 1)."""
        out = np.empty(len(requests), dtype=np.int64)
        width = 1
        for i, request in enumerate(requests):
            slot = self._slot_of.get(request.request_id)
            if slot is None:
                slot = self._assign(request.request_id)
            ids = request.block_ids
            n = len(ids)
            source, copied = self._source[slot]
            if source is not ids or copied != n:
                start = copied if source is ids else 0
                self.table[slot, start:n] = ids[start:]
                self._source[slot] = (ids, n)
            out[i] = slot
            if n > width:
                width = n
        return out, width

    def gather(self, slots: np.ndarray, width: int, pad_to: int, pad_block: int) -> np.ndarray:
        """The step's table [max(len(slots), pad_to), width]: the slots' rows,
        then padding rows that read only `pad_block`."""
        rows = self.table[slots, :width]
        if pad_to > len(slots):
            pad = np.full((pad_to - len(slots), width), pad_block, dtype=np.int32)
            rows = np.concatenate([rows, pad])
        return rows

    def release(self, request_id: str) -> None:
        """The request is gone (finished or aborted): its slot is reusable."""
        slot = self._slot_of.pop(request_id, None)
        if slot is not None:
            self._source[slot] = (None, 0)
            self._free.append(slot)

    def _assign(self, request_id: str) -> int:
        if not self._free:  # more live requests than slots: double the table
            old = len(self.table)
            grown = np.zeros((2 * old, self.table.shape[1]), dtype=np.int32)
            grown[:old] = self.table
            self.table = grown
            self._source += [(None, 0)] * old
            self._free = list(range(2 * old - 1, old - 1, -1))
        slot = self._free.pop()
        self._slot_of[request_id] = slot
        return slot
