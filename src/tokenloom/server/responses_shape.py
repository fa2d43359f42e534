"""How ``/v1/responses`` words a request's output (ResponsesShape): the response object with its output items, or
OpenAI's typed stream events: ``response.created``, ``response.in_progress``, then for each output item
``response.output_item.added``, its text or arguments in deltas, its ``.done`` events, and last
``response.completed`` (``response.incomplete`` when ``max_output_tokens`` cut it), each with a ``sequence_number``."""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import Any

from tokenloom.outputs import RequestOutput
from tokenloom.server.chat import PreparedChat
from tokenloom.server.errors import APIError
from tokenloom.server.logprobs import (
    TokenLogprobs,
    chat_logprobs_body,
    chat_logprobs_of,
    generated_logprobs,
    logprob_namer,
)
from tokenloom.server.protocol import StreamOptions
from tokenloom.server.reasoning import ReasoningStream
from tokenloom.server.response_models import Usage
from tokenloom.server.responses_api_protocol import (
    IncompleteDetails,
    InputTokensDetails,
    ItemStatus,
    OutputFunctionCall,
    OutputItem,
    OutputMessage,
    OutputReasoning,
    OutputText,
    ReasoningText,
    ResponseObject,
    ResponsesRequest,
    ResponseStatus,
    ResponseUsage,
    response_id_prefix,
    response_settings,
)
from tokenloom.server.streaming import UsageCount, text_deltas, usage_of
from tokenloom.server.tool_parsers import reply_calls


class ResponsesShape:
    """How /v1/responses words a request's output: a message item for the reply's text, a function_call item for
    each call (a forced tool's, or one the parser reads out of a free reply), in the response object."""

    end_frame: str | None = None  # the last event is response.completed (or .incomplete); no [DONE]

    def __init__(
        self,
        request: ResponsesRequest,
        prepared: PreparedChat,
        keep: Callable[[ResponseObject], bool] | None = None,
        replica_id: str | None = None,
    ) -> None:
        # Under --ray the id names the replica that keeps the response: its continuations are routed there.
        self.id_prefix = response_id_prefix(replica_id)
        self.settings = {**response_settings(request), "store": keep is not None}
        self._keep = keep  # what keeps the finished response, if it is kept
        self.tool, self.parser = prepared.forced, prepared.parser
        self.reasoning = prepared.reasoning  # the reply's thought: a reasoning item ahead of the others
        self.namer = logprob_namer(prepared.tokenizer, token_ids_as_text=False)  # names the logprobs' tokens
        self._sequence = 0  # the stream's events are numbered from 0
        self._item_ids = uuid.uuid4().hex
        self._thought, self._thought_closed = "", False  # a stream's thought so far, and whether its item is done

    def response(
        self, request_id: str, created: int, model: str, finals: list[RequestOutput], logprobs: bool, usage: Usage
    ) -> ResponseObject:
        (final,) = finals
        completion = final.outputs[0]
        cut = completion.finish_reason == "length"
        token_logprobs = chat_logprobs_body(final, self.namer)["content"] if logprobs else []
        thought, answer = self.reasoning.split(completion.text) if self.reasoning else (None, completion.text)
        items = self._items(answer, cut, token_logprobs, thought=thought)
        return self._kept(self._object(request_id, created, model, items, cut, _usage(usage, final)))

    def queued(self, request_id: str, created: int, model: str) -> ResponseObject:
        """A background response as it is first answered."""
        return self._object(request_id, created, model, [], False, None, status="queued")

    def _kept(self, response: ResponseObject) -> ResponseObject:
        """The finished response, kept if it is to be; one larger than the whole store says it was not."""
        if self._keep is not None and not self._keep(response):
            response.store = False
        return response

    def _items(
        self, text: str, cut: bool, logprobs: list[dict[str, Any]], message_opened: bool = False,
        thought: str | None = None,
    ) -> list[OutputItem]:  # fmt: skip
        """The output items of a whole reply: its thought (with --reasoning-parser), then its answer's text (if any,
        if there is nothing else, or if a stream has opened its message) with its tokens' logprobs (asked for only
        without tools), then its calls."""
        content, calls = reply_calls(text, self.tool, self.parser)
        status: ItemStatus = "incomplete" if cut else "completed"
        items: list[OutputItem] = [self._reasoning_item(thought, cut and not text)] if thought else []
        if content or message_opened or not (calls or thought):
            part = OutputText(text=content or "", logprobs=logprobs)
            items.append(OutputMessage(id=self._message_id, status=status, content=[part]))
        for call in calls or []:
            index = len(items) - (1 if thought else 0)  # the call's place among calls and message, as when live
            items.append(self._call_item(call.function.name, call.function.arguments, index, status))
        return items

    def _reasoning_item(self, thought: str, cut: bool, status: ItemStatus | None = None) -> OutputReasoning:
        """The thought as an item: incomplete if the reply was cut while thinking."""
        status = status or ("incomplete" if cut else "completed")
        return OutputReasoning(id=f"rs_{self._item_ids}", status=status, content=[ReasoningText(text=thought)])

    @property
    def _message_id(self) -> str:
        return f"msg_{self._item_ids}"

    def _call_item(self, name: str, arguments: str, index: int, status: ItemStatus) -> OutputFunctionCall:
        """A call as an output item; its ids follow from its place, so the streamed item and the final one agree."""
        return OutputFunctionCall(id=f"fc_{self._item_ids}_{index}", call_id=f"call_{self._item_ids[:16]}_{index}",
                                  name=name, arguments=arguments, status=status)  # fmt: skip

    def _object(
        self, request_id: str, created: int, model: str, items: list[OutputItem], cut: bool,
        usage: ResponseUsage | None, status: ResponseStatus | None = None,
    ) -> ResponseObject:  # fmt: skip
        status = status or ("incomplete" if cut else "completed")
        details = IncompleteDetails(reason="max_output_tokens") if status == "incomplete" else None
        return ResponseObject(id=request_id, created_at=created, status=status, model=model, output=items,
                              usage=usage, incomplete_details=details, **self.settings)  # fmt: skip

    # The stream.

    async def sse_frames(
        self, streams: list[AsyncIterator[RequestOutput]], logprobs: bool, request_id: str, created: int, model: str,
        counting: UsageCount, options: StreamOptions,
    ) -> AsyncGenerator[str]:  # fmt: skip
        """The reply's text (or a named tool's arguments) streams as it comes; a parser's calls, a required call's
        array and the items' final forms go out once the reply is whole."""
        (stream,) = streams
        text, shown, live = "", 0, None  # live: the item streamed as it is written, once opened
        thinking = ReasoningStream(self.reasoning) if self.reasoning is not None else None
        generated = 0
        sent: list[dict[str, Any]] = []  # the logprobs of the tokens whose text went out
        unsent: list[TokenLogprobs] = []  # of those that came since the last delta
        async for delta, finish_reason, output in text_deltas(stream):
            completion = output.outputs[0]
            generated += len(completion.token_ids)
            if logprobs:
                unsent += generated_logprobs(completion.token_ids, completion.logprobs or [], self.namer)
            if self._sequence == 0:
                started = self._object(request_id, created, model, [], False, None, status="in_progress")
                yield self._event("response.created", response=started)
                yield self._event("response.in_progress", response=started)
            if thinking is not None:  # the thought streams first, as its own item; the rest reads the answer alone
                frames, delta = self._thought_frames(thinking, delta, finish_reason)
                for frame in frames:
                    yield frame
            base = 1 if self._thought else 0  # the live item's place: after the thought's
            text += delta
            end = self._streamable_end(text)
            if end > shown:
                if live is None:
                    live = self._live_item()
                    for frame in self._opened(live, base):
                        yield frame
                new_logprobs = chat_logprobs_of(unsent)["content"]
                unsent.clear()
                sent += new_logprobs
                yield self._delta(live, text[shown:end], new_logprobs, base)
                shown = end
            if finish_reason is not None:
                cut = finish_reason == "length"
                every = sent + chat_logprobs_of(unsent)["content"]
                items = self._items(text, cut, every, isinstance(live, OutputMessage), self._thought or None)
                for index, item in enumerate(items):
                    if not isinstance(item, OutputReasoning):  # the thought's item is done already
                        for frame in self._closed(item, index, opened=live is not None and index == base):
                            yield frame
                usage = _usage(usage_of(counting.prompt_tokens, generated), output)
                final = self._kept(self._object(request_id, created, model, items, cut, usage))
                yield self._event(f"response.{final.status}", response=final)

    def _thought_frames(
        self, thinking: ReasoningStream, delta: str, finish_reason: str | None
    ) -> tuple[list[str], str]:
        """The thought's events for this delta (its item opened with its first text, closed once the answer begins
        or the reply ends), and the answer's part of the delta."""
        thought, answer = thinking.feed(delta, last=finish_reason is not None)
        frames: list[str] = []
        item_id = f"rs_{self._item_ids}"
        if thought:
            if not self._thought:
                opened = self._reasoning_item("", False, "in_progress").model_copy(update={"content": []})
                frames += self._opened(opened)
            self._thought += thought
            frames.append(self._event("response.reasoning_text.delta", item_id=item_id, output_index=0,
                                      content_index=0, delta=thought))  # fmt: skip
        if self._thought and not self._thought_closed and (answer or finish_reason is not None):
            self._thought_closed = True
            done = self._reasoning_item(self._thought, finish_reason == "length" and not answer)
            frames.append(self._event("response.reasoning_text.done", item_id=item_id, output_index=0,
                                      content_index=0, text=self._thought))  # fmt: skip
            frames.append(self._event("response.output_item.done", output_index=0, item=done))
        return frames, answer

    def _streamable_end(self, text: str) -> int:
        """How much of the reply so far can go out live: all of a plain reply or a named tool's arguments; of a
        free reply with tools, what cannot begin a call; nothing of a required call's array."""
        if self.tool is not None:
            return len(text) if self.tool.mode == "named" else 0
        return self.parser.streamable_end(text) if self.parser is not None else len(text)

    def _live_item(self) -> OutputItem:
        if self.tool is not None:  # a named tool's call, its arguments streamed
            assert self.tool.name is not None, "only a named tool's call streams live"
            return self._call_item(self.tool.name, "", 0, "in_progress")
        return OutputMessage(id=self._message_id, status="in_progress", content=[])

    def _opened(self, item: OutputItem, index: int = 0) -> list[str]:
        frames = [self._event("response.output_item.added", output_index=index, item=item)]
        if isinstance(item, OutputMessage):
            part = OutputText(text="")
            frames.append(self._event("response.content_part.added", item_id=item.id, output_index=index,
                                      content_index=0, part=part))  # fmt: skip
        return frames

    def _delta(self, item: OutputItem, delta: str, logprobs: list[dict[str, Any]], index: int = 0) -> str:
        if isinstance(item, OutputMessage):
            return self._event("response.output_text.delta", item_id=item.id, output_index=index, content_index=0,
                               delta=delta, logprobs=logprobs)  # fmt: skip
        return self._event("response.function_call_arguments.delta", item_id=item.id, output_index=index, delta=delta)

    def _closed(self, item: OutputItem, index: int, opened: bool) -> list[str]:
        """An item's closing events; one not streamed live is opened first, its whole text (or arguments) one
        delta."""
        frames: list[str] = []
        empty: dict[str, Any]  # the item as it was opened: nothing written yet
        assert not isinstance(item, OutputReasoning), "a thought's item closes as it streams (_thought_frames)"
        if isinstance(item, OutputMessage):
            whole, logprobs, empty = item.content[0].text, item.content[0].logprobs, {"content": []}
        else:
            whole, logprobs, empty = item.arguments, [], {"arguments": ""}
        if not opened:
            frames += self._opened(item.model_copy(update={"status": "in_progress", **empty}), index)
            if whole:
                frames.append(self._delta(item, whole, logprobs, index))
        if isinstance(item, OutputMessage):
            place = {"item_id": item.id, "output_index": index, "content_index": 0}
            frames.append(self._event("response.output_text.done", **place, text=whole, logprobs=logprobs))
            frames.append(self._event("response.content_part.done", **place, part=item.content[0]))
        else:
            frames.append(self._event("response.function_call_arguments.done", item_id=item.id, output_index=index,
                                      name=item.name, arguments=item.arguments))  # fmt: skip
        frames.append(self._event("response.output_item.done", output_index=index, item=item))
        return frames

    def _event(self, kind: str, **fields: Any) -> str:
        sequence, self._sequence = self._sequence, self._sequence + 1
        body = {"type": kind, "sequence_number": sequence}
        body.update({k: v.model_dump(mode="json") if hasattr(v, "model_dump") else v for k, v in fields.items()})
        return f"event: {kind}\ndata: {json.dumps(body, ensure_ascii=False, separators=(',', ':'))}\n\n"

    def error_frame(self, error: APIError) -> str:
        detail = error.body()["error"]
        return self._event("error", code=detail.get("code"), message=detail.get("message"), param=detail.get("param"))


def _usage(usage: Usage, final: RequestOutput) -> ResponseUsage:
    details = InputTokensDetails(cached_tokens=final.metrics.num_cached_tokens)
    return ResponseUsage(input_tokens=usage.prompt_tokens, input_tokens_details=details,
                         output_tokens=usage.completion_tokens, total_tokens=usage.total_tokens)  # fmt: skip
