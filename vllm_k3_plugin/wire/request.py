"""The request side of Moonshot's wire spec (sans-I/O, standard library only): a
chat completion request rewritten before vLLM reads it, and ``Asked``, what the
client asked of the response, which the response's rewrite follows (``spec.py``,
``stream.py``); the spec's response ids (P2.1)."""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass, replace
from typing import Any

CHAT_COMPLETIONS_PATH = "/v1/chat/completions"


def object_id() -> str:
    """24 hex digits, as a MongoDB ObjectId: 4 bytes of seconds, 8 random bytes (the
    spec's response ids, P2.1)."""
    return f"{int(time.time()) & 0xFFFFFFFF:08x}{secrets.token_hex(8)}"


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
