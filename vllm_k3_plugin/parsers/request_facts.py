"""``RequestFacts``: what the reading of one output needs from its request, read
once.

vLLM hands the parsers the request object with every call (each ``parse_delta``,
each ``parse``). The reading takes from it only a few facts: the tools it declares
(their names, and their argument keys, which may widen the tag grammar), the calls
its history made (the first call id's number), whether it wants tool calls and
reasoning returned, what can stop the output (stop token ids, stop strings, the
token budget), and the labels its output is counted under on ``/metrics``.
``read_request`` reads them into one frozen value when an output's reading begins
(``K3Parser``: its first delta, or the whole output; ``K3ToolParser`` driven bare:
likewise); the readers and counters take that value, and nothing else on the
reading path looks at the request. The request hooks (``request_hooks``,
``k31_efforts``, the endpoint hook in ``serving_hooks``) read the request: that is
their job.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

from vllm_k3_plugin.format import vocab
from vllm_k3_plugin.format.xtml import TagGrammar, grammar_for
from vllm_k3_plugin.parsers import metrics


class DeclaredTool(NamedTuple):
    """A tool the request declares with a name."""

    name: str
    keys: tuple[str, ...]
    """The argument keys its parameters' ``properties`` name."""


@dataclass(frozen=True, slots=True)
class RequestFacts:
    """What one output's reading needs from its request (``read_request``)."""

    tools: tuple[DeclaredTool, ...]
    """The tools the request declares with a name (chat completions' ``function``
    objects, or Responses' flat tools), in order."""
    tool_names: frozenset[str] | None
    """Their names; ``None`` where the request declares no tools (then no call is
    to an undeclared tool)."""
    grammar: TagGrammar
    """What a tag may hold: the generic grammar, widened by a declared tool name or
    argument key it refuses."""
    history_calls: int
    """Calls the conversation made before this output: tool-call ids number on
    from here (``functions.NAME:N``)."""
    tools_wanted: bool
    """Calls are returned (``tool_choice`` is not ``"none"``)."""
    reasoning_wanted: bool
    """Reasoning is returned (``include_reasoning`` is not false)."""
    stop_ids: frozenset[int]
    """Ids that end the output when the model writes them: the model's stop
    tokens, the tokenizer's EOS and the request's ``stop_token_ids``."""
    stop_strings: bool
    """The request sets stop strings (``stop``)."""
    budget: int | None
    """The request's output token budget, read only where it sets stop strings
    (``model_stopped`` tells a stop string from a length cut by it)."""
    max_model_len: int | None
    """The model's length limit (prompt and output), from the model config."""
    labels: tuple[str, str] | None
    """``(endpoint, stream)``, the output's labels on ``/metrics``; ``None`` where
    the output is not counted (a tool parser driven bare)."""
    tally: metrics.StreamTally | None
    """A streamed request's tally of the outputs that began and ended (``None``
    for a whole reply, or where not counted)."""


def read_request(
    request: Any,
    *,
    eos_token_id: Any = None,
    max_model_len: int | None = None,
    history_calls: int | None = None,
    counted: bool = True,
) -> RequestFacts:
    """The facts of ``request``, read once, when an output's reading begins.

    ``history_calls``: the count the server gave (``set_history_tool_call_count``);
    unset, it is read from the request's history. ``counted``: the output will be
    counted on ``/metrics``: its labels are looked up (the lookup consumes the
    request's entry where it has one output).
    """
    tools = _declared(request)
    stop_strings = bool(getattr(request, "stop", None))
    served = (
        metrics.serving_of(id(request), outputs=getattr(request, "n", None) or 1)
        if counted
        else None
    )
    return RequestFacts(
        tools=tools,
        tool_names=(
            frozenset(tool.name for tool in tools)
            if getattr(request, "tools", None)
            else None
        ),
        grammar=grammar_for(
            (tool.name for tool in tools), (key for tool in tools for key in tool.keys)
        ),
        history_calls=(
            _history_call_count(request) if history_calls is None else history_calls
        ),
        tools_wanted=getattr(request, "tool_choice", None) != "none",
        reasoning_wanted=getattr(request, "include_reasoning", True) is not False,
        stop_ids=_stop_ids(eos_token_id, getattr(request, "stop_token_ids", None)),
        stop_strings=stop_strings,
        # Read only where needed, as before: vLLM warns when ``max_tokens`` is read.
        budget=_token_budget(request) if stop_strings else None,
        max_model_len=max_model_len,
        labels=served.labels if served else None,
        tally=served.tally if served else None,
    )


def _declared(request: Any) -> tuple[DeclaredTool, ...]:
    declared = []
    for tool in getattr(request, "tools", None) or ():
        function = getattr(tool, "function", None)
        name = getattr(function, "name", None) or getattr(tool, "name", None)
        if isinstance(name, str):
            parameters = getattr(function, "parameters", None)
            if parameters is None:
                parameters = getattr(tool, "parameters", None)
            properties = (
                parameters.get("properties") if isinstance(parameters, dict) else None
            )
            keys = ()
            if isinstance(properties, dict):
                keys = tuple(key for key in properties if isinstance(key, str))
            declared.append(DeclaredTool(name, keys))
    return tuple(declared)


def _history_call_count(request: Any) -> int:
    """Calls already made in the conversation the request carries."""
    try:
        from vllm.parser.utils import count_history_tool_calls
    except ImportError:  # a vLLM without the helper: number from 0
        return 0
    try:
        return count_history_tool_calls(request)
    except (AttributeError, TypeError):
        return 0


def _stop_ids(eos_token_id: Any, stop_token_ids: Any) -> frozenset[int]:
    ids = set(vocab.MODEL_STOP_IDS)
    if isinstance(eos_token_id, int):
        ids.add(eos_token_id)
    ids.update(stop_token_ids or ())
    return frozenset(ids)


def _token_budget(request: Any) -> int | None:
    for name in ("max_completion_tokens", "max_tokens", "max_output_tokens"):
        value = getattr(request, name, None)
        if isinstance(value, int):
            return value
    return None
