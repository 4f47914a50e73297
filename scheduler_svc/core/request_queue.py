"""The waiting queue, in the order the scheduling policy admits requests."""

from __future__ import annotations

import heapq
import itertools
from collections import deque

from scheduler_svc.core.request import Request


class FCFSQueue:
    """Arrival order; a preempted request goes back to the front, ahead of newer arrivals."""

    def __init__(self) -> None:
        self._q: deque[Request] = deque()

    def add(self, request: Request) -> None:
        self._q.append(request)

    def prepend(self, request: Request) -> None:
        self._q.appendleft(request)

    def peek(self) -> Request:
        return self._q[0]

    def pop(self) -> Request:
        return self._q.popleft()

    def remove(self, request: Request) -> None:
        self._q.remove(request)

    def __len__(self) -> int:
        return len(self._q)

    def __iter__(self):
        return iter(self._q)


class PriorityQueue:
    """Lowest priority value first, then earliest arrival; a preempted request simply returns to
    its place, which its (priority, arrival) already determines."""

    def __init__(self) -> None:
        self._heap: list[tuple[int, float, int, Request]] = []
        self._tiebreak = itertools.count()  # Requests do not compare; equal keys keep FIFO order

    def add(self, request: Request) -> None:
        key = (request.priority, request.arrival_time, next(self._tiebreak), request)
        heapq.heappush(self._heap, key)

    prepend = add

    def peek(self) -> Request:
        return self._heap[0][3]

    def pop(self) -> Request:
        return heapq.heappop(self._heap)[3]

    def remove(self, request: Request) -> None:
        self._heap = [e for e in self._heap if e[3] is not request]
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self):
        return (e[3] for e in sorted(self._heap))


def make_queue(policy: str) -> FCFSQueue | PriorityQueue:
    return PriorityQueue() if policy == "priority" else FCFSQueue()
