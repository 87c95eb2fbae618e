"""Moonshot's streaming wire spec for chat completions, as a rewrite of vLLM's
exchange (sans-I/O, standard library only): the request JSON before vLLM reads it
(``request.py``), each streamed chunk (a parsed ``data:`` payload: ``ChunkRewrite``)
and the non-streamed body after (``rewrite_body``). ``stream.py`` reads the chunks
vLLM sends most as bytes, with the result this module gives them.

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
  usage, and the summary reaches the client only if it asked for it (P2.3); with
  several choices (P0.16) each takes its own counts from vLLM's continuous usage,
  asked for then and passed on only to a client that asked for it (P1.15);
- continuous usage carries the prompt's cached tokens (``facts.py``);
- ``include_internal_content`` (P0.5): the token ids vLLM returns per step go into
  ``delta.internal_content.token_ids`` of the first piece they show;
- an error frame mid-stream (P1.16) is not sent: each choice still open ends with
  ``server_interrupted``.

A frame inserted or split off copies the chunk's ``id``, ``object``, ``created`` and
``model`` and sets ``finish_reason`` to ``null``. Frames without choices other than
the summary and errors pass through unchanged.
"""

from __future__ import annotations

import copy
import re
import time
from dataclasses import dataclass, field
from typing import Any

from vllm_k3_plugin.wire.facts import EngineFacts
from vllm_k3_plugin.wire.request import Asked, object_id

# The order a split delta's parts go out in.
_KINDS = ("reasoning", "content", "tool_calls")
# The keys whose non-empty value shows the client something (P0.5).
_SHOWN = ("reasoning", "content", "tool_calls")
_ENVELOPE = ("id", "object", "created", "model")
_PER_TOKEN = ("logprobs", "token_ids")
BOUNDARY = {"reasoning_content": ""}
"""The delta that marks where thinking ends."""
# vLLM's and the plugin's tool-call id for K3 models: ``functions.NAME:N``.
_K3_CALL_ID = re.compile(r"^functions\.(.+):(\d+)$")


def spec_call_id(call_id: Any, name: Any, number: int) -> Any:
    """The spec's tool-call id, ``NAME_N`` (P2.2): ``functions.NAME:N`` read as it
    is; any other id numbered ``number`` (the conversation's call count)."""
    if not isinstance(name, str) or not name:
        return call_id
    found = _K3_CALL_ID.match(call_id) if isinstance(call_id, str) else None
    if found is not None and found.group(1) == name:
        return f"{name}_{found.group(2)}"
    return f"{name}_{number}"


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


INTERRUPTED = "server_interrupted"
"""The finish reason of a choice an error ended mid-stream (P1.16: the spec's
extended reasons; vLLM's error frame is not sent)."""


@dataclass
class ChoiceState:
    """What the rewrite keeps of one choice of the stream."""

    reasoning_sent: bool = False
    boundary_sent: bool = False
    ended: bool = False
    held_end: dict[str, Any] | None = None
    usage: dict[str, Any] | None = None
    """The choice's last continuous usage."""
    pending_ids: list[Any] = field(default_factory=list)
    """Token ids of steps that showed nothing yet (P0.5)."""

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
class ChunkRewrite:
    """One streamed response, chunk by chunk. ``chunk`` takes each parsed ``data:``
    payload and returns the payloads to send in its place; ``done`` is called at
    ``[DONE]`` (or the stream's end) and returns what is still held. The switch
    uses it as ``stream.StreamRewrite``, which reads most chunks as bytes first."""

    asked: Asked = field(default_factory=Asked)
    facts: EngineFacts = field(default_factory=EngineFacts)
    """Filled by the serving hook before the first frame (``facts.py``)."""
    _choices: dict[int, ChoiceState] = field(default_factory=dict)
    _envelope: dict[str, Any] | None = None

    @property
    def _plain(self) -> bool:
        """Frames carry no usage or token ids the rewrite has to move."""
        return not (self.asked.per_choice_usage or self.asked.internal_content)

    def chunk(self, payload: dict[str, Any]) -> list[dict[str, Any]] | None:
        """The payloads to send for ``payload``, or ``None``: send it as it came."""
        choices = payload.get("choices")
        if not isinstance(choices, list):
            return self._not_a_chunk(payload)
        if self._envelope is None:
            self._envelope = {k: payload[k] for k in _ENVELOPE if k in payload}
        if not choices:
            return self._summary(payload)
        if self._plain and len(choices) == 1 and isinstance(choices[0], dict):
            unchanged = self._as_it_comes(choices[0])
            if unchanged is not None:
                return None if unchanged else [payload]
        usage = payload.get("usage")
        out: list[dict[str, Any]] = []
        for choice in choices:
            if isinstance(choice, dict):
                out += self._choice(payload, choice, usage)
        return out

    def _as_it_comes(self, choice: dict[str, Any]) -> bool | None:
        """Most frames: one piece of one kind, nothing to split or insert. ``True``:
        the chunk goes on unchanged; ``False``: as it is now (a reasoning piece has
        gained its ``reasoning_content``); ``None``: the general path."""
        delta = choice.get("delta")
        if not isinstance(delta, dict) or len(delta) != 1:
            return None
        if choice.get("finish_reason") is not None:
            return None
        state = self._choices.setdefault(choice.get("index", 0), ChoiceState())
        ((kind, value),) = delta.items()
        if kind == "reasoning" and isinstance(value, str) and value:
            state.reasoning_sent = True
            delta["reasoning_content"] = value
            return False
        if kind == "tool_calls" and _continuations(value) and not state.boundary_due:
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

    def _choice(self, payload, choice, usage) -> list[dict[str, Any]]:
        index = choice.get("index", 0)
        state = self._choices.setdefault(index, ChoiceState())
        if isinstance(usage, dict):
            state.usage = usage
        envelope = self._envelope_of(payload, usage)
        delta = choice.get("delta")
        if not isinstance(delta, dict) or "role" in delta:
            # The first frame, or not a delta.
            return [_frame(envelope, self._per_token_kept(choice))]
        bare = _bare(choice)
        per_token = self._per_token_kept(
            {key: choice[key] for key in _PER_TOKEN if key in choice}
        )
        ids = choice.get("token_ids") if self.asked.internal_content else None
        if isinstance(ids, list):
            state.pending_ids += ids
        deltas: list[dict[str, Any]] = []
        for part in _parts(delta):
            if "reasoning" in part:
                state.reasoning_sent = True
                part = {**part, "reasoning_content": part["reasoning"]}
            elif "content" in part or "tool_calls" in part:
                # Where thinking ended: before the reply or the first call.
                deltas += state.boundary()
            if "tool_calls" in part and isinstance(part["tool_calls"], list):
                others = {k: v for k, v in part.items() if k != "tool_calls"}
                calls = _call_pieces(part["tool_calls"], self.asked.history)
                deltas += [{**others, "tool_calls": [calls[0]]}]
                deltas += [{"tool_calls": [call]} for call in calls[1:]]
                continue
            deltas.append(part)
        finish = choice.get("finish_reason")
        if finish is not None:
            deltas += state.boundary()
        if self.asked.internal_content:
            shown = [part for part in deltas if any(part.get(k) for k in _SHOWN)]
            for part, ids in zip(shown, _shares(state.pending_ids, len(shown))):
                part["internal_content"] = {"token_ids": ids}
            if shown:
                state.pending_ids = []
        if not deltas and any(per_token.values()):
            deltas.append({})  # logprobs or token ids with nothing to show
        out = []
        for number, part in enumerate(deltas):
            # The per-token fields ride on the last piece of what they came with.
            extra = per_token if number == len(deltas) - 1 else {}
            piece = {**bare, **extra, "delta": part, "finish_reason": None}
            piece.pop("stop_reason", None)
            out.append(_frame(envelope, piece))
        if finish is not None:
            # Held until the usage summary follows (``rewrite_request`` asks for
            # it), or the stream ends.
            state.ended = True
            state.held_end = _frame(envelope, {**bare, "delta": {}})
        return out

    def _envelope_of(self, payload, usage) -> dict[str, Any]:
        """The payload without its choices; its continuous usage only if the
        client asked for it, then with the prompt's cached tokens (P0.2)."""
        envelope = {k: v for k, v in payload.items() if k not in ("choices", "usage")}
        if "prompt_token_ids" in envelope and not self.asked.token_ids:
            del envelope["prompt_token_ids"]
        if isinstance(usage, dict) and self.asked.continuous_usage:
            envelope["usage"] = self._with_cached(usage)
        return envelope

    def _with_cached(self, usage: dict[str, Any]) -> dict[str, Any]:
        if "prompt_tokens_details" in usage or not self.facts.known:
            return usage
        cached = {"cached_tokens": self.facts.cached_tokens}
        return {**usage, "prompt_tokens_details": cached}

    def _per_token_kept(self, fields: dict[str, Any]) -> dict[str, Any]:
        if self.asked.token_ids or "token_ids" not in fields:
            return fields
        return {k: v for k, v in fields.items() if k != "token_ids"}

    def _summary(self, payload) -> list[dict[str, Any]]:
        usage = payload.get("usage")
        out = []
        for state in self._choices.values():
            if state.held_end is not None:
                if isinstance(usage, dict):
                    end = state.held_end
                    end["choices"][0]["usage"] = self._choice_usage(state, usage)
                out.append(state.held_end)
                state.held_end = None
        if self.asked.usage:
            out.append(payload)
        return out

    def _choice_usage(self, state: ChoiceState, summary: dict[str, Any]) -> dict:
        """The end frame's usage: the choice's own counts where vLLM gave them (its
        last continuous usage) with the summary's prompt details; else the
        summary's (one choice, no continuous usage)."""
        if not isinstance(state.usage, dict):
            return copy.deepcopy(summary)
        usage = self._with_cached(copy.deepcopy(state.usage))
        if summary.get("prompt_tokens_details") is not None:
            usage["prompt_tokens_details"] = copy.deepcopy(
                summary["prompt_tokens_details"]
            )
        return {k: v for k, v in usage.items() if v is not None}

    def _not_a_chunk(self, payload) -> list[dict[str, Any]] | None:
        """An error frame ends every choice still open with ``INTERRUPTED`` and is
        not sent (P1.16); anything else goes on after what is held."""
        if "error" not in payload:
            held = self.done()
            return [*held, payload] if held else None
        envelope = self._envelope or {
            "id": self.asked.response_id or f"chatcmpl-{object_id()}",
            "object": "chat.completion.chunk",
            "created": int(time.time()),
            "model": self.asked.model if isinstance(self.asked.model, str) else "",
        }
        out = self.done()
        for index in sorted(set(range(self.asked.choices)) | set(self._choices)):
            state = self._choices.get(index)
            if state is None:
                state = self._choices[index] = ChoiceState()
                deltas = [{"role": "assistant", "content": ""}]
            elif state.ended:
                continue
            else:
                deltas = state.boundary()
            base = {"index": index, "logprobs": None}
            for part in deltas:
                piece = {**base, "delta": part, "finish_reason": None}
                out.append(_frame(envelope, piece))
            end = {**base, "delta": {}, "finish_reason": INTERRUPTED}
            if isinstance(state.usage, dict):
                end["usage"] = self._with_cached(state.usage)
            state.ended = True
            out.append(_frame(envelope, end))
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


def _shares(ids: list[Any], pieces: int) -> list[list[Any]]:
    """A step's token ids over the pieces it showed, in order (which token wrote
    which piece is not known): one each and the rest on the last; a piece beyond
    the step's ids repeats its last, so that no piece goes without (P0.5)."""
    if len(ids) >= pieces:
        return [ids[i : i + 1] for i in range(pieces - 1)] + [ids[pieces - 1 :]]
    return [ids[i : i + 1] if i < len(ids) else ids[-1:] for i in range(pieces)]


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


def _frame(envelope: dict[str, Any], choice: dict[str, Any]) -> dict[str, Any]:
    """A chunk of ``choice`` in ``envelope`` (the payload's fields but choices and
    usage, and the usage to send): the envelope's identity fields first, as vLLM
    writes them."""
    frame = {key: envelope[key] for key in _ENVELOPE if key in envelope}
    frame.update(
        {key: value for key, value in envelope.items() if key not in _ENVELOPE}
    )
    frame["choices"] = [choice]
    return frame
