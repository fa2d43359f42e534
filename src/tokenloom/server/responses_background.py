"""Background responses (OpenAI's ``background: true``): ``POST /v1/responses`` answers at once with the response
``queued``, the generation goes on in a task of its own that no hang-up cancels, and the client polls
``GET /v1/responses/{id}`` (``in_progress`` from the first token, then ``completed``, ``incomplete`` or ``failed``)
or ends it with ``POST /v1/responses/{id}/cancel`` (``cancelled``; the engine request is aborted).

While it runs a response lives here, not in the store: it cannot be pushed out by newer ones, and what it holds is
bounded as every request's is, by admission (the tenant's caps, the queue, the response budget), whose lease the
task holds until it ends. Once it ends it goes to the store (response_store.py) as any kept response, where the
least recently used make room as usual; a cancelled or failed one is kept there too, without output, so that
polling sees why it ended.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, replace
from typing import Any

from pydantic import BaseModel

from tokenloom.server.errors import APIError
from tokenloom.server.response_store import ResponseStore, StoredResponse
from tokenloom.server.responses_api_protocol import ConversationItem, ResponseObject

logger = logging.getLogger(__name__)

UNFINISHED = ("queued", "in_progress")


@dataclass
class _Running:
    entry: StoredResponse  # the response as polling reads it now (queued or in_progress), and its conversation
    task: asyncio.Task[None] | None = None


class BackgroundResponses:
    """The background responses still running, by id; each one's tenant alone sees it."""

    def __init__(self, store: ResponseStore | None) -> None:
        self.store = store
        self._running: dict[str, _Running] = {}

    def get(self, response_id: str, tenant: str) -> StoredResponse | None:
        running = self._running.get(response_id)
        return running.entry if running is not None and running.entry.tenant == tenant else None

    def begin(
        self, response_id: str, tenant: str, conversation: list[ConversationItem], queued: ResponseObject
    ) -> None:
        assert self.store is not None, "a background response is kept when it ends: the server must have a store"
        assert queued.status == "queued" and response_id not in self._running
        self._running[response_id] = _Running(StoredResponse(tenant, conversation, queued.model_dump(mode="json"), 0))

    def run(self, response_id: str, task: asyncio.Task[None]) -> None:
        running = self._running.get(response_id)
        if running is None:  # cancelled (or deleted) while it was admitted
            task.cancel()
        else:
            running.task = task

    def forget(self, response_id: str) -> None:
        """A response whose request was refused at admission: it never ran."""
        self._running.pop(response_id, None)

    def started(self, response_id: str) -> None:
        running = self._running.get(response_id)
        if running is not None and running.entry.body["status"] == "queued":
            running.entry = _with_status(running.entry, "in_progress")

    def ended(self, response_id: str, outcome: BaseModel | APIError) -> None:
        """The task's last act: the response, which its shape has put in the store, or the error that cut it."""
        assert isinstance(outcome, ResponseObject | APIError)
        running = self._running.pop(response_id, None)
        if running is None:  # cancelled: cancel() keeps it
            return
        if isinstance(outcome, APIError):
            detail = outcome.body()["error"]
            self._keep(
                _with_status(running.entry, "failed", error={"code": detail["code"], "message": detail["message"]})
            )
        elif not outcome.store:  # larger than the whole store: polling must still learn that it ended
            error = {"code": "response_too_large", "message": "the response is larger than --responses-store-bytes"}
            self._keep(_with_status(running.entry, "failed", error=error))

    async def cancel(self, response_id: str, tenant: str) -> dict[str, Any] | None:
        """Ends a running response: its request is aborted and it is kept as cancelled. None if it is not running."""
        running = self._running.get(response_id)
        if running is None or running.entry.tenant != tenant:
            return None
        del self._running[response_id]
        cancelled = _with_status(running.entry, "cancelled")
        self._keep(cancelled)
        if running.task is not None:
            running.task.cancel()
            await asyncio.wait([running.task])  # the abort has reached the engine, the lease is given back
        return cancelled.body

    async def stop(self) -> None:
        """At shutdown: what still runs is cancelled (the store goes with the process)."""
        tasks = [running.task for running in self._running.values() if running.task is not None]
        self._running.clear()
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks)

    def _keep(self, entry: StoredResponse) -> None:
        assert self.store is not None
        if not self.store.put(entry.body["id"], entry.tenant, entry.conversation, entry.body):
            logger.warning("background response %s is larger than the whole store: not kept", entry.body["id"])

    def __len__(self) -> int:
        return len(self._running)


def _with_status(entry: StoredResponse, status: str, **fields: Any) -> StoredResponse:
    return replace(entry, body={**entry.body, "status": status, **fields})
