"""WaitingQueue: the scheduler's waiting requests, grouped for fair admission.

A *group* is what one caller submitted together. The server puts one HTTP
request's prompts x n in one group (named by its request id); requests added
without a group (offline `LLM.generate`, most tests) share the default group,
None.

Order: within a group, first come first served, and a preempted request goes
back to the head of its group. Across groups, the next admission goes to the
group that runs the fewest requests at that moment; among equals, to the group
whose head arrived first. With one group this is plain FCFS. With many groups
each running at most one request (many one-prompt clients) it is FCFS too. And a
one-prompt request that arrives while a 4,000-sequence request is being
admitted is next in line, not 4,000th.

Pure Python: no torch.
"""

from __future__ import annotations

import heapq
from collections import Counter, deque
from collections.abc import Hashable, Iterator

from tinyengine.scheduling.request import Request


class WaitingQueue:
    def __init__(self) -> None:
        self._groups: dict[Hashable, deque[Request]] = {}
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def __bool__(self) -> bool:
        return self._len > 0

    def __iter__(self) -> Iterator[Request]:
        """Every waiting request: groups in the order of their heads' arrival,
        each group in its own order."""
        for queue in sorted(self._groups.values(), key=lambda q: q[0].arrival_time):
            yield from queue

    def __contains__(self, request: object) -> bool:
        return isinstance(request, Request) and request in self._groups.get(request.group, ())

    @property
    def num_groups(self) -> int:
        return len(self._groups)

    def append(self, request: Request) -> None:
        self._groups.setdefault(request.group, deque()).append(request)
        self._len += 1

    def appendleft(self, request: Request) -> None:
        """A preempted request: back to the head of its group."""
        self._groups.setdefault(request.group, deque()).appendleft(request)
        self._len += 1

    def remove(self, request: Request) -> None:
        queue = self._groups[request.group]
        queue.remove(request)
        self._len -= 1
        if not queue:
            del self._groups[request.group]

    def idle_group_heads(self, running: Counter[Hashable]) -> list[Request]:
        """The heads of the groups that have nothing running, oldest first."""
        heads = [q[0] for g, q in self._groups.items() if not running[g]]
        heads.sort(key=lambda r: r.arrival_time)
        return heads

    def admission(self, running: Counter[Hashable]) -> Admission:
        """One step's walk over the groups in admission order; `running` (how
        many requests each group runs) is updated as requests are admitted."""
        return Admission(self, running)

    def _popleft(self, group: Hashable) -> Request:
        queue = self._groups[group]
        request = queue.popleft()
        self._len -= 1
        if not queue:
            del self._groups[group]
        return request


class Admission:
    """A heap of the waiting groups keyed by (requests running, head's arrival).
    The scheduler peeks at the next candidate and either admits it, skips its
    group for this step, or stops."""

    def __init__(self, queue: WaitingQueue, running: Counter[Hashable]) -> None:
        self._queue = queue
        self._running = running
        # The index breaks ties without comparing groups (which may be None).
        self._heap = [
            (running[g], q[0].arrival_time, i, g) for i, (g, q) in enumerate(queue._groups.items())
        ]
        heapq.heapify(self._heap)

    def peek(self) -> Request | None:
        return self._queue._groups[self._heap[0][3]][0] if self._heap else None

    def skip_group(self) -> None:
        """The peeked request's group sits this step out."""
        heapq.heappop(self._heap)

    def admit(self) -> Request:
        """Take the peeked request out of the queue; its group now runs one more."""
        _, _, i, group = self._heap[0]
        request = self._queue._popleft(group)
        self._running[group] += 1
        queue = self._queue._groups.get(group)
        if queue:
            heapq.heapreplace(self._heap, (self._running[group], queue[0].arrival_time, i, group))
        else:
            heapq.heappop(self._heap)
        return request
