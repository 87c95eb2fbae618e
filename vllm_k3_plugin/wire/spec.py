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
import secrets
import time
from dataclasses import dataclass, field, replace
from typing import Any

from vllm_k3_plugin.wire.facts import EngineFacts

CHAT_COMPLETIONS_PATH = "/v1/chat/completions"
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
# A chunk as vLLM serialises most of them: compact JSON, scalar envelope fields, one
# choice whose delta is one non-empty reasoning or content string, and otherwise only
# nulls (none under a key the reading depends on). Such a chunk is rewritten without
# parsing it (``StreamRewrite.raw``); any other chunk, or one written another way,
# takes the parsed path. Written as strict JSON: what json.loads refuses fails here.
_CHAR = rb'(?:[^"\\\x00-\x1f]++|\\["\\/bfnrt]|\\u[0-9a-fA-F]{4})'
_STRING = rb'"' + _CHAR + rb'*+"'
_NONEMPTY_STRING = rb'"' + _CHAR + rb'++"'
_NUMBER = rb"(?:0|-?[1-9][0-9]*+|-0)"
# A piece's text that can be read as the bytes around it say (``StreamRewrite.framed``),
# and its closing quote: no quote or backslash (escapes go the regex's way), nothing
# JSON refuses unescaped.
_PLAIN_TEXT = re.compile(rb'[^"\\\x00-\x1f]++"')
# A server-sent event as vLLM writes one a message (P0.6).
SSE_DATA = b"data: "
SSE_END = b"\n\n"
_ONE_PIECE = re.compile(
    rb'\{(?:(?!"choices")"[a-z_]++":(?:' + _STRING + rb"|" + _NUMBER + rb"|null),)*+"
    rb'"choices":\[\{"index":(0|[1-9][0-9]*+),'
    rb'"delta":\{"(reasoning|content)":(' + _NONEMPTY_STRING + rb")\}"
    rb'(?:,(?!"(?:index|delta)")"[a-z_]++":null)*+\}\]'
    rb'(?:,(?!"choices")"[a-z_]++":null)*+\}'
)
_COUNT = rb"(0|[1-9][0-9]*+)"
# vLLM's continuous usage (``UsageInfo`` dumped as its stream generator sets it).
_USAGE = re.compile(
    rb'\{"prompt_tokens":' + _COUNT + rb',"total_tokens":' + _COUNT
    + rb',"completion_tokens":' + _COUNT
    + rb'(?:,"completion_tokens_details":(null|\{"reasoning_tokens":' + _COUNT
    + rb"\}))?\}"
)  # fmt: skip
# A one-choice chunk with continuous usage, exactly as vLLM writes it: the choice
# ends in its nulls (``token_ids`` on 0.32), the usage follows, then only nulls
# (``kv_transfer_params`` on 0.33). Groups: what precedes the text (its kind in 2),
# the text, what follows it up to the usage, the usage (``_USAGE``), and ``after``.
_ONE_PIECE_WITH_USAGE = re.compile(
    rb'(\{(?:(?!"(?:choices|prompt_token_ids)")"[a-z_]++":(?:' + _STRING + rb"|"
    + _NUMBER + rb'|null),)*+"choices":\[\{"index":0,"delta":\{"(reasoning|content)'
    rb'":")(' + _CHAR + rb'++)'
    rb'("\},"logprobs":null,"finish_reason":null(?:,"token_ids":null)?\}\],"usage":)'
    rb"(" + _USAGE.pattern + rb")"
    rb'(?P<after>(?:,(?!"(?:choices|usage|prompt_token_ids)")"[a-z_]++":null)*+)\}'
)  # fmt: skip
# What the parsed path writes after such a chunk's text: the choice without its
# token ids (the client did not ask for them).
_USAGE_MIDDLE = b'"},"logprobs":null,"finish_reason":null}],"usage":'


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


@dataclass(frozen=True)
class Asked:
    """What the client's request asked of a streamed response."""

    usage: bool = False
    """``stream_options.include_usage``: the summary frame."""
    continuous_usage: bool = False
    """``continuous_usage_stats`` (with ``include_usage``): usage on every frame."""
    internal_content: bool = False
    """``include_internal_content``: each piece's token ids in its delta (P0.5)."""
    token_ids: bool = False
    """``return_token_ids``: vLLM's own token id fields."""
    choices: int = 1
    """``n``."""
    history: int = 0
    """Tool calls the request's past turns made: the spec numbers ids from there."""
    model: Any = None
    response_id: str | None = None
    """What vLLM names the response (``chatcmpl-`` and the request id)."""

    @property
    def per_choice_usage(self) -> bool:
        """vLLM gives usage per choice only on continuous frames: asked for them
        when the client did, or when several choices each need their own."""
        return self.continuous_usage or self.choices > 1


def rewrite_request(body: dict[str, Any]) -> tuple[dict[str, Any], Asked]:
    """The request vLLM gets, and what the client asked of the response (a streamed
    request always asks vLLM for the usage summary: the end frame needs it)."""
    if "request_id" not in body:
        # vLLM's response id is ``chatcmpl-`` and this (an X-Request-Id header wins).
        body = {**body, "request_id": object_id()}
    n = _lax_int(body.get("n"))
    asked = Asked(
        token_ids=_lax_bool(body.get("return_token_ids")),
        choices=n if n is not None and n > 1 else 1,
        history=history_calls(body),
        model=body.get("model"),
        response_id=f"chatcmpl-{body['request_id']}",
    )
    if not _lax_bool(body.get("stream")):
        return body, asked
    options = body.get("stream_options")
    if options is None:
        options = {}
    if not isinstance(options, dict):
        return body, asked  # vLLM refuses it, as it would without the switch
    include_usage = _lax_bool(options.get("include_usage"))
    asked = replace(
        asked,
        usage=include_usage,
        # vLLM reads continuous usage only together with the summary: a client
        # that asked for the one without the other gets neither, as before.
        continuous_usage=include_usage
        and _lax_bool(options.get("continuous_usage_stats")),
        internal_content=_lax_bool(options.get("include_internal_content")),
    )
    options = {
        **options,
        "include_usage": True,
        "continuous_usage_stats": asked.per_choice_usage,
    }
    body = {**body, "stream_options": options}
    if asked.internal_content:
        body["return_token_ids"] = True
    return body, asked


_TRUE = frozenset({"1", "on", "t", "true", "y", "yes"})


def _lax_bool(value: Any) -> bool:
    """A request flag as vLLM's pydantic models read it (lax: ``1``, ``"true"``,
    ``"yes"``, …); what they would refuse reads as false (vLLM answers 400)."""
    if isinstance(value, bool):
        return value
    if isinstance(value, (int, float)):
        return value == 1
    return isinstance(value, str) and value.strip().lower() in _TRUE


def _lax_int(value: Any) -> int | None:
    """A request count as vLLM's pydantic models read it (``2``, ``2.0``, ``"2"``);
    ``None`` where they would refuse it (vLLM answers 400)."""
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str):
        try:
            number = float(value.strip())
        except ValueError:
            return None
        return int(number) if number.is_integer() else None
    return None


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
class _Choice:
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
class StreamRewrite:
    """One streamed response. ``chunk`` takes each parsed ``data:`` payload and
    returns the payloads to send in its place; ``done`` is called at ``[DONE]``
    (or the stream's end) and returns what is still held."""

    asked: Asked = field(default_factory=Asked)
    facts: EngineFacts = field(default_factory=EngineFacts)
    """Filled by the serving hook before the first frame (``facts.py``)."""
    _choices: dict[int, _Choice] = field(default_factory=dict)
    _envelope: dict[str, Any] | None = None
    # The bytes around the text of a one-choice stream's one-piece events, as the
    # first of each kind that ``raw`` read showed them (``framed``): the tail when
    # the events carry no usage, else what leads from the text to the usage.
    _reasoning_head: bytes | None = None
    _content_head: bytes | None = None
    _tail: bytes | None = None
    _usage_middle: bytes | None = None
    _usage_end: bytes | None = None

    @property
    def _plain(self) -> bool:
        """Frames carry no usage or token ids the rewrite has to move."""
        return not (self.asked.per_choice_usage or self.asked.internal_content)

    @property
    def _usage_bytes_path(self) -> bool:
        """One choice whose frames carry the continuous usage the client asked for
        and no token ids: ``raw`` reads them too."""
        asked = self.asked
        return (
            asked.continuous_usage
            and asked.choices == 1
            and not (asked.internal_content or asked.token_ids)
        )

    def raw(self, data: bytes) -> bytes | None:
        """``chunk`` on a ``data:`` payload still unparsed, for the chunks vLLM sends
        most (one reasoning or content piece; see ``_ONE_PIECE``, and
        ``_ONE_PIECE_WITH_USAGE`` for continuous usage): the bytes to send, or
        ``None``: parse it and call ``chunk``. Same result as ``chunk`` would give,
        without reading or writing the JSON."""
        if self._envelope is None:
            return None
        if self._usage_bytes_path:
            return self._raw_with_usage(data)
        if not self._plain:
            return None
        found = _ONE_PIECE.fullmatch(data)
        if found is None or not (data.isascii() or _utf8(data)):
            return None
        index = int(found.group(1))
        state = self._choices.get(index) or self._choices.setdefault(index, _Choice())
        if index == 0 and self.asked.choices == 1:
            self._learn(data, found)
        if found.group(2) == b"reasoning":
            state.reasoning_sent = True
            end = found.end(3)
            return data[:end] + b',"reasoning_content":' + found.group(3) + data[end:]
        return None if state.boundary_due else data

    def _learn(self, data: bytes, found: re.Match[bytes]) -> None:
        text_start, text_end = found.start(3) + 1, found.end(3) - 1
        head = SSE_DATA + data[:text_start]
        if found.group(2) == b"reasoning":
            self._reasoning_head = head
        else:
            self._content_head = head
        if self._tail is None:
            self._tail = data[text_end:] + SSE_END

    def _raw_with_usage(self, data: bytes) -> bytes | None:
        found = _ONE_PIECE_WITH_USAGE.fullmatch(data)
        if found is None or not (data.isascii() or _utf8(data)):
            return None
        state = self._choices.get(0) or self._choices.setdefault(0, _Choice())
        reasoning = found.group(2) == b"reasoning"
        head = SSE_DATA + found.group(1)
        if reasoning:
            self._reasoning_head = head
        else:
            self._content_head = head
        self._usage_middle = found.group(4)
        self._usage_end = found["after"] + b"}" + SSE_END
        if not reasoning and state.boundary_due:
            return None
        usage = _USAGE.fullmatch(data, found.start(5), found.end(5))
        return self._with_usage(
            state, reasoning, found.group(1), found.group(3), usage, data
        )[len(SSE_DATA) : -len(SSE_END)]

    def _with_usage(
        self,
        state: _Choice,
        reasoning: bool,
        head: bytes,
        text: bytes,
        usage: re.Match[bytes],
        data: bytes,
    ) -> bytes:
        """The event of a one-piece chunk with continuous usage, as the parsed path
        writes it; ``head`` without the event's ``data: ``."""
        prompt, total, completion, details, reasoning_tokens = usage.groups()
        state.usage = {
            "prompt_tokens": int(prompt),
            "total_tokens": int(total),
            "completion_tokens": int(completion),
        }
        if details is not None:
            state.usage["completion_tokens_details"] = (
                None
                if reasoning_tokens is None
                else {"reasoning_tokens": int(reasoning_tokens)}
            )
        usage_bytes = data[usage.start() : usage.end()]
        if self.facts.known:
            cached = b',"prompt_tokens_details":{"cached_tokens":%d}}' % (
                self.facts.cached_tokens
            )
            usage_bytes = usage_bytes[:-1] + cached
        if reasoning:
            state.reasoning_sent = True
            text += b'","reasoning_content":"' + text
        end = self._usage_end
        return SSE_DATA + head + text + _USAGE_MIDDLE + usage_bytes + end

    def framed(self, event: bytes) -> bytes | None:
        """``raw`` on a whole event (``data: `` and its payload and the blank line),
        for the events of a one-choice stream that differ from one ``raw`` has read
        only in their text (and usage counts), and whose text holds no quote,
        backslash or control character: the bytes to send (``event`` itself if
        unchanged), or ``None``: call ``raw``. Compares bytes and reads nothing
        else, so most of a stream's events cost the switch a few comparisons."""
        head = self._content_head
        only = self._choices.get(0)
        if head is not None and event.startswith(head):
            if only.reasoning_sent and not only.boundary_sent:
                return None  # the boundary goes before it
            reasoning = False
        else:
            head = self._reasoning_head
            if head is None or not event.startswith(head):
                return None
            reasoning = True
        start = len(head)
        text_and_quote = _PLAIN_TEXT.match(event, start)
        if text_and_quote is None:
            return None
        end = text_and_quote.end() - 1
        if not (event.isascii() or _utf8(event[start:end])):
            return None
        middle = self._usage_middle
        if middle is not None:
            usage_end = len(event) - len(self._usage_end)
            usage = _USAGE.fullmatch(event, end + len(middle), usage_end)
            if (
                usage is None
                or not event.startswith(middle, end)
                or not event.endswith(self._usage_end)
            ):
                return None
            text = event[start:end]
            head = event[len(SSE_DATA) : start]
            return self._with_usage(only, reasoning, head, text, usage, event)
        tail = self._tail
        if tail is None or len(event) - end != len(tail) or not event.endswith(tail):
            return None
        if not reasoning:
            return event
        only.reasoning_sent = True
        text = event[start:end]
        return event[:end] + b'","reasoning_content":"' + text + event[end:]

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
        state = self._choices.setdefault(choice.get("index", 0), _Choice())
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
        state = self._choices.setdefault(index, _Choice())
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

    def _choice_usage(self, state: _Choice, summary: dict[str, Any]) -> dict:
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
                state = self._choices[index] = _Choice()
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


def _utf8(data: bytes) -> bool:
    try:
        data.decode()
    except UnicodeDecodeError:
        return False
    return True


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
