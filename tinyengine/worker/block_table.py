"""HostBlockTable: every live request's block ids, kept in persistent numpy
tables on the host and updated only where they changed.

Owns the host side of the step's block tables. Rebuilding a [rows, width]
table from one Python list per row every step costs host time that grows with
the batch (a real share of a decode step at large batches); but a request's
block list only grows by one entry every block_size tokens. So each request
keeps a row ("slot") of this table, its new entries are copied in when its
list grew, and a step's table is one fancy-index gather of the scheduled
requests' rows.

Two cache groups (scheduling/block_manager.py): `table` then holds the
sliding group's ids (`Request.window_block_ids`, which the per-token
writes and reads use) and `entry_table` the full-history group's
(`Request.block_ids`); a released sliding entry (NULL_BLOCK) becomes
`null_block`, a reserved block of finite numbers.

Change detection relies on how the block manager edits the lists: entries
are only ever appended in place, and anything else (freeing, releasing
sliding blocks) replaces the list with a new one. A slot remembers the list
object it copied from and how many entries; a different object means
"rewrite the row". Stale entries right of a row's length are never read: the
kernels only look at a row's entries below its sequence length.
"""

from __future__ import annotations

import numpy as np

from tinyengine.scheduling.request import Request


class _Rows:
    """One group's table and, per slot, the list last copied and its length."""

    def __init__(self, num_slots: int, width: int) -> None:
        self.table = np.zeros((num_slots, width), dtype=np.int32)
        self.source: list[tuple[list[int] | None, int]] = [(None, 0)] * num_slots

    def update(self, slot: int, ids: list[int], null_block: int) -> None:
        n = len(ids)
        source, copied = self.source[slot]
        if source is ids and copied == n:
            return
        start = copied if source is ids else 0
        row = self.table[slot, start:n]
        row[:] = ids[start:]
        row[row < 0] = null_block
        self.source[slot] = (ids, n)

    def grow(self, num_slots: int) -> None:
        old = len(self.table)
        grown = np.zeros((num_slots, self.table.shape[1]), dtype=np.int32)
        grown[:old] = self.table
        self.table = grown
        self.source += [(None, 0)] * (num_slots - old)


class HostBlockTable:
    def __init__(self, max_blocks_per_seq: int, num_slots: int = 64, sliding: bool = False):
        self.sliding = sliding
        self.null_block = 0  # the runner sets it once the cache exists
        self._rows = _Rows(num_slots, max_blocks_per_seq)
        self._entry_rows = _Rows(num_slots, max_blocks_per_seq) if sliding else None
        self._slot_of: dict[str, int] = {}
        self._free: list[int] = list(range(num_slots - 1, -1, -1))

    @property
    def table(self) -> np.ndarray:
        return self._rows.table

    def token_block_ids(self, request: Request) -> list[int]:
        """The blocks the per-token writes go to."""
        return request.window_block_ids if self.sliding else request.block_ids

    def slots(self, requests: list[Request]) -> tuple[np.ndarray, int]:
        """Bring the scheduled requests' rows up to date; returns their slots
        (in order) and the widest row's length (at least 1)."""
        slots: list[int] = []
        width = 1
        slot_of, rows, entry_rows = self._slot_of, self._rows, self._entry_rows
        sources = rows.source
        for request in requests:
            slot = slot_of.get(request.request_id)
            if slot is None:
                slot = self._assign(request.request_id)
                sources = rows.source  # _assign may have grown the table
            ids = request.window_block_ids if self.sliding else request.block_ids
            n = len(ids)
            source, copied = sources[slot]
            if source is not ids or copied != n:  # most steps: unchanged
                rows.update(slot, ids, self.null_block)
            if entry_rows is not None:
                entry_rows.update(slot, request.block_ids, self.null_block)
            slots.append(slot)
            if n > width:
                width = n
        return np.array(slots, dtype=np.int64), width

    def gather(self, slots: np.ndarray, width: int, pad_to: int, pad_block: int) -> np.ndarray:
        """The step's table [max(len(slots), pad_to), width]: the slots' rows,
        then padding rows that read only `pad_block`."""
        return _gather(self._rows.table, slots, width, pad_to, pad_block)

    def gather_entries(
        self, slots: np.ndarray, width: int, pad_to: int, pad_block: int
    ) -> np.ndarray:
        """The same for the full-history group's table (two groups only)."""
        return _gather(self._entry_rows.table, slots, width, pad_to, pad_block)

    def release(self, request_id: str) -> None:
        """The request is gone (finished or aborted): its slot is reusable."""
        slot = self._slot_of.pop(request_id, None)
        if slot is not None:
            for rows in (self._rows, self._entry_rows):
                if rows is not None:
                    rows.source[slot] = (None, 0)
            self._free.append(slot)

    def _assign(self, request_id: str) -> int:
        if not self._free:  # more live requests than slots: double the table
            old = len(self._rows.table)
            for rows in (self._rows, self._entry_rows):
                if rows is not None:
                    rows.grow(2 * old)
            self._free = list(range(2 * old - 1, old - 1, -1))
        slot = self._free.pop()
        self._slot_of[request_id] = slot
        return slot


def _gather(table: np.ndarray, slots: np.ndarray, width: int, pad_to: int, pad_block: int):
    rows = table[slots, :width]
    if pad_to > len(slots):
        pad = np.full((pad_to - len(slots), width), pad_block, dtype=np.int32)
        rows = np.concatenate([rows, pad])
    return rows
