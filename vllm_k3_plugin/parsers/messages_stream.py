"""``/v1/messages`` streams each tool call's input whole, as its non-streamed reply
has it: valid JSON for every output.

vLLM turns a chat completions stream into Anthropic events, each piece of a call's
arguments one ``input_json_delta``. A K3 ``json`` block is the arguments text as the
model wrote it, and a call the output cut off ends mid-value: neither need be JSON,
and the ``anthropic`` SDK's stream helper parses the input after every delta and
fails the request on text that cannot begin a JSON value. So on this endpoint a
call's arguments are held until the call ends (the next call, other text, the
finish, or the stream's end) and sent in one piece: the arguments if they are a
JSON object, else ``{"_raw_arguments": "<the text>"}`` (``raw_arguments.py``'s
``json_object_text``, the same reading the non-streamed reply gets).

``WholeCalls`` works on chunks as dicts; ``calls_whole`` adapts vLLM 0.32's SSE
strings and 0.33's response objects to it.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from typing import Any

from vllm_k3_plugin.parsers.raw_arguments import json_object_text

_ENVELOPE = ("id", "object", "created", "model")


class WholeCalls:
    """One stream: ``chunk`` returns the chunks to send for one chunk, ``done`` what
    is still held at the stream's end."""

    def __init__(self) -> None:
        self._held: dict[int, list[str]] = {}
        self._envelope: dict[str, Any] = {}

    @property
    def holding(self) -> bool:
        return bool(self._held)

    def chunk(self, chunk: dict[str, Any]) -> list[dict[str, Any]]:
        self._envelope = {k: chunk[k] for k in _ENVELOPE if k in chunk}
        choices = chunk.get("choices")
        if not isinstance(choices, list) or not choices:
            return [*self.done(), chunk]
        choice = choices[0]
        delta = choice.get("delta") or {}
        out: list[dict[str, Any]] = []
        rest = {k: v for k, v in delta.items() if k != "tool_calls"}
        calls = delta.get("tool_calls") or ()
        if any(rest.values()) and any(c.get("id") is not None for c in calls):
            # vLLM's converter sends a chunk's thinking and text before the calls
            # it opens: kept so (the previous call ended before them).
            out += self.done()
            out.append({**chunk, "choices": [{**choice, "delta": rest}]})
            rest = {}
        for call in calls:
            function = call.get("function") or {}
            arguments = function.get("arguments") or ""
            if call.get("id") is not None:
                # A new call: the one held before it has ended.
                out += self.done()
                header = {**call, "function": {**function, "arguments": ""}}
                out.append(self._calls_chunk(choice, [header]))
            self._held.setdefault(call.get("index", 0), []).append(arguments)
        finished = choice.get("finish_reason") is not None
        if any(rest.values()) or finished:
            out += self.done()
            out.append({**chunk, "choices": [{**choice, "delta": rest}]})
        return out

    def done(self) -> list[dict[str, Any]]:
        """A chunk per held call, its arguments whole."""
        calls = [
            {
                "index": index,
                "function": {"arguments": json_object_text("".join(text), stream=True)},
            }
            for index, text in self._held.items()
        ]
        self._held.clear()
        return [self._calls_chunk({"index": 0}, [call]) for call in calls]

    def _calls_chunk(self, choice: dict[str, Any], calls: list[Any]) -> dict[str, Any]:
        piece = {"index": choice.get("index", 0), "delta": {"tool_calls": calls},
                 "finish_reason": None}  # fmt: skip
        return {**self._envelope, "choices": [piece]}


async def calls_whole(
    generator: AsyncIterator[Any], parse: Callable[[dict[str, Any]], Any]
) -> AsyncIterator[Any]:
    """The chat completions stream vLLM's converter reads, calls whole: ``data:``
    strings (vLLM 0.32) or response objects (0.33, built back with ``parse``)."""
    calls = WholeCalls()
    as_text = True
    async for item in generator:
        as_text = isinstance(item, str)
        chunks = _text_chunk(calls, item) if as_text else _object_chunk(calls, item)
        if chunks is None:
            yield item
            continue
        for chunk in chunks:
            yield chunk if not isinstance(chunk, dict) else _form(chunk, as_text, parse)
    for chunk in calls.done():
        yield _form(chunk, as_text, parse)


def _text_chunk(calls: WholeCalls, item: str) -> list[Any] | None:
    body = item[5:].strip() if item.startswith("data:") else None
    if body is None or (not calls.holding and '"tool_calls"' not in body):
        return None
    if body == "[DONE]":
        return [*calls.done(), item]
    return calls.chunk(json.loads(body))


def _object_chunk(calls: WholeCalls, item: Any) -> list[Any] | None:
    choices = getattr(item, "choices", None)
    if choices is None:  # an error: it ends what is held
        return [*calls.done(), item] if calls.holding else None
    has_calls = any(getattr(choice.delta, "tool_calls", None) for choice in choices)
    if not calls.holding and not has_calls:
        return None
    return calls.chunk(item.model_dump(exclude_unset=True))


def _form(chunk: dict[str, Any], as_text: bool, parse: Callable) -> Any:
    # ASCII: an escaped lone surrogate in the arguments stays escaped.
    return f"data: {json.dumps(chunk)}\n\n" if as_text else parse(chunk)
