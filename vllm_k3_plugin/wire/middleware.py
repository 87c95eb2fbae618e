"""``--middleware vllm_k3_plugin.wire.MoonshotWireSpec``: the switch that puts a
deployment's ``/v1/chat/completions`` on Moonshot's wire spec (``spec.py`` says what
changes). A pure ASGI middleware, standard library only: vLLM adds it outermost, so
it sees the request body before vLLM parses it and every byte vLLM sends back. Any
other path, method or status passes through untouched.

The response also gets the prompt's usage headers (P0.18): a whole reply's from its
body; a stream's from the engine's first output, which the plugin's serving hook
records (``facts.py``), so the response start waits for the first frame.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import Any

from vllm_k3_plugin.wire import facts as engine_facts
from vllm_k3_plugin.wire.request import CHAT_COMPLETIONS_PATH, Asked, rewrite_request
from vllm_k3_plugin.wire.spec import rewrite_body
from vllm_k3_plugin.wire.stream import StreamRewrite

Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

_DONE = b"[DONE]"
# The prompt's token count and its prefix-cache hits, as headers (P0.18).
PROMPT_TOKENS_HEADER = b"x-msh-usage-prompt-tokens"
CACHED_TOKENS_HEADER = b"x-msh-usage-cached-tokens"


class MoonshotWireSpec:
    def __init__(self, app: Callable[..., Awaitable[None]]) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Receive, send: Send) -> None:
        if (
            scope.get("type") != "http"
            or scope.get("method") != "POST"
            or scope.get("path") != CHAT_COMPLETIONS_PATH
        ):
            await self.app(scope, receive, send)
            return
        raw = await _read_body(receive)
        if raw is None:
            return  # the client left before its request arrived whole
        try:
            request = json.loads(raw)
        except ValueError:
            request = None
        if not isinstance(request, dict):
            # Not a JSON object: vLLM answers it (with its own error).
            await self.app(scope, _replaying(raw, receive), send)
            return
        upstream, asked = rewrite_request(request)
        named = _header(scope, b"x-request-id")
        if named:
            # vLLM names the response after the header (the error frame's stand-in
            # end frames need the name before vLLM has sent it).
            asked = replace(asked, response_id=f"chatcmpl-{named.decode('latin-1')}")
        body = _json_bytes(upstream)
        scope = {**scope, "headers": _with_length(scope.get("headers", []), len(body))}
        facts = engine_facts.EngineFacts()
        rewriting = _Rewriting(send, asked, facts)
        token = engine_facts.CURRENT.set(facts)
        try:
            await self.app(scope, _replaying(body, receive), rewriting.send)
        finally:
            engine_facts.CURRENT.reset(token)


async def _read_body(receive: Receive) -> bytes | None:
    """The whole request body, or ``None`` if the client disconnected first."""
    chunks = []
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return None
        chunks.append(message.get("body", b""))
        if not message.get("more_body"):
            return b"".join(chunks)


def _replaying(body: bytes, receive: Receive) -> Receive:
    """The request body once, then the client's own messages (vLLM watches them for
    a disconnect)."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


def _with_length(headers, length: int) -> list:
    dropped = (b"content-length", b"transfer-encoding")
    kept = [(k, v) for k, v in headers if k.lower() not in dropped]
    return [*kept, (b"content-length", str(length).encode())]


def _json_bytes(value: Any, separators: tuple[str, str] | None = None) -> bytes:
    """``value`` as UTF-8 JSON; text that UTF-8 cannot hold (an escaped lone
    surrogate) stays escaped."""
    try:
        return json.dumps(value, ensure_ascii=False, separators=separators).encode()
    except UnicodeEncodeError:
        return json.dumps(value, separators=separators).encode()


class _Rewriting:
    """The response side: server-sent events rewritten frame by frame, a JSON body
    rewritten whole; anything else, or an error status, as it comes."""

    def __init__(
        self, send: Send, asked: Asked, facts: engine_facts.EngineFacts
    ) -> None:
        self._send = send
        self._asked = asked
        self._facts = facts
        self._mode: str | None = None
        self._start: Message | None = None
        self._buffer = b""
        self._stream: StreamRewrite | None = None
        # The response start is sent and the body is events: ``framed`` may read
        # the next message.
        self._streaming = False

    async def send(self, message: Message) -> None:
        kind = message["type"]
        if (
            self._streaming
            and kind == "http.response.body"
            and message.get("more_body")
            and not self._buffer
        ):
            # Most of a stream: one event a message, matched as bytes.
            event = message.get("body", b"")
            out = self._stream.framed(event)
            if out is event:
                await self._send(message)
                return
            if out is not None:
                await self._send({"type": kind, "body": out, "more_body": True})
                return
        if kind == "http.response.start":
            content_type = _header(message, b"content-type").lower()
            if message.get("status") != 200:
                self._mode = "pass"
            elif content_type.startswith(b"text/event-stream"):
                self._mode = "events"
                self._stream = StreamRewrite(self._asked, self._facts)
                self._start = message
                return  # sent with the first frame, when the usage headers are known
            elif content_type.startswith(b"application/json"):
                self._mode = "json"
                self._start = message
                return  # sent with the rewritten body's length
            else:
                self._mode = "pass"
            await self._send(message)
            return
        if kind != "http.response.body" or self._mode == "pass":
            await self._send(message)
            return
        more = message.get("more_body", False)
        if self._mode == "json":
            self._buffer += message.get("body", b"")
            if not more:
                await self._send_json()
            return
        await self._send_events(message.get("body", b""), more)

    async def _send_json(self) -> None:
        body = self._buffer
        try:
            parsed = json.loads(body)
        except ValueError:
            parsed = None
        start = dict(self._start or {})
        headers = start.get("headers", [])
        if isinstance(parsed, dict):
            body = _json_bytes(rewrite_body(parsed, self._asked.history))
            headers = _with_usage(headers, parsed.get("usage"))
        start["headers"] = _with_length(headers, len(body))
        await self._send(start)
        await self._send({"type": "http.response.body", "body": body})

    async def _send_events(self, data: bytes, more: bool) -> None:
        data = self._buffer + data
        if b"\r" in data:
            # CRLF framing, a pair possibly cut between two messages.
            data = data.replace(b"\r\n", b"\n")
        *events, self._buffer = data.split(b"\n\n")
        if not more and self._buffer.strip():
            events.append(self._buffer)
            self._buffer = b""
        out = b"".join([self._event(event) for event in events])
        if not more:
            out += b"".join(_data(frame) for frame in self._stream.done())
        if out or not more:
            if self._start is not None:
                start, self._start = self._start, None
                if self._facts.known:
                    start = {**start, "headers": _with_facts(start, self._facts)}
                await self._send(start)
                self._streaming = True
            await self._send(
                {"type": "http.response.body", "body": out, "more_body": more}
            )

    def _event(self, event: bytes) -> bytes:
        if not event.startswith(b"data: "):
            return event + b"\n\n" if event.strip() else b""
        body = event[len(b"data: ") :]
        if body.strip() == _DONE:
            held = b"".join(_data(frame) for frame in self._stream.done())
            return held + event + b"\n\n"
        fast = self._stream.raw(body)
        if fast is not None:
            return b"data: " + fast + b"\n\n"
        try:
            payload = json.loads(body)
        except ValueError:
            return event + b"\n\n"
        if not isinstance(payload, dict):
            return event + b"\n\n"
        frames = self._stream.chunk(payload)
        if frames is None:
            return event + b"\n\n"
        return b"".join(_data(frame) for frame in frames)


def _data(frame: dict[str, Any]) -> bytes:
    return b"data: " + _json_bytes(frame, (",", ":")) + b"\n\n"


def _with_usage(headers, usage: Any) -> list:
    """The usage headers of a whole reply, from its usage (cached: 0 if unsaid)."""
    if not isinstance(usage, dict) or not isinstance(usage.get("prompt_tokens"), int):
        return headers
    details = usage.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    cached = cached if isinstance(cached, int) else 0
    return _usage_headers(headers, usage["prompt_tokens"], cached)


def _with_facts(start: Message, facts: engine_facts.EngineFacts) -> list:
    return _usage_headers(
        start.get("headers", []), facts.prompt_tokens, facts.cached_tokens
    )


def _usage_headers(headers, prompt_tokens: Any, cached_tokens: Any) -> list:
    return [
        *headers,
        (PROMPT_TOKENS_HEADER, str(prompt_tokens).encode()),
        (CACHED_TOKENS_HEADER, str(cached_tokens).encode()),
    ]


def _header(message: Message, name: bytes) -> bytes:
    for key, value in message.get("headers", []):
        if key.lower() == name:
            return value
    return b""
