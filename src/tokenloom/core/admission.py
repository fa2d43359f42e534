"""When the scheduler may admit waiting requests: every step (continuous batching) or only to form a new batch
once the last one has drained (static batching, the baseline the seeds compare against)."""

from __future__ import annotations

from tokenloom.config import Batching


class ContinuousAdmission:
    """Admits whenever there is a free seat and budget; a better-ranked waiting request may displace a running one."""

    allows_displacement = True

    def open_for_step(self, num_running: int) -> bool:
        return True

    def kv_exhausted(self) -> None:
        """Nothing to remember: the next step tries again."""

    def end_step(self, num_running: int, num_waiting: int, max_num_seqs: int) -> None:
        """Nothing to remember between steps."""


class StaticAdmission:
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


AdmissionGate = ContinuousAdmission | StaticAdmission


def make_admission(batching: Batching) -> AdmissionGate:
    return StaticAdmission() if batching == "static" else ContinuousAdmission()
