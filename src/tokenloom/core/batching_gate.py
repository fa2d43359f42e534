"""The batching gate: when the scheduler may let waiting requests join the running ones. Every step (continuous
batching), or only to form a new batch once the last one has drained (static batching, the seeds' baseline)."""

from __future__ import annotations

from tokenloom.config import Batching


class ContinuousGate:
    """Open whenever there is a free seat and budget; a better-ranked waiting request may displace a running one."""

    allows_displacement = True

    def open_for_step(self, num_running: int) -> bool:
        return True

    def kv_exhausted(self) -> None:
        """Nothing to remember: the next step tries again."""

    def end_step(self, num_running: int, num_waiting: int, max_num_seqs: int) -> None:
        """Nothing to remember between steps."""


class StaticGate:
    """A batch forms only when the previous one has drained, and closes once full (seats or KV) or the queue
    is empty; the requests in it then run to completion with no one joining."""

    allows_displacement = False

    def __init__(self) -> None:
        self._forming = False

    def open_for_step(self, num_running: int) -> bool:
        if num_running == 0:
            self._forming = True  # the last batch drained: a new one forms
        return self._forming

    def kv_exhausted(self) -> None:
        self._forming = False  # the batch is as large as the KV cache allows

    def end_step(self, num_running: int, num_waiting: int, max_num_seqs: int) -> None:
        if num_running >= max_num_seqs or num_waiting == 0:
            self._forming = False


BatchingGate = ContinuousGate | StaticGate


def make_gate(batching: Batching) -> BatchingGate:
    return StaticGate() if batching == "static" else ContinuousGate()
