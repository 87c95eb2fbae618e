"""The Responses stream's ending on an error (``parsers/stream_faults.py``), in
process: the wrapped generator's events, then the closing ones. The served case
(the engine killed mid-stream) is ``tests/serving/test_engine_death.py``."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest

from vllm_k3_plugin.parsers.stream_faults import (
    FAILED_CODE,
    ending_background_stream,
    ending_failed,
)

RESPONSE = {"id": "resp_1", "status": "in_progress", "output": []}


def _events(number_from: int = 0):
    """A stream that opened a message and a call, sent some of each, and closed
    neither."""
    kinds = [
        {"type": "response.created", "response": RESPONSE},
        {
            "type": "response.output_item.added",
            "output_index": 0,
            "item": {"id": "msg_1", "type": "message", "content": []},
        },
        {
            "type": "response.content_part.added",
            "output_index": 0,
            "content_index": 0,
            "part": {"type": "output_text", "text": "", "annotations": []},
        },
        {
            "type": "response.output_text.delta",
            "output_index": 0,
            "content_index": 0,
            "delta": "Hel",
        },
        {
            "type": "response.output_text.delta",
            "output_index": 0,
            "content_index": 0,
            "delta": "lo",
        },
        {
            "type": "response.content_part.done",
            "output_index": 0,
            "content_index": 0,
            "part": {"type": "output_text", "text": "Hello", "annotations": []},
        },
        {
            "type": "response.content_part.added",
            "output_index": 0,
            "content_index": 1,
            "part": {"type": "output_text", "text": "", "annotations": []},
        },
        {
            "type": "response.output_text.delta",
            "output_index": 0,
            "content_index": 1,
            "delta": " there",
        },
        {
            "type": "response.output_item.added",
            "output_index": 1,
            "item": {
                "id": "fc_1",
                "type": "function_call",
                "name": "get_weather",
                "arguments": "",
            },
        },
        {
            "type": "response.function_call_arguments.delta",
            "output_index": 1,
            "delta": '{"city": "Be',
        },
    ]
    return [
        SimpleNamespace(sequence_number=number_from + i, **event)
        for i, event in enumerate(kinds)
    ]


async def _stream(events, error: BaseException):
    for event in events:
        yield event
    raise error


class _Serving:
    """What the hook reads of vLLM's Responses serving: its stored responses."""

    def __init__(self) -> None:
        self.response_store = {"resp_1": SimpleNamespace(status="in_progress")}
        self.response_store_lock = asyncio.Lock()


def _read(events, error, serving=None):
    wrapped = ending_failed(lambda self: _stream(events, error))

    async def collect():
        return [event async for event in wrapped(serving)]

    return asyncio.run(collect())


def _as_json(event) -> dict:
    return json.loads(event.model_dump_json(indent=None, by_alias=True))


def test_an_error_closes_every_open_item_then_fails_the_response():
    events = _events()
    serving = _Serving()
    read = _read(events, RuntimeError("EngineCore encountered an issue"), serving)
    assert read[: len(events)] == events
    closing = [_as_json(event) for event in read[len(events) :]]
    assert [event["type"] for event in closing] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.failed",
    ]
    # Numbered on from the last event sent.
    assert [event["sequence_number"] for event in closing] == list(
        range(len(events), len(events) + 6)
    )
    text_done, part_done, message_done, arguments_done, call_done, failed = closing
    assert text_done["text"] == " there" and part_done["part"]["text"] == " there"
    assert text_done["content_index"] == 1
    assert message_done["item"]["status"] == "incomplete"
    # The part closed before the error and the one it cut, each as sent.
    assert [part["text"] for part in message_done["item"]["content"]] == [
        "Hello",
        " there",
    ]
    assert arguments_done["arguments"] == '{"city": "Be'
    assert arguments_done["name"] == "get_weather"
    assert call_done["item"]["arguments"] == '{"city": "Be'
    assert call_done["item"]["status"] == "incomplete"
    response = failed["response"]
    assert response["id"] == "resp_1" and response["status"] == "failed"
    assert response["error"] == {
        "code": FAILED_CODE,
        "message": "EngineCore encountered an issue",
    }
    assert [item["id"] for item in response["output"]] == ["msg_1", "fc_1"]
    assert serving.response_store["resp_1"].status == "failed"


def test_a_background_responses_stream_ends_after_it_failed():
    """vLLM's stream of a stored background response ends only after
    ``response.completed``; after ``response.failed`` it would wait for ever."""
    sent = [
        SimpleNamespace(type="response.created"),
        SimpleNamespace(type="response.failed"),
    ]

    async def forever(self):
        for event in sent:
            yield event
        await asyncio.Event().wait()

    wrapped = ending_background_stream(forever)

    async def collect():
        return [event async for event in wrapped(None)]

    assert asyncio.run(asyncio.wait_for(collect(), timeout=5)) == sent


def test_an_error_before_the_response_began_is_left_to_vllm():
    with pytest.raises(RuntimeError, match="before"):
        _read([], RuntimeError("before"))


def test_a_client_that_left_is_not_answered():
    with pytest.raises(asyncio.CancelledError):
        _read(_events(), asyncio.CancelledError())
