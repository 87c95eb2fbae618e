"""``kimi_k3`` as a vLLM ``ToolParser``, reading with ``ToolCallReader``.

``K3Parser`` (our combined parser) reads the tool calls itself, with one
``OutputReader`` per request; this class is what the registry returns for
``--tool-call-parser kimi_k3``, so that the combined parser is built with it, and it
serves callers that drive a bare tool parser.

Request handling (``adjust_request``: the markers must reach the parser as text, the
XTML structural tag for ``required`` and named tool choice) is vLLM's own
``KimiK3ToolParser``'s, inherited: it matches what the engine generates.

Decisions shared with ``K3Parser``:

- Tool-call ids are ``functions.NAME:N``, N counting every call of the conversation
  from 0 (calls in the request's history first): the form vLLM gives Kimi models,
  unique within the conversation, the same streamed and not, and what K3's chat
  renderer matches a tool result's ``tool_call_id`` against in the next turn.
- A call to a tool the request did not declare is returned as the model wrote it
  (the client can answer it with an error result) and logged once per request.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from vllm.entrypoints.generate.base.protocol import (
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    ExtractedToolCallInformation,
    FunctionCall,
    ToolCall,
)
from vllm.logger import init_logger
from vllm.tool_parsers.kimi_k3_tool_parser import KimiK3ToolParser

from vllm_k3_plugin.format.channels import Channel
from vllm_k3_plugin.format.events import (
    ArgumentsDelta,
    CallCut,
    CallOpened,
    Content,
    Dropped,
    Reasoning,
)
from vllm_k3_plugin.format.output import (
    OutputReader,
    collect_output,
)
from vllm_k3_plugin.format.tools import (
    ToolCall as ReadCall,
)
from vllm_k3_plugin.parsers.deltas import delta_message
from vllm_k3_plugin.parsers.request_facts import RequestFacts, read_request

logger = init_logger("vllm.k3_plugin.tool_parser")


def tool_call_id(name: str, number: int) -> str:
    return f"functions.{name}:{number}"


class UndeclaredTools:
    """Warns, once per request, of a call to a tool the request does not declare."""

    __slots__ = ("_declared", "_warned")

    def __init__(self, facts: RequestFacts) -> None:
        self._declared = facts.tool_names
        self._warned = False

    def check(self, name: str) -> bool:
        """Whether ``name`` is undeclared (warned of once)."""
        if self._declared is None or name in self._declared:
            return False
        if self._warned:
            return True
        self._warned = True
        logger.warning(
            "kimi_k3: the model called %r, which the request does not declare; "
            "returning the call as written",
            name,
        )
        return True


class ToolCallDeltas:
    """One request's tool-call events as vLLM deltas; shared by ``K3Parser`` and the
    bare API."""

    __slots__ = ("_first_number", "_undeclared", "calls_made", "undeclared")

    def __init__(self, facts: RequestFacts) -> None:
        # Ids number on from the conversation's calls before this output.
        self._first_number = facts.history_calls
        self._undeclared = UndeclaredTools(facts)
        self.calls_made = False
        """Whether a call was sent (closed or cut: the whole read lists both)."""
        self.undeclared = 0
        """Calls to tools the request does not declare."""

    def deltas(self, events: list[Any]) -> list[DeltaToolCall]:
        # Built with ``model_construct``: valid by construction, and this runs for
        # every token of a streamed argument.
        deltas: list[DeltaToolCall] = []
        for event in events:
            kind = type(event)
            if kind is CallOpened:
                self.calls_made = True
                self.undeclared += self._undeclared.check(event.name)
                deltas.append(
                    DeltaToolCall.model_construct(
                        index=event.index,
                        id=tool_call_id(event.name, self._first_number + event.index),
                        type="function",
                        function=DeltaFunctionCall.model_construct(
                            name=event.name, arguments=""
                        ),
                    )
                )
            elif kind is ArgumentsDelta:
                last = deltas[-1] if deltas else None
                if last is not None and last.index == event.index:
                    function = last.function
                    function.arguments = (function.arguments or "") + event.text
                else:
                    deltas.append(
                        DeltaToolCall.model_construct(
                            index=event.index,
                            function=DeltaFunctionCall.model_construct(
                                arguments=event.text
                            ),
                        )
                    )
            elif kind is CallCut:
                log_cut(event.index)
            elif kind is Dropped:
                log_dropped(event)
        return deltas


def log_dropped(event: Dropped) -> None:
    where = "" if event.index is None else f" (call {event.index})"
    logger.info("kimi_k3 tool calls: dropped %s%s", event.reason, where)


def log_cut(index: int) -> None:
    logger.info(
        "kimi_k3 tool calls: call %d was cut off by the end of the output; its "
        "arguments are as far as they arrived",
        index,
    )


def function_calls(
    calls: list[ReadCall], dropped: list[Dropped], facts: RequestFacts
) -> list[FunctionCall]:
    """The calls of a whole output, with the ids the stream gives (numbered on from
    ``facts.history_calls``, as ``ToolCallDeltas`` numbers them); a cut call is
    among them, as it streamed."""
    first_number = facts.history_calls
    for event in dropped:
        log_dropped(event)
    undeclared = UndeclaredTools(facts)
    for call in calls:
        undeclared.check(call.name)
        if not call.complete:
            log_cut(call.index)
    return [
        FunctionCall(
            id=tool_call_id(call.name, first_number + call.index),
            name=call.name,
            arguments=call.arguments,
        )
        for call in calls
    ]


class K3ToolParser(KimiK3ToolParser):
    """The Kimi-K3 tools channel, read by ``ToolCallReader``.

    Driven bare (no ``kimi_k3`` reasoning parser in front), the text it gets is read
    from the response channel, from text alone (the bare whole-output API gets no
    token ids, and both paths must read alike): framing is stripped, a think channel
    the model opens itself is content (once: the bare API never says how the output
    ended, so nothing is replayed), and the tools channel becomes calls.
    """

    def __init__(self, tokenizer: Any, tools: list[Any] | None = None) -> None:
        super().__init__(tokenizer, tools)
        self._bare_reader: OutputReader | None = None
        self._bare_calls: ToolCallDeltas | None = None

    def extract_tool_calls(
        self, model_output: str, request: Any
    ) -> ExtractedToolCallInformation:
        # Read as the bare streaming API reads (it never learns how the output
        # ended, nor has the whole read its ids): text alone, a think channel's text
        # once, as it would stream live.
        facts = read_request(request, counted=False)
        reader = OutputReader(start=Channel.RESPONSE, grammar=facts.grammar)
        reading = collect_output(
            reader.feed(model_output) + reader.finish(stopped=False)
        )
        content = (reading.reasoning + reading.content) or None
        calls = function_calls(reading.calls, reading.dropped, facts)
        return ExtractedToolCallInformation(
            tools_called=bool(calls),
            tool_calls=[
                ToolCall(
                    id=call.id,
                    function=FunctionCall(name=call.name, arguments=call.arguments),
                )
                for call in calls
            ],
            content=content,
        )

    def extract_tool_calls_streaming(
        self,
        previous_text: str,
        current_text: str,
        delta_text: str,
        previous_token_ids: Sequence[int],
        current_token_ids: Sequence[int],
        delta_token_ids: Sequence[int],
        request: Any,
    ) -> DeltaMessage | None:
        # The bare API never says the output ended: a marker cut off at the very end
        # stays held (it is never content either way).
        if self._bare_reader is None:
            facts = read_request(request, counted=False)
            self._bare_reader = OutputReader(
                start=Channel.RESPONSE, grammar=facts.grammar
            )
            self._bare_calls = ToolCallDeltas(facts)
        events = self._bare_reader.feed(delta_text)
        content = "".join(
            event.text for event in events if type(event) in (Reasoning, Content)
        )
        calls = self._bare_calls.deltas(events)
        return delta_message(content=content, tool_calls=calls)
