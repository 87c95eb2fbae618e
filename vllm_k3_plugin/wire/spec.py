"""Moonshot's streaming wire spec for chat completions, as a rewrite of vLLM's
exchange (sans-I/O, standard library only): the request JSON before vLLM reads it,
each streamed chunk (a parsed ``data:`` payload) and the non-streamed body after.

What the rewrite gives (``docs/moonshot_stream_spec.md`` lists the spec's items):

- ``reasoning_content`` beside vLLM's ``reasoning``, the same text (P0.12), in every
  delta and in the non-streamed message;
- a frame whose delta is ``{"reasoning_content": ""}`` where thinking ends: before
  the first content, tool call or end frame after some reasoning (P1.7);
- one kind per frame: a delta carrying reasoning, content and tool calls together
  is split into one frame each, in that order; ``"content": null`` is dropped
  (P0.10 and the mutual-exclusion check);
- the end frame's delta is ``{}``: text riding in it goes out in a frame before it
  (P1.10, P1.12);
- the end frame carries ``choices[0].usage`` (P0.4): the request asks vLLM for the
  usage summary, the end frame is held until the summary arrives and takes its
  usage, and the summary reaches the client only if it asked for it (P2.3).

A frame inserted or split off copies the chunk's ``id``, ``object``, ``created`` and
``model`` and sets ``finish_reason`` to ``null``. Frames without choices other than
the summary, and errors, pass through unchanged.
"""

from __future__ import annotations

import copy
import re
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

CHAT_COMPLETIONS_PATH = "/v1/chat/completions"
# The order a split delta's parts go out in.
_KINDS = ("reasoning", "content", "tool_calls")
_ENVELOPE = ("id", "object", "created", "model")
_PER_TOKEN = ("logprobs", "token_ids")
BOUNDARY = {"reasoning_content": ""}
"""The delta that marks where thinking ends."""
# vLLM's and the plugin's tool-call id for K3 models: ``functions.NAME:N``.
_K3_CALL_ID = re.compile(r"^functions\.(.+):(\d+)$")
# A chunk as vLLM serialises most of them: compact JSON, scalar envelope fields, one
# choice whose delta is one non-empty reasoning or content string, and otherwise only
# nulls (none under a key the reading depends on). Such a chunk is rewritten without
# parsing it (``StreamRewrite.raw``); any other chunk, or one written another way,
# takes the parsed path. Written as strict JSON: what json.loads refuses fails here.
_CHAR = rb'(?:[^"\\\x00-\x1f]++|\\["\\/bfnrt]|\\u[0-9a-fA-F]{4})'
_STRING = rb'"' + _CHAR + rb'*+"'
_NONEMPTY_STRING = rb'"' + _CHAR + rb'++"'
_NUMBER = rb"(?:0|-?[1-9][0-9]*+|-0)"
_ONE_PIECE = re.compile(
    rb'\{(?:(?!"choices")"[a-z_]++":(?:' + _STRING + rb"|" + _NUMBER + rb"|null),)*+"
    rb'"choices":\[\{"index":(0|[1-9][0-9]*+),'
    rb'"delta":\{"(reasoning|content)":(' + _NONEMPTY_STRING + rb")\}"
    rb'(?:,(?!"(?:index|delta)")"[a-z_]++":null)*+\}\]'
    rb'(?:,(?!"choices")"[a-z_]++":null)*+\}'
)


def object_id() -> str:
    """24 hex digits, as a MongoDB ObjectId: 4 bytes of seconds, 8 random bytes (the
    spec's response ids, P2.1)."""
    return f"{int(time.time()) & 0xFFFFFFFF:08x}{secrets.token_hex(8)}"


def spec_call_id(call_id: Any, name: Any, number: int) -> Any:
    """The spec's tool-call id, ``NAME_N`` (P2.2): ``functions.NAME:N`` read as it
    is; any other id numbered ``number`` (the conversation's call count)."""
    if not isinstance(name, str) or not name:
        return call_id
    found = _K3_CALL_ID.match(call_id) if isinstance(call_id, str) else None
    if found is not None and found.group(1) == name:
        return f"{name}_{found.group(2)}"
    return f"{name}_{number}"


def history_calls(body: dict[str, Any]) -> int:
    """Tool calls the request's past assistant turns made."""
    count = 0
    messages = body.get("messages")
    for message in messages if isinstance(messages, list) else ():
        if isinstance(message, dict) and message.get("role") == "assistant":
            calls = message.get("tool_calls")
            count += len(calls) if isinstance(calls, list) else 0
    return count


def rewrite_request(body: dict[str, Any]) -> tuple[dict[str, Any], bool]:
    """The request vLLM gets, and whether the client asked for the usage summary
    (a streamed request always asks vLLM for it: the end frame needs the usage)."""
    if "request_id" not in body:
        # vLLM's response id is ``chatcmpl-`` and this (an X-Request-Id header wins).
        body = {**body, "request_id": object_id()}
    if not body.get("stream"):
        return body, False
    options = body.get("stream_options", {})
    if not isinstance(options, dict):
        return body, False  # vLLM refuses it, as it would without the switch
    wanted = bool(options.get("include_usage"))
    options = {**options, "include_usage": True}
    if not wanted:
        # vLLM reads continuous usage only together with the summary: a client
        # that asked for the one without the other gets neither, as before.
        options["continuous_usage_stats"] = False
    return {**body, "stream_options": options}, wanted


def rewrite_body(body: dict[str, Any], history: int = 0) -> dict[str, Any]:
    """A non-streamed response: ``reasoning_content`` beside each message's
    ``reasoning``; tool-call ids in the spec's form (``history``: the request's past
    calls)."""
    for choice in body.get("choices") or ():
        message = choice.get("message")
        if not isinstance(message, dict):
            continue
        if "reasoning" in message:
            message["reasoning_content"] = message["reasoning"]
        for number, call in enumerate(message.get("tool_calls") or (), history):
            if isinstance(call, dict) and isinstance(call.get("function"), dict):
                name = call["function"].get("name")
                call["id"] = spec_call_id(call.get("id"), name, number)
    return body


@dataclass
class _Choice:
    reasoning_sent: bool = False
    boundary_sent: bool = False
    held_end: dict[str, Any] | None = None

    @property
    def boundary_due(self) -> bool:
        """Thinking went out and its end has not been marked."""
        return self.reasoning_sent and not self.boundary_sent

    def boundary(self) -> list[dict[str, Any]]:
        """The boundary delta if it is due (then it is not due again), else none."""
        if not self.boundary_due:
            return []
        self.boundary_sent = True
        return [dict(BOUNDARY)]


@dataclass
class StreamRewrite:
    """One streamed response. ``chunk`` takes each parsed ``data:`` payload and
    returns the payloads to send in its place; ``done`` is called at ``[DONE]``
    (or the stream's end) and returns what is still held."""

    client_wants_usage: bool
    history: int = 0
    """Tool calls the request's past turns made: the spec numbers ids from there."""
    _choices: dict[int, _Choice] = field(default_factory=dict)

    def chunk(self, payload: dict[str, Any]) -> list[dict[str, Any]] | None:
        """The payloads to send for ``payload``, or ``None``: send it as it came."""
        choices = payload.get("choices")
        if not isinstance(choices, list):
            # An error or anything else: after what is held, which it ends.
            held = self.done()
            return [*held, payload] if held else None
        if not choices:
            return self._summary(payload)
        if len(choices) == 1 and isinstance(choices[0], dict):
            unchanged = self._as_it_comes(choices[0])
            if unchanged is not None:
                return None if unchanged else [payload]
        out: list[dict[str, Any]] = []
        for choice in choices:
            out += self._choice(payload, choice)
        return out

    def raw(self, data: bytes) -> bytes | None:
        """``chunk`` on a ``data:`` payload still unparsed, for the chunks vLLM sends
        most (one reasoning or content piece; see ``_ONE_PIECE``): the bytes to send,
        or ``None``: parse it and call ``chunk``. Same result as ``chunk`` would give,
        without reading or writing the JSON."""
        found = _ONE_PIECE.fullmatch(data)
        if found is None:
            return None
        index = int(found.group(1))
        state = self._choices.get(index) or self._choices.setdefault(index, _Choice())
        if found.group(2) == b"reasoning":
            state.reasoning_sent = True
            end = found.end(3)
            return data[:end] + b',"reasoning_content":' + found.group(3) + data[end:]
        return None if state.boundary_due else data

    def _as_it_comes(self, choice: dict[str, Any]) -> bool | None:
        """Most frames: one piece of one kind, nothing to split or insert. ``True``:
        the chunk goes on unchanged; ``False``: as it is now (a reasoning piece has
        gained its ``reasoning_content``); ``None``: the general path."""
        delta = choice.get("delta")
        if not isinstance(delta, dict) or len(delta) != 1:
            return None
        if choice.get("finish_reason") is not None:
            return None
        state = self._choices.setdefault(choice.get("index", 0), _Choice())
        ((kind, value),) = delta.items()
        if kind == "reasoning" and isinstance(value, str) and value:
            state.reasoning_sent = True
            delta["reasoning_content"] = value
            return False
        if kind == "tool_calls" and _continuations(value):
            return True
        if kind == "content" and value and not state.boundary_due:
            return True
        return None

    def done(self) -> list[dict[str, Any]]:
        held = [c.held_end for c in self._choices.values() if c.held_end is not None]
        for state in self._choices.values():
            state.held_end = None
        return held

    # -- per choice -------------------------------------------------------------------

    def _choice(self, payload, choice) -> list[dict[str, Any]]:
        state = self._choices.setdefault(choice.get("index", 0), _Choice())
        delta = choice.get("delta")
        if not isinstance(delta, dict) or "role" in delta:
            return [_frame(payload, choice)]  # the first frame, or not a delta
        bare = _bare(choice)
        per_token = {key: choice[key] for key in _PER_TOKEN if key in choice}
        deltas: list[dict[str, Any]] = []
        for part in _parts(delta):
            if "reasoning" in part:
                state.reasoning_sent = True
                part = {**part, "reasoning_content": part["reasoning"]}
            elif "content" in part:
                deltas += state.boundary()
            if "tool_calls" in part and isinstance(part["tool_calls"], list):
                others = {k: v for k, v in part.items() if k != "tool_calls"}
                calls = _call_pieces(part["tool_calls"], self.history)
                deltas += [{**others, "tool_calls": [calls[0]]}]
                deltas += [{"tool_calls": [call]} for call in calls[1:]]
                continue
            deltas.append(part)
        finish = choice.get("finish_reason")
        if finish is not None:
            deltas += state.boundary()
        if not deltas and any(per_token.values()):
            deltas.append({})  # logprobs or token ids with nothing to show
        out = []
        for number, part in enumerate(deltas):
            # The per-token fields ride on the last piece of what they came with.
            extra = per_token if number == len(deltas) - 1 else {}
            piece = {**bare, **extra, "delta": part, "finish_reason": None}
            piece.pop("stop_reason", None)
            out.append(_frame(payload, piece))
        if finish is not None:
            # Held until the usage summary follows (``rewrite_request`` asks for
            # it), or the stream ends.
            state.held_end = _frame(payload, {**bare, "delta": {}})
        return out

    def _summary(self, payload) -> list[dict[str, Any]]:
        usage = payload.get("usage")
        out = []
        for state in self._choices.values():
            if state.held_end is not None:
                if isinstance(usage, dict):
                    state.held_end["choices"][0]["usage"] = copy.deepcopy(usage)
                out.append(state.held_end)
                state.held_end = None
        if self.client_wants_usage:
            out.append(payload)
        return out


def _parts(delta: dict[str, Any]) -> list[dict[str, Any]]:
    """The delta as one-kind deltas, in order; null values dropped, and an empty
    content string with them."""
    parts = []
    for kind in _KINDS:
        value = delta.get(kind)
        if value is None or value == "" or value == []:
            continue
        parts.append({kind: value})
    others = {
        key: value
        for key, value in delta.items()
        if key not in _KINDS and value is not None
    }
    if others:
        if parts:
            parts[0] = {**others, **parts[0]}
        else:
            parts.append(others)
    return parts


def _continuations(calls: Any) -> bool:
    """One call's arguments going on (no id, nothing to rename or split)."""
    return (
        isinstance(calls, list)
        and len(calls) == 1
        and isinstance(calls[0], dict)
        and calls[0].get("id") is None
    )


def _call_pieces(calls: list[Any], history: int) -> list[Any]:
    """One call a piece; a call's first chunk (the one with its id) carries its name
    and ``arguments: ""`` with the spec's id, and its arguments go on in the next
    piece (P0.13, P2.2)."""
    pieces: list[Any] = []
    for call in calls:
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or call.get("id") is None:
            pieces.append(call)  # a continuation (vLLM may write its id as null)
            continue
        index = call.get("index", 0)
        number = history + index if isinstance(index, int) else history
        arguments = function.get("arguments") or ""
        first = {
            **call,
            "id": spec_call_id(call["id"], function.get("name"), number),
            "function": {**function, "arguments": ""},
        }
        pieces.append(first)
        if arguments:
            pieces.append({"index": index, "function": {"arguments": arguments}})
    return pieces


def _bare(choice: dict[str, Any]) -> dict[str, Any]:
    """The choice without its delta and per-token fields."""
    return {
        key: value
        for key, value in choice.items()
        if key != "delta" and key not in _PER_TOKEN
    }


def _frame(payload: dict[str, Any], choice: dict[str, Any]) -> dict[str, Any]:
    frame = {key: payload[key] for key in _ENVELOPE if key in payload}
    frame.update(
        {
            key: value
            for key, value in payload.items()
            if key not in (*_ENVELOPE, "choices")
        }
    )
    frame["choices"] = [choice]
    return frame
