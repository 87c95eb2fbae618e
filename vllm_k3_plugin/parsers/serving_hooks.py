"""What a reply says when the output ended inside a tool call (K3_FORMAT rule 9).

A call the end of the output cut off (``max_tokens``, or a stop inside the call) is
in the reply as it streamed, and the reply's finish reason is what ended the output,
never ``tool_calls``; on ``/v1/messages``, never ``tool_use``. vLLM decides those
reasons in its serving layer from "were tool calls made", which a cut call answers
yes. ``K3Parser`` records each output it finishes reading (``record_output``), in the
asyncio task that serves the request; the hooks here read that record where vLLM
decides:

- vLLM 0.33: ``resolve_finish_reason``, as chat completions' two paths import it;
- vLLM 0.32: the chat completions response and stream (``tool_calls`` is decided
  inline there): the choice's finish reason is set back to what ended the output;
- both: ``/v1/messages``' stop reason, and its non-streaming conversion, whose
  ``json.loads`` of each call's arguments fails on a cut call: there a call whose
  arguments are not JSON keeps them as text, ``{RAW_ARGUMENTS_KEY: "<text>"}``
  (``raw_arguments.py``).

Responses needs nothing: it reports the engine's finish reason. A Responses stream
an error ends sends ``response.failed`` (``stream_faults``).

The endpoint hook (``_serving_as``) labels each request for the metrics and wraps a
streamed reply so that its outputs cut short are counted when it closes
(``metrics.tallied``).

All hooks are installed once, in the API server, when vLLM first composes a
``kimi_k3`` parser. The finish-reason hooks change nothing for a reply with no K3
output read; the ``/v1/messages`` conversion keeps any non-object arguments as text.
"""

from __future__ import annotations

import contextvars
import functools
import inspect
from collections.abc import AsyncIterator, Callable
from typing import Any, NamedTuple

from vllm_k3_plugin.parsers import metrics, stream_faults
from vllm_k3_plugin.parsers.raw_arguments import json_object_text
from vllm_k3_plugin.wire import facts as engine_facts

_MARK = "_vllm_k3_plugin_hook"
_TOOL_CALLS_FINISH = '"finish_reason":"tool_calls"'


class Outcome(NamedTuple):
    """How one output read ended."""

    calls_cut: bool
    """A tool call was still open when the output ended."""
    ended_by: str
    """``stop`` (the model stopped itself) or ``length``."""


_OUTCOMES: contextvars.ContextVar[list[Outcome] | None] = contextvars.ContextVar(
    "vllm_k3_plugin_outcomes", default=None
)


def record_output(*, calls_cut: bool, stopped: bool) -> None:
    """Called by ``K3Parser`` when it finishes reading an output."""
    outcome = Outcome(calls_cut, "stop" if stopped else "length")
    outcomes = _OUTCOMES.get()
    if outcomes is None:
        _OUTCOMES.set([outcome])
    else:
        outcomes.append(outcome)


def last_output_cut() -> bool:
    outcomes = _OUTCOMES.get()
    return bool(outcomes) and outcomes[-1].calls_cut


def install() -> None:
    """Install every hook this vLLM has a place for (idempotent)."""
    _hook_resolve_finish_reason()
    _hook_chat_completions_032()
    _hook_messages()
    _hook_engine_facts()
    _hook_endpoints()
    _hook_responses_failed()


def _wrap(owner: Any, name: str, make: Callable[[Any], Any]) -> None:
    """``owner.name`` wrapped by ``make``, once however often this is called."""
    original = getattr(owner, name, None)
    marks = getattr(original, _MARK, frozenset())
    if original is None or make.__name__ in marks:
        return
    wrapped = make(original)
    setattr(wrapped, _MARK, marks | {make.__name__})
    setattr(owner, name, wrapped)


# -- vLLM 0.33 ------------------------------------------------------------------------


def _hook_resolve_finish_reason() -> None:
    import importlib

    for module_name in (
        "vllm.entrypoints.openai.chat_completion.serving",
        "vllm.entrypoints.openai.chat_completion.stream_processor",
        "vllm.renderers.online_derenderer",
    ):
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        if hasattr(module, "resolve_finish_reason"):
            _wrap(module, "resolve_finish_reason", _resolving_cut_calls)


def _resolving_cut_calls(original: Callable[..., str]) -> Callable[..., str]:
    @functools.wraps(original)
    def resolve_finish_reason(engine_finish_reason, request, tool_calls_made):
        if tool_calls_made and last_output_cut():
            tool_calls_made = False
        return original(engine_finish_reason, request, tool_calls_made)

    return resolve_finish_reason


# -- vLLM 0.32 ------------------------------------------------------------------------


def _hook_chat_completions_032() -> None:
    from vllm.entrypoints.openai.chat_completion import serving

    if hasattr(serving, "resolve_finish_reason"):
        return  # 0.33 decides in ``resolve_finish_reason``
    chat = serving.OpenAIServingChat
    _wrap(chat, "chat_completion_full_generator", _full_reply_reasons)
    _wrap(chat, "chat_completion_stream_generator", _stream_reply_reasons)


def _full_reply_reasons(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    async def chat_completion_full_generator(self, *args, **kwargs):
        # Left set: ``/v1/messages`` reads the outcome after this returns (the
        # variable lives as long as the request's task).
        _OUTCOMES.set([])
        response = await original(self, *args, **kwargs)
        outcomes = _OUTCOMES.get() or []
        choices = getattr(response, "choices", None) or []
        # The parser reads the choices in order, one output each.
        if len(outcomes) == len(choices):
            for choice, outcome in zip(choices, outcomes):
                # 0.32 says ``tool_calls`` whenever calls were made; a length cut
                # stays ``length`` (as its stream says), a cut call what ended it.
                cut = outcome.calls_cut or outcome.ended_by != "stop"
                if cut and choice.finish_reason == "tool_calls":
                    choice.finish_reason = outcome.ended_by
        return response

    return chat_completion_full_generator


def _stream_reply_reasons(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    async def chat_completion_stream_generator(
        self, *args, **kwargs
    ) -> AsyncIterator[str]:
        _OUTCOMES.set([])
        async for chunk in original(self, *args, **kwargs):
            # A choice's finishing chunk follows the read of its last delta.
            if _TOOL_CALLS_FINISH in chunk and last_output_cut():
                chunk = chunk.replace(_TOOL_CALLS_FINISH, '"finish_reason":"stop"')
            yield chunk

    return chat_completion_stream_generator


# -- which endpoint serves the request (the metrics' label) ---------------------------


def _hook_endpoints() -> None:
    import importlib

    # ``parsed``: the request is the one the parser is handed (``/v1/messages``
    # hands chat completions a request of its own).
    for module_name, owner, method, endpoint, parsed in (
        ("vllm.entrypoints.anthropic.serving", "AnthropicServingMessages",
         "create_messages", "messages", False),
        ("vllm.entrypoints.openai.chat_completion.serving", "OpenAIServingChat",
         "create_chat_completion", "chat_completions", True),
        ("vllm.entrypoints.openai.responses.serving", "OpenAIServingResponses",
         "create_responses", "responses", True),
    ):  # fmt: skip
        try:
            cls = getattr(importlib.import_module(module_name), owner)
        except (ImportError, AttributeError):
            continue
        _wrap(cls, method, _serving_as(endpoint, parsed))


def _serving_as(endpoint: str, parsed: bool) -> Callable[[Any], Any]:
    """The endpoint's handler, labelling the request it serves for the metrics.

    A request hook: it reads the request (``stream``, ``background``) where vLLM
    hands the endpoint it, before any output is read; the parsers read the request
    once an output, into ``request_facts.RequestFacts``, which takes these labels.
    """

    def make(original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        async def create(self, request, *args, **kwargs):
            stream = getattr(request, "stream", False)
            tally = metrics.serving(endpoint, stream, request if parsed else None)
            reply = await original(self, request, *args, **kwargs)
            # A background Responses stream replays what another task reads.
            background = getattr(request, "background", False)
            if tally is not None and inspect.isasyncgen(reply) and not background:
                return metrics.tallied(reply, tally)
            return reply

        return create

    make.__name__ = f"_serving_as_{endpoint}"
    return make


# -- a Responses stream an error ends (every version) ---------------------------------


def _hook_responses_failed() -> None:
    try:
        from vllm.entrypoints.openai.responses import serving
    except ImportError:
        return
    _wrap(
        serving.OpenAIServingResponses,
        "responses_stream_generator",
        stream_faults.ending_failed,
    )
    _wrap(
        serving.OpenAIServingResponses,
        "responses_background_stream_generator",
        stream_faults.ending_background_stream,
    )


# -- the wire spec's engine facts (both versions) -------------------------------------


def _hook_engine_facts() -> None:
    from vllm.entrypoints.openai.chat_completion import serving

    _wrap(
        serving.OpenAIServingChat,
        "chat_completion_stream_generator",
        _recording_engine_facts,
    )


def _recording_engine_facts(original: Callable[..., Any]) -> Callable[..., Any]:
    """The stream's engine outputs pass through ``_first_output_recorded``, which
    hands the first one's prompt and cached token counts to the wire spec's switch
    (``wire/facts.py``; nothing is kept when the switch is off)."""
    signature = inspect.signature(original)

    @functools.wraps(original)
    def chat_completion_stream_generator(self, *args, **kwargs):
        if engine_facts.CURRENT.get() is not None:
            bound = signature.bind(self, *args, **kwargs)
            outputs = bound.arguments.get("result_generator")
            if outputs is not None:
                bound.arguments["result_generator"] = _first_output_recorded(outputs)
                return original(*bound.args, **bound.kwargs)
        return original(self, *args, **kwargs)

    return chat_completion_stream_generator


async def _first_output_recorded(outputs: AsyncIterator[Any]) -> AsyncIterator[Any]:
    first = True
    async for output in outputs:
        if first:
            first = False
            prompt = len(output.prompt_token_ids or ())
            prompt += len(getattr(output, "encoder_prompt_token_ids", None) or ())
            engine_facts.record(prompt, getattr(output, "num_cached_tokens", None))
        yield output


# -- /v1/messages ---------------------------------------------------------------------


def _hook_messages() -> None:
    try:
        from vllm.entrypoints.anthropic import serving
    except ImportError:
        return
    _wrap(serving, "_to_anthropic_stop_reason", _stop_reason_of_cut_calls)
    _wrap(serving.AnthropicServingMessages, "messages_full_converter", _raw_arguments)
    _wrap(serving.AnthropicServingMessages, "message_stream_converter", _calls_whole)


def _calls_whole(original: Callable[..., Any]) -> Callable[..., Any]:
    """Each call's input in one piece, valid JSON (``messages_stream.py``)."""
    from vllm.entrypoints.openai.chat_completion.protocol import (
        ChatCompletionStreamResponse,
    )

    from vllm_k3_plugin.parsers import messages_stream

    parse = ChatCompletionStreamResponse.model_validate

    @functools.wraps(original)
    def message_stream_converter(self, generator):
        return original(self, messages_stream.calls_whole(generator, parse))

    return message_stream_converter


def _stop_reason_of_cut_calls(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def to_anthropic_stop_reason(finish_reason, stop_reason, tool_used, tool_complete):
        if tool_used and last_output_cut():
            if finish_reason == "tool_calls":
                finish_reason = "stop"
            tool_used = tool_complete = False
        return original(finish_reason, stop_reason, tool_used, tool_complete)

    return to_anthropic_stop_reason


def _raw_arguments(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def messages_full_converter(self, generator):
        for choice in getattr(generator, "choices", None) or []:
            for call in getattr(choice.message, "tool_calls", None) or []:
                call.function.arguments = json_object_text(
                    call.function.arguments, stream=False
                )
        return original(self, generator)

    return messages_full_converter
