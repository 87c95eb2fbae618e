"""The six ways a client reads one reply: three endpoints, streamed and not.

Each function sends one request through a real SDK and returns what the client sees
as ``Reply(reasoning, content, tool_calls)``.
"""

from __future__ import annotations

import json
from typing import Any, NamedTuple

import anthropic
import openai

MODEL = "k3-tiny"
PROMPT = "What is 2 + 2?"


class Reply(NamedTuple):
    reasoning: str
    content: str
    tool_calls: tuple[tuple[str, Any], ...] = ()
    """``(name, arguments parsed)`` per call."""
    finish: str = ""
    tool_call_ids: tuple[str, ...] = ()
    raw_arguments: tuple[str, ...] = ()
    """Each call's arguments text as the client received it (Messages: re-dumped)."""


def _extra(ids: list[int], thinking: bool) -> dict[str, Any]:
    extra: dict[str, Any] = {"vllm_xargs": {"k3_force_ids": ids}}
    if not thinking:
        extra["chat_template_kwargs"] = {"thinking": False}
    return extra


def _parsed(args: str) -> Any:
    """A call's arguments as the client would read them; text that is not JSON
    (a ``json`` block) is kept as text."""
    if not args:
        return {}
    try:
        return json.loads(args)
    except ValueError:
        return args


def _reply(reasoning, content, calls, finish) -> Reply:
    """``calls``: ``(id, name, arguments)`` in output order."""
    return Reply(
        "".join(reasoning),
        "".join(content),
        tuple((name, _parsed(args)) for _, name, args in calls),
        finish,
        tuple(call_id for call_id, _, _ in calls),
        tuple(args for _, _, args in calls),
    )


def _joined(reasoning, content, calls_by_index, finish) -> Reply:
    """A streamed reply: pieces joined, calls in output order."""
    return _reply(
        reasoning, content, [calls_by_index[i] for i in sorted(calls_by_index)], finish
    )


def _chat_request(
    ids, max_tokens, thinking, tools, stop, messages, extra=None
) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": messages or [{"role": "user", "content": PROMPT}],
        "temperature": 0,
        "max_tokens": max_tokens,
        "stop": stop,
        "extra_body": {**_extra(ids, thinking), **(extra or {})},
        **({"tools": tools} if tools else {}),
    }


def chat(
    url,
    ids,
    *,
    max_tokens,
    thinking=True,
    tools=None,
    stop=None,
    messages=None,
    extra=None,
) -> Reply:
    """``extra``: more request fields, sent in ``extra_body``."""
    client = openai.OpenAI(base_url=url + "/v1", api_key="none")
    response = client.chat.completions.create(
        **_chat_request(ids, max_tokens, thinking, tools, stop, messages, extra)
    )
    choice = response.choices[0]
    message = choice.message
    calls = [
        (c.id, c.function.name, c.function.arguments) for c in message.tool_calls or []
    ]
    return _reply(
        [getattr(message, "reasoning", None) or ""],
        [message.content or ""],
        calls,
        choice.finish_reason,
    )


def chat_stream(
    url,
    ids,
    *,
    max_tokens,
    thinking=True,
    tools=None,
    stop=None,
    messages=None,
    extra=None,
) -> Reply:
    client = openai.OpenAI(base_url=url + "/v1", api_key="none")
    stream = client.chat.completions.create(
        **_chat_request(ids, max_tokens, thinking, tools, stop, messages, extra),
        stream=True,
    )
    reasoning, content, finish = [], [], ""
    calls: dict[int, list[str]] = {}
    for chunk in stream:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        delta = choice.delta
        reasoning.append(getattr(delta, "reasoning", None) or "")
        content.append(delta.content or "")
        for call in delta.tool_calls or []:
            entry = calls.setdefault(call.index, ["", "", ""])
            entry[0] += call.id or ""
            if call.function and call.function.name:
                entry[1] += call.function.name
            if call.function and call.function.arguments:
                entry[2] += call.function.arguments
        finish = choice.finish_reason or finish
    return _joined(reasoning, content, calls, finish)


def _responses_tools(tools):
    return [
        {"type": "function", **tool["function"]} for tool in tools or ()
    ] or openai.NOT_GIVEN


def _responses_request(ids, max_tokens, thinking, tools) -> dict[str, Any]:
    return {
        "model": MODEL,
        "input": PROMPT,
        "temperature": 0,
        "max_output_tokens": max_tokens,
        "tools": _responses_tools(tools),
        "extra_body": _extra(ids, thinking),
    }


def responses(url, ids, *, max_tokens, thinking=True, tools=None) -> Reply:
    client = openai.OpenAI(base_url=url + "/v1", api_key="none")
    response = client.responses.create(
        **_responses_request(ids, max_tokens, thinking, tools)
    )
    reasoning, content, calls = [], [], []
    for item in response.output:
        if item.type == "reasoning":
            reasoning += [part.text for part in item.content or ()]
        elif item.type == "message":
            content += [
                part.text for part in item.content if part.type == "output_text"
            ]
        elif item.type == "function_call":
            calls.append((item.call_id, item.name, item.arguments))
    return _reply(reasoning, content, calls, response.status)


def responses_stream(url, ids, *, max_tokens, thinking=True, tools=None) -> Reply:
    client = openai.OpenAI(base_url=url + "/v1", api_key="none")
    stream = client.responses.create(
        **_responses_request(ids, max_tokens, thinking, tools), stream=True
    )
    reasoning, content, calls, status = [], [], {}, ""
    for event in stream:
        if event.type == "response.reasoning_text.delta":
            reasoning.append(event.delta)
        elif event.type == "response.output_text.delta":
            content.append(event.delta)
        elif event.type == "response.output_item.done" and (
            event.item.type == "function_call"
        ):
            item = event.item
            calls[event.output_index] = (item.call_id, item.name, item.arguments)
        elif event.type in ("response.completed", "response.incomplete"):
            status = event.response.status
    return _joined(reasoning, content, calls, status)


def _anthropic_tools(tools):
    return [
        {
            "name": tool["function"]["name"],
            "description": tool["function"].get("description", ""),
            "input_schema": tool["function"]["parameters"],
        }
        for tool in tools or ()
    ] or anthropic.NOT_GIVEN


def _messages_request(ids, max_tokens, thinking, tools, stop) -> dict[str, Any]:
    # SDK 2.x rejects a temperature keyword for some models; the body field is sent.
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": max_tokens,
        "tools": _anthropic_tools(tools),
        "stop_sequences": stop or anthropic.NOT_GIVEN,
        "extra_body": {**_extra(ids, thinking), "temperature": 0},
    }


def messages(url, ids, *, max_tokens, thinking=True, tools=None, stop=None) -> Reply:
    client = anthropic.Anthropic(base_url=url, api_key="none")
    response = client.messages.create(
        **_messages_request(ids, max_tokens, thinking, tools, stop)
    )
    reasoning, content, calls = [], [], []
    for block in response.content:
        if block.type == "thinking":
            reasoning.append(block.thinking)
        elif block.type == "text":
            content.append(block.text)
        elif block.type == "tool_use":
            calls.append((block.id, block.name, json.dumps(block.input)))
    return _reply(reasoning, content, calls, response.stop_reason)


def messages_stream(
    url, ids, *, max_tokens, thinking=True, tools=None, stop=None
) -> Reply:
    client = anthropic.Anthropic(base_url=url, api_key="none")
    reasoning, content, calls, stop_reason = [], [], {}, ""
    with client.messages.stream(
        **_messages_request(ids, max_tokens, thinking, tools, stop)
    ) as stream:
        for event in stream:
            if event.type == "content_block_start" and (
                event.content_block.type == "tool_use"
            ):
                block = event.content_block
                calls[event.index] = [block.id, block.name, ""]
            elif event.type == "content_block_delta":
                delta = event.delta
                if delta.type == "thinking_delta":
                    reasoning.append(delta.thinking)
                elif delta.type == "text_delta":
                    content.append(delta.text)
                elif delta.type == "input_json_delta":
                    calls[event.index][2] += delta.partial_json
            elif event.type == "message_delta":
                stop_reason = event.delta.stop_reason or stop_reason
    return _joined(reasoning, content, calls, stop_reason)


ENDPOINTS = {
    "chat": chat,
    "chat-stream": chat_stream,
    "responses": responses,
    "responses-stream": responses_stream,
    "messages": messages,
    "messages-stream": messages_stream,
}
