"""OutputReader: one K3 output read into reasoning, content and tool calls, in order.

Sans-I/O: the reasoning reader splits the channels; the tools channel's markup goes
to one tool-call reader, whose prose (text outside calls) joins the content where it
stood, except in a tools channel that interrupted a thought, before its first call:
there a call opener not followed by an argument opened nothing, and the text stays
the thought's (rule 6). Events come out in the order the output wrote them. The
non-streaming read (``read_output``) is this reader fed the whole output once.

How the output ended decides ``finish_reason`` (``finish_reason``): ``tool_calls``
only when the model stopped itself and every call it made closed; a call cut off by
``max_tokens`` or by a stop inside it leaves what ended the output.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from vllm_k3_plugin.format import marked as m
from vllm_k3_plugin.format.channels import Channel
from vllm_k3_plugin.format.events import (
    CallOpened,
    Content,
    Dropped,
    OutputEvent,
    Prose,
    Reasoning,
    ToolMarkup,
)
from vllm_k3_plugin.format.reasoning import ReasoningReader, split_events
from vllm_k3_plugin.format.skipped_channel import ReplayPolicy
from vllm_k3_plugin.format.tools import ToolCall, ToolCallReader, collect_calls
from vllm_k3_plugin.format.xtml import GENERIC_GRAMMAR, TagGrammar


class OutputReading(NamedTuple):
    """A whole output read."""

    reasoning: str
    content: str
    calls: list[ToolCall]
    dropped: list[Dropped]


class OutputReader:
    """One request's reader. ``read_tools=False`` (no tool parser): the tools
    channel is text of the reply, its markup in place among the content.
    ``grammar``: what a tag may hold for the request (its declared tools)."""

    __slots__ = ("_reasoning", "_thought_prose", "_tools", "prose_chars")

    def __init__(
        self,
        start: Channel = Channel.THINK,
        policy: ReplayPolicy = ReplayPolicy.REPLAY,
        atoms: m.TextAtoms | m.IdAtoms | None = None,
        *,
        read_tools: bool = True,
        grammar: TagGrammar = GENERIC_GRAMMAR,
    ) -> None:
        self._reasoning = ReasoningReader(
            start=start, policy=policy, atoms=atoms, grammar=grammar
        )
        self._tools = ToolCallReader(m.ALREADY_MARKED, grammar) if read_tools else None
        self.prose_chars = 0
        """Characters of content read in a tools channel outside any call."""
        # In a tools channel that interrupted a thought, before its first call.
        self._thought_prose = False

    @property
    def reasoning_reader(self) -> ReasoningReader:
        return self._reasoning

    @property
    def held_chars(self) -> int:
        """Characters the model wrote that the client has not been sent and that
        may still reach it, but a typed argument value (``held_value_chars``)."""
        held = self._reasoning.held_chars
        return held + (self._tools.held_chars if self._tools is not None else 0)

    @property
    def held_value_chars(self) -> int:
        return self._tools.held_value_chars if self._tools is not None else 0

    def feed(self, text: str, ids: Sequence[int] | None = None) -> list[OutputEvent]:
        return self._route(self._reasoning.feed(text, ids))

    def finish(self, *, stopped: bool) -> list[OutputEvent]:
        events = self._route(self._reasoning.finish(stopped=stopped))
        if self._tools is not None:
            events += self._from_tools(self._tools.finish())
        return events

    def _route(self, events: list) -> list[OutputEvent]:
        if not events:
            return events
        out: list[OutputEvent] = []
        for event in events:
            if type(event) is not ToolMarkup:
                out.append(event)
            elif self._tools is None:
                out.append(Content(m.unmarked(event.text)))
            else:
                # A channel that interrupted a thought: its text is the thought's
                # from its opener on; a think exit: what the tool reader still held
                # before it (released by the exit's atom) was written in the thought.
                if event.thought:
                    self._thought_prose = True
                out += self._from_tools(self._tools.feed(event.text))
                if event.thought is False:
                    self._thought_prose = False
        return out

    def _from_tools(self, events: list) -> list[OutputEvent]:
        out: list[OutputEvent] = []
        for event in events:
            kind = type(event)
            if kind is Prose:
                if self._thought_prose:
                    out.append(Reasoning(event.text))
                else:
                    self.prose_chars += len(event.text)
                    out.append(Content(event.text))
            else:
                if kind is CallOpened:
                    self._thought_prose = False
                out.append(event)
        return out


class ContentGate:
    """Holds content while it is whitespace only.

    A reply that makes tool calls and says nothing but whitespace has no content
    (``None``, as OpenAI returns it). Streamed, that is only known at the end, so
    leading whitespace waits until words arrive or the output ends; both paths apply
    this one rule (and ``vllm-k3 replay``, which counts a reply as answered by it).
    """

    __slots__ = ("_held", "_open")

    def __init__(self) -> None:
        self._held: list[str] = []
        self._open = False

    def pass_through(self, text: str) -> str:
        if self._open or not text:
            return text
        if text.isspace():
            self._held.append(text)
            return ""
        self._open = True
        held, self._held = "".join(self._held), []
        return held + text

    def close(self, *, tool_calls_made: bool) -> str:
        held, self._held = "".join(self._held), []
        return "" if tool_calls_made else held


def collect_output(events: list[OutputEvent]) -> OutputReading:
    reasoning, content, calls = split_events(events)
    return OutputReading(
        reasoning,
        content,
        collect_calls(calls),
        [event for event in calls if type(event) is Dropped],
    )


def read_output(
    text: str,
    *,
    stopped: bool,
    start: Channel = Channel.THINK,
    policy: ReplayPolicy = ReplayPolicy.REPLAY,
    ids: Sequence[int] | None = None,
    atoms: m.TextAtoms | m.IdAtoms | None = None,
    read_tools: bool = True,
    grammar: TagGrammar = GENERIC_GRAMMAR,
) -> OutputReading:
    """The non-streaming read: the streaming reader fed the whole output once."""
    reader = OutputReader(start, policy, atoms, read_tools=read_tools, grammar=grammar)
    events = reader.feed(text, ids)
    events += reader.finish(stopped=stopped)
    return collect_output(events)


def finish_reason(engine_reason: str, calls_closed: int, calls_cut: int) -> str:
    """The finish reason a reply reports (before any forced-tool rule):
    ``tool_calls`` only when the model stopped itself with calls all closed."""
    if engine_reason == "stop" and calls_closed and not calls_cut:
        return "tool_calls"
    return engine_reason
