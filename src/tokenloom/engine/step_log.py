"""`tokenloom serve --step-log FILE`: each turn of the server's engine loop that ran a step, as one JSON line.

A line is `{"items": [[start, tokens, rows sampled, is prefill], ...], "copied_blocks": B, "seconds": S, "at": T}`:
the step's scheduled requests (SchedulerOutput.step_items), the KV blocks it swapped, the wall time of the loop's
turn that ran it, from taking the engine to the last output handed to its stream (admissions, aborts, the step,
delivery, metrics): what a served request waits between its tokens; and T, when the turn ended (Unix time).
`tokenloom simulate profile` serves a trace with it to learn what a served step costs beyond the engine's own; it
also shows which steps a slow server ran, and when. Lines are flushed as they are written.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

from tokenloom.core.scheduler_output import SchedulerOutput


class StepLog:
    def __init__(self, path: str | Path) -> None:
        self._file = Path(path).open("w", buffering=1)  # noqa: SIM115 (open for the server's life; close() ends it)
        self._seen: dict[str, object] | None = None
        self._lock = threading.Lock()  # the engine thread writes; close may come from the server's

    def observe(self, output: SchedulerOutput) -> None:
        """The schedule of the step about to run (LLMEngine.observe_steps)."""
        self._seen = {"items": output.step_items(), "copied_blocks": len(output.swap_out) + len(output.swap_in)}

    def end_turn(self, seconds: float) -> None:
        """The loop's turn that ran the observed step took `seconds`; a turn that ran no step writes nothing."""
        seen, self._seen = self._seen, None
        if seen is None:
            return
        with self._lock:
            if not self._file.closed:
                self._file.write(json.dumps({**seen, "seconds": seconds, "at": time.time()}) + "\n")

    def close(self) -> None:
        with self._lock:
            self._file.close()


def read_step_log(path: str | Path) -> list[dict[str, Any]]:
    """A step log's records, as cost_model.shapes_of takes them."""
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line]
