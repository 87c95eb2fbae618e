"""``/v1/messages`` streams: each call's arguments held until the call ends and sent
whole, valid JSON (``parsers/messages_stream.py``), on vLLM 0.32's SSE strings and
0.33's response objects alike."""

from __future__ import annotations

import asyncio
import json

import pytest

from vllm_k3_plugin.parsers.messages_stream import WholeCalls, calls_whole
from vllm_k3_plugin.parsers.raw_arguments import RAW_ARGUMENTS_KEY

ENVELOPE = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1,
            "model": "k3"}  # fmt: skip


def chunk(delta, finish=None):
    choice = {"index": 0, "delta": delta, "finish_reason": finish}
    return {**ENVELOPE, "choices": [choice]}


def opened(index, name, arguments=""):
    return {"index": index, "id": f"functions.{name}:{index}", "type": "function",
            "function": {"name": name, "arguments": arguments}}  # fmt: skip


def more(index, arguments):
    return {"index": index, "function": {"arguments": arguments}}


STREAM = [
    chunk({"role": "assistant", "content": ""}),
    chunk({"tool_calls": [opened(0, "f", '{"a"')]}),
    chunk({"tool_calls": [more(0, ": 1}")]}),
    chunk({"tool_calls": [opened(1, "g")]}),
    chunk({"tool_calls": [more(1, "not json")]}),
    chunk({}, "tool_calls"),
    {**ENVELOPE, "choices": [], "usage": {"prompt_tokens": 1}},
]


def calls_sent(chunks):
    """(id, name, arguments joined) per call, as the converter would read them."""
    calls = {}
    for sent in chunks:
        for choice in sent.get("choices") or ():
            for call in choice["delta"].get("tool_calls") or ():
                entry = calls.setdefault(call["index"], [None, None, ""])
                entry[0] = call.get("id") or entry[0]
                entry[1] = (call.get("function") or {}).get("name") or entry[1]
                entry[2] += (call.get("function") or {}).get("arguments") or ""
    return {index: tuple(entry) for index, entry in calls.items()}


def test_each_calls_arguments_go_whole_when_it_ends():
    whole = WholeCalls()
    out = [
        sent for item in STREAM for sent in whole.chunk(json.loads(json.dumps(item)))
    ]
    out += whole.done()
    assert calls_sent(out) == {
        0: ("functions.f:0", "f", '{"a": 1}'),
        1: ("functions.g:1", "g", json.dumps({RAW_ARGUMENTS_KEY: "not json"})),
    }
    # The first call's arguments went before the second call opened.
    kinds = [
        ("open" if c.get("id") else "args", c["index"])
        for sent in out
        for choice in sent.get("choices") or ()
        for c in choice["delta"].get("tool_calls") or ()
    ]
    assert kinds == [("open", 0), ("args", 0), ("open", 1), ("args", 1)]
    assert out[-1]["choices"] == [] and out[-2]["choices"][0]["finish_reason"]


async def _collect(items):
    async def source():
        for item in items:
            yield item

    return [item async for item in calls_whole(source(), lambda chunk: chunk)]


def test_sse_strings_pass_untouched_unless_they_carry_or_end_calls():
    lines = [f"data: {json.dumps(item)}\n\n" for item in STREAM] + ["data: [DONE]\n\n"]
    out = asyncio.run(_collect(lines))
    assert out[0] == lines[0] and out[-1] == lines[-1]
    chunks = [json.loads(line[5:]) for line in out[:-1]]
    assert calls_sent(chunks)[1][2] == json.dumps({RAW_ARGUMENTS_KEY: "not json"})


@pytest.mark.parametrize("ends", ["done", "error", "nothing"])
def test_held_arguments_are_sent_however_the_stream_ends(ends):
    lines = [f"data: {json.dumps(item)}\n\n" for item in STREAM[:3]]
    lines += {"done": ["data: [DONE]\n\n"], "error": ['data: {"error": {}}\n\n'],
              "nothing": []}[ends]  # fmt: skip
    out = asyncio.run(_collect(lines))
    chunks = [json.loads(line[5:]) for line in out if line[5:].strip() != "[DONE]"]
    assert calls_sent(chunks)[0][2] == '{"a": 1}'


def test_response_objects_come_back_as_response_objects():
    """vLLM 0.33 hands the converter ``ChatCompletionStreamResponse`` objects."""
    from vllm.entrypoints.openai.chat_completion.protocol import (
        ChatCompletionStreamResponse,
    )

    async def run():
        async def source():
            for item in STREAM:
                yield ChatCompletionStreamResponse.model_validate(item)

        parse = ChatCompletionStreamResponse.model_validate
        return [item async for item in calls_whole(source(), parse)]

    out = asyncio.run(run())
    assert all(isinstance(item, ChatCompletionStreamResponse) for item in out)
    chunks = [item.model_dump(exclude_unset=True) for item in out]
    assert calls_sent(chunks)[0] == ("functions.f:0", "f", '{"a": 1}')


def test_text_in_the_chunk_that_opens_a_call_goes_before_it():
    """vLLM's converter sends a chunk's thinking and text before the calls it
    opens; the rewrite keeps that order."""
    whole = WholeCalls()
    out = whole.chunk(chunk({"reasoning": "hm", "tool_calls": [opened(0, "f", "{}")]}))
    out += whole.done()
    kinds = [
        "reasoning" if c["choices"][0]["delta"].get("reasoning") else
        ("open" if c["choices"][0]["delta"]["tool_calls"][0].get("id") else "args")
        for c in out
    ]  # fmt: skip
    assert kinds == ["reasoning", "open", "args"]
