"""Scheduling policies: who waits in front, who is preempted first, and who may displace whom.

Each policy is a small class behind one interface; the scheduler calls it at the few points where FCFS and
priority scheduling differ, and keeps everything else (budget, cap, chunking, KV) to itself.
"""

from __future__ import annotations

import bisect
from collections import deque

from tokenloom.core.request import Request


class FCFSPolicy:
    """First come, first served: arrival order everywhere; the most recently admitted is preempted first."""

    name = "fcfs"

    def enqueue(self, waiting: deque[Request], request: Request) -> None:
        waiting.append(request)

    def requeue(self, waiting: deque[Request], request: Request) -> None:
        """A preempted request goes back to the head: it was admitted before everyone still waiting."""
        waiting.appendleft(request)

    def order_running(self, running: list[Request]) -> None:
        """Running requests keep admission order, so the last one is the first victim."""

    def displaces(self, candidate: Request, worst_running: Request) -> bool:
        return False


class PriorityPolicy:
    """Lower `priority` first, then arrival. The victim is the lowest-priority, latest-arrived running request.

    When the batch is at max_num_seqs, a waiting request of strictly higher priority displaces the worst running
    one. Strictly: two requests of equal priority never displace each other, and a displaced request, being
    worse, cannot displace back, so there is no ping-pong.
    """

    name = "priority"

    @staticmethod
    def key(request: Request) -> tuple[int, float]:
        return (request.priority, request.arrival_time)

    def enqueue(self, waiting: deque[Request], request: Request) -> None:
        keys = [self.key(r) for r in waiting]
        waiting.insert(bisect.bisect_right(keys, self.key(request)), request)

    def requeue(self, waiting: deque[Request], request: Request) -> None:
        self.enqueue(waiting, request)

    def order_running(self, running: list[Request]) -> None:
        running.sort(key=self.key)

    def displaces(self, candidate: Request, worst_running: Request) -> bool:
        return candidate.priority < worst_running.priority


POLICIES = {"fcfs": FCFSPolicy, "priority": PriorityPolicy}


def make_policy(name: str) -> FCFSPolicy | PriorityPolicy:
    if name not in POLICIES:
        raise ValueError(f"unknown scheduling policy {name!r}; choose from {', '.join(POLICIES)}")
    return POLICIES[name]()
