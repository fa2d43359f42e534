"""Scheduling policies: who waits in front, who is preempted first, and who may displace whom.

Each policy is a small class behind one interface; the scheduler calls it at the few points where FCFS and
priority scheduling differ, and keeps everything else (budget, cap, chunking, KV) to itself.
"""

from __future__ import annotations

import bisect
from collections import deque

from tokenloom.core.request import Request


class SchedulingPolicy:
    """The interface every policy implements, with FCFS's behaviour as the default of each hook: arrival order
    everywhere, the most recently started preempted first, nobody displaced, nothing to charge."""

    name = "base"

    def enqueue(self, waiting: deque[Request], request: Request) -> None:
        """Behind every request that arrived before it: one that reached the engine late (the server validates a
        burst's requests in worker threads, which finish in any order) still goes before later arrivals."""
        at = len(waiting)
        while at > 0 and waiting[at - 1].arrival_time > request.arrival_time:
            at -= 1
        waiting.insert(at, request)

    def requeue(self, waiting: deque[Request], request: Request) -> None:
        """A preempted request goes back to the head: it started before everyone still waiting."""
        waiting.appendleft(request)

    def order_running(self, running: list[Request]) -> None:
        """Running requests keep the order they started in, so the last one is the first victim."""

    def displaces(self, candidate: Request, worst_running: Request) -> bool:
        return False

    def finished(self, request: Request) -> None:
        """Told that a request left the engine (finished or aborted)."""

    def order_waiting(self, waiting: deque[Request]) -> None:
        """Reorders the queue before a step, for policies whose order changes as requests are served."""

    def charge(self, request: Request, num_tokens: int) -> None:
        """Told how many tokens a request was given in a step."""


class FCFSPolicy(SchedulingPolicy):
    """First come, first served: the interface's defaults."""

    name = "fcfs"


class PriorityPolicy(SchedulingPolicy):
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


class FairPolicy(SchedulingPolicy):
    """Weighted fair share between tenants: whoever has received the fewest tokens per unit of weight goes first.

    Each tenant has a virtual token counter, charged for every prompt and generated token its requests are
    given, divided by its weight. Waiting and running requests are ordered by their tenant's counter, so the
    step's budget goes to the least-served tenant first and KV preemption takes from the most-served. A tenant
    that was idle starts again from the lowest counter among the active ones: it cannot bank credit while away.
    """

    name = "fair"

    def __init__(self, weights: dict[str, float] | None = None) -> None:
        self.weights = dict(weights or {})
        self.virtual_tokens: dict[str, float] = {}
        self._active: dict[str, int] = {}

    def key(self, request: Request) -> tuple[float, float]:
        return (self.virtual_tokens.get(request.tenant, 0.0), request.arrival_time)

    def enqueue(self, waiting: deque[Request], request: Request) -> None:
        if self._active.get(request.tenant, 0) == 0:
            floor = min((self.virtual_tokens[t] for t, n in self._active.items() if n > 0), default=0.0)
            self.virtual_tokens[request.tenant] = max(self.virtual_tokens.get(request.tenant, 0.0), floor)
        self._active[request.tenant] = self._active.get(request.tenant, 0) + 1
        waiting.append(request)

    def requeue(self, waiting: deque[Request], request: Request) -> None:
        waiting.appendleft(request)

    def finished(self, request: Request) -> None:
        self._active[request.tenant] -= 1
        assert self._active[request.tenant] >= 0

    def order_waiting(self, waiting: deque[Request]) -> None:
        ordered = sorted(waiting, key=self.key)
        waiting.clear()
        waiting.extend(ordered)

    def order_running(self, running: list[Request]) -> None:
        running.sort(key=self.key)

    def charge(self, request: Request, num_tokens: int) -> None:
        weight = self.weights.get(request.tenant, 1.0)
        self.virtual_tokens[request.tenant] = self.virtual_tokens.get(request.tenant, 0.0) + num_tokens / weight


POLICIES = {"fcfs": FCFSPolicy, "priority": PriorityPolicy, "fair": FairPolicy}


def make_policy(name: str) -> SchedulingPolicy:
    if name not in POLICIES:
        raise ValueError(f"unknown scheduling policy {name!r}; choose from {', '.join(POLICIES)}")
    return POLICIES[name]()
