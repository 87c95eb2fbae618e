"""A Responses stream that an error ends sends ``response.failed``.

vLLM's ``/v1/responses`` stream turns only a ``GenerationError`` into an event; any
other error out of the engine (the engine core died, a worker failed) escapes the
event generator, and the server drops the connection mid-chunk: a client reads a
transport error ("incomplete chunked read"), with no ``response.failed`` and no
``error`` event, and cannot tell a dead engine from a network fault. (Chat
completions sends its error frame and ``/v1/messages`` Anthropic's ``error``
event; both close the stream cleanly.)

Here the generator is wrapped: events pass through as they are, and the items they
open are followed (``OpenItems``). When an error escapes, the stream ends the way
the Responses API ends a failed response: every open item is closed (its text or
arguments so far in the ``.done`` events, the item ``incomplete``), then
``response.failed`` carries the response with ``status: failed`` and the error
(``server_error``), numbered on from the last event. Nothing already sent is sent
again. A client that disconnected (cancellation) is left alone. A stored response
(``store``, background requests) is marked ``failed``, and the stream of a
background response, which vLLM ends only after ``response.completed``, ends after
``response.failed``.

Only where vLLM composes a ``kimi_k3`` parser (``--reasoning-parser kimi_k3``): the
hooks are installed then.

Installed in the API server with the parser hooks (``serving_hooks.install``).
"""

from __future__ import annotations

import copy
import functools
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger("vllm.k3_plugin")

FAILED_CODE = "server_error"
# Text deltas and their ``.done`` events, by the content part type they fill.
_TEXT_EVENTS = {
    "response.output_text.delta": ("output_text", "response.output_text.done"),
    "response.reasoning_text.delta": (
        "reasoning_text",
        "response.reasoning_text.done",
    ),
}
_ARGUMENTS_DELTA = "response.function_call_arguments.delta"
_ARGUMENTS_DONE = "response.function_call_arguments.done"


_CLOSING_EVENT: Any = None


def _event(**fields: Any) -> Any:
    """An event as vLLM's SSE writer reads one: ``type`` and
    ``model_dump_json(indent=..., by_alias=...)``."""
    global _CLOSING_EVENT
    if _CLOSING_EVENT is None:
        from pydantic import BaseModel, ConfigDict

        class ClosingEvent(BaseModel):
            model_config = ConfigDict(extra="allow")
            type: str

        _CLOSING_EVENT = ClosingEvent
    return _CLOSING_EVENT(**fields)


@dataclass
class _Part:
    kind: str
    part: dict[str, Any]
    text: list[str] = field(default_factory=list)


@dataclass
class _Item:
    item: dict[str, Any]
    parts: dict[int, _Part] = field(default_factory=dict)
    finished: dict[int, dict[str, Any]] = field(default_factory=dict)
    """Content parts already closed, as their ``.done`` events gave them."""
    arguments: list[str] = field(default_factory=list)


class OpenItems:
    """What a Responses stream has opened and not closed, read off its events."""

    def __init__(self) -> None:
        self.response: dict[str, Any] | None = None
        self.sequence_number = -1
        self.items: dict[int, _Item] = {}
        self.closed: dict[int, dict[str, Any]] = {}

    def saw(self, event: Any) -> None:
        kind = getattr(event, "type", None)
        number = getattr(event, "sequence_number", None)
        if isinstance(number, int):
            self.sequence_number = max(self.sequence_number, number)
        if kind in ("response.created", "response.in_progress"):
            self.response = _dump(event.response)
        elif kind == "response.output_item.added":
            self.items[event.output_index] = _Item(_dump(event.item))
        elif kind == "response.output_item.done":
            self.items.pop(event.output_index, None)
            self.closed[event.output_index] = _dump(event.item)
        elif kind == "response.content_part.added":
            item = self.items.get(event.output_index)
            if item is not None:
                part = _dump(event.part)
                item.parts[event.content_index] = _Part(part.get("type", ""), part)
        elif kind == "response.content_part.done":
            item = self.items.get(event.output_index)
            if item is not None:
                item.parts.pop(event.content_index, None)
                item.finished[event.content_index] = _dump(event.part)
        elif kind in _TEXT_EVENTS:
            item = self.items.get(event.output_index)
            part = item.parts.get(event.content_index) if item else None
            if part is not None:
                part.text.append(event.delta)
        elif kind == _ARGUMENTS_DELTA:
            item = self.items.get(event.output_index)
            if item is not None:
                item.arguments.append(event.delta)

    def closing(self, error: BaseException) -> list[Any]:
        """The events that end the stream: each open item closed, then
        ``response.failed``."""
        events = []
        for index in sorted(self.items):
            events += self._close_item(index, self.items[index])
        self.items.clear()
        response = copy.deepcopy(self.response) or {}
        response["status"] = "failed"
        response["error"] = {"code": FAILED_CODE, "message": _message(error)}
        response["output"] = [self.closed[index] for index in sorted(self.closed)]
        events.append(self._numbered(type="response.failed", response=response))
        return events

    def _close_item(self, index: int, open_item: _Item) -> list[Any]:
        item = copy.deepcopy(open_item.item)
        item_id = item.get("id")
        events = []
        content = list(item.get("content") or [])
        for content_index, part in sorted(open_item.finished.items()):
            content[content_index : content_index + 1] = [part]
        for content_index in sorted(open_item.parts):
            part = open_item.parts[content_index]
            text = "".join(part.text)
            done = dict(part.part, text=text)
            for delta_kind, done_type in _TEXT_EVENTS.values():
                if delta_kind == part.kind:
                    events.append(
                        self._numbered(
                            type=done_type,
                            item_id=item_id,
                            output_index=index,
                            content_index=content_index,
                            text=text,
                            **({"logprobs": []} if part.kind == "output_text" else {}),
                        )
                    )
            events.append(
                self._numbered(
                    type="response.content_part.done",
                    item_id=item_id,
                    output_index=index,
                    content_index=content_index,
                    part=done,
                )
            )
            content[content_index : content_index + 1] = [done]
        if content:
            item["content"] = content
        if item.get("type") == "function_call":
            arguments = "".join(open_item.arguments)
            item["arguments"] = arguments
            events.append(
                self._numbered(
                    type=_ARGUMENTS_DONE,
                    item_id=item_id,
                    output_index=index,
                    name=item.get("name"),
                    arguments=arguments,
                )
            )
        item["status"] = "incomplete"
        events.append(
            self._numbered(
                type="response.output_item.done", output_index=index, item=item
            )
        )
        self.closed[index] = item
        return events

    def _numbered(self, **fields: Any) -> Any:
        self.sequence_number += 1
        return _event(sequence_number=self.sequence_number, **fields)


def _dump(value: Any) -> dict[str, Any]:
    if hasattr(value, "model_dump"):
        return value.model_dump(mode="json", by_alias=True)
    return dict(value)


def _message(error: BaseException) -> str:
    return str(error) or type(error).__name__


def ending_failed(original: Callable[..., Any]) -> Callable[..., Any]:
    """``responses_stream_generator`` ending with ``response.failed`` on an error."""

    @functools.wraps(original)
    async def responses_stream_generator(self, *args: Any, **kwargs: Any):
        events: AsyncIterator[Any] = original(self, *args, **kwargs)
        opened: OpenItems | None = OpenItems()
        try:
            async for event in events:
                if opened is not None:
                    try:
                        opened.saw(event)
                    except Exception:  # an event this reading does not know
                        logger.exception("Responses stream: events left unfollowed")
                        opened = None
                yield event
        except Exception as error:
            if opened is None or opened.response is None:
                raise
            logger.error("Responses stream ended by an error: %r", error)
            for event in opened.closing(error):
                yield event
            await _mark_failed(self, opened.response.get("id"))
        finally:
            await events.aclose()

    return responses_stream_generator


async def _mark_failed(serving: Any, response_id: str | None) -> None:
    """A stored response (``store: true``, background requests) says it failed,
    as vLLM marks a failed background request."""
    store = getattr(serving, "response_store", None)
    lock = getattr(serving, "response_store_lock", None)
    if not store or lock is None or response_id is None:
        return
    async with lock:
        stored = store.get(response_id)
        if stored is not None and stored.status not in ("completed", "cancelled"):
            stored.status = "failed"


ENDING_TYPES = frozenset({"response.failed", "error"})


def ending_background_stream(original: Callable[..., Any]) -> Callable[..., Any]:
    """``responses_background_stream_generator`` (a stored background response,
    streamed) ending after ``response.failed``: vLLM's ends only after
    ``response.completed`` (0.33 and 0.34: or ``incomplete``) and would wait for
    more events forever."""

    @functools.wraps(original)
    async def responses_background_stream_generator(self, *args: Any, **kwargs):
        events: AsyncIterator[Any] = original(self, *args, **kwargs)
        try:
            async for event in events:
                yield event
                if getattr(event, "type", None) in ENDING_TYPES:
                    return
        finally:
            await events.aclose()

    return responses_background_stream_generator
