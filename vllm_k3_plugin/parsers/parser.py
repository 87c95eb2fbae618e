"""``K3Parser``: the combined parser the API server gets for ``kimi_k3``.

Every endpoint (chat completions, responses, and ``/v1/messages``, which runs through
chat completions) drives one ``Parser`` per request: ``parse`` for a whole output,
``parse_delta`` once per engine step when streaming. Both feed one ``OutputReader``
the output's text and token ids (structure is read from the ids); ``parse`` feeds it
the whole output at once, so the two agree by construction.

Why not vLLM's own ``KimiK3Parser`` around our reasoning parser: its
``DelegatingParser.parse_delta`` rebuilds the whole text and id list every step and the
reasoning parser API never learns how the output ended (rule 5 needs it). Here each
step costs O(delta), and ``finished`` plus the last token id decide ``stopped``.

The reader reads the tool calls when the tool parser is ours (``--tool-call-parser
kimi_k3``); with any other configured tool parser, the tools channel goes to it, as
text, through its own API. A call the end of the output cut off is in the reply on
both paths, as it streamed.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from vllm.entrypoints.generate.base.protocol import DeltaMessage, FunctionCall
from vllm.parser.abstract_parser import DelegatingParser

from vllm_k3_plugin.envs import replay_policy
from vllm_k3_plugin.format import marked
from vllm_k3_plugin.format.channel_ids import ReasoningCount
from vllm_k3_plugin.format.channels import Channel
from vllm_k3_plugin.format.events import (
    CallCut,
    Content,
    Reasoning,
)
from vllm_k3_plugin.format.output import ContentGate, OutputReader, collect_output
from vllm_k3_plugin.format.reasoning import (
    ReasoningReader,
    collect,
    split_events,
)
from vllm_k3_plugin.parsers.deltas import delta_message
from vllm_k3_plugin.parsers.metrics import (
    OutputCounts,
    count_output,
    ending,
)
from vllm_k3_plugin.parsers.reasoning_parser import K3ReasoningParser
from vllm_k3_plugin.parsers.request_facts import RequestFacts, read_request
from vllm_k3_plugin.parsers.request_state import (
    model_stopped,
    start_channel,
    thinking_requested,
)
from vllm_k3_plugin.parsers.serving_hooks import record_output
from vllm_k3_plugin.parsers.tool_parser import (
    K3ToolParser,
    ToolCallDeltas,
    function_calls,
)


def _count(
    reader,
    counts: OutputCounts,
    facts: RequestFacts,
    stopped: bool,
    *,
    content,
    reasoning,
) -> None:
    """``vllm_k3_*`` metrics for one finished output (``metrics.py``)."""
    reasoning_reader = (
        reader.reasoning_reader if isinstance(reader, OutputReader) else reader
    )
    count_output(
        counts,
        facts.labels,
        ended=ending(
            stopped=stopped,
            calls=counts.calls,
            replayed=reasoning_reader.replayed,
            content=bool(content),
            reasoning=bool(reasoning),
        ),
        markup_dropped=reasoning_reader.markup_dropped,
        decided_after=reasoning_reader.decided_after,
    )


def _undeclared(facts: RequestFacts, calls: list[FunctionCall] | None) -> int:
    declared = facts.tool_names
    if declared is None or not calls:
        return 0
    return sum(call.name not in declared for call in calls)


class _Stream:
    """Per-request streaming state; nothing here grows with the reasoning."""

    __slots__ = (
        "calls",
        "content_gate",
        "content_seen",
        "counts",
        "facts",
        "last_id",
        "other_tools",
        "output_len",
        "prompt_len",
        "reader",
        "reasoning_seen",
        "tool_text",
    )

    def __init__(
        self,
        facts: RequestFacts,
        reader: OutputReader | ReasoningReader,
        prompt_len: int,
    ) -> None:
        self.facts = facts
        self.reader = reader
        self.prompt_len = prompt_len
        self.output_len = 0
        self.last_id: int | None = None
        self.content_gate = ContentGate()
        self.calls: ToolCallDeltas | None = None
        # Another tool parser's streaming API wants the tools channel so far, whole.
        self.tool_text = ""
        self.other_tools = False
        self.counts = OutputCounts()
        self.content_seen = False
        self.reasoning_seen = False


class K3Parser(DelegatingParser):
    """Reasoning, content and tool calls of a Kimi-K3 output.

    Its methods take vLLM's ``request``; each output's reading reads it once, into
    ``RequestFacts`` (``_read_request``: at the first delta, or in ``parse``), and
    passes those down. Another configured tool parser gets the request itself,
    through its own API.
    """

    def __init__(
        self,
        tokenizer: Any,
        tools: list[Any] | None = None,
        *args: Any,
        model_config: Any = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(tokenizer, tools, *args, model_config=model_config, **kwargs)
        if not isinstance(self._reasoning_parser, K3ReasoningParser):
            raise TypeError("K3Parser reads with the kimi_k3 reasoning parser")
        self._thinking = thinking_requested(kwargs.get("chat_template_kwargs"))
        self._policy = replay_policy()
        self._max_model_len: int | None = getattr(model_config, "max_model_len", None)
        self._prompt_ids: Sequence[int] | None = None
        self._stream: _Stream | None = None
        self._counted = ReasoningCount()
        self._history_calls: int | None = None
        self.calls_cut = False
        """Whether the last output read ended inside a tool call."""

    # -- shared -----------------------------------------------------------------------

    @property
    def k3_reasoning(self) -> K3ReasoningParser:
        return self._reasoning_parser  # type: ignore[return-value]

    @property
    def _reads_tools(self) -> bool:
        """Whether the reader reads the calls (our tool parser), not another one."""
        return isinstance(self._tool_parser, K3ToolParser)

    def set_prompt_token_ids(self, prompt_token_ids: Sequence[int]) -> None:
        self._prompt_ids = prompt_token_ids
        self.k3_reasoning.set_prompt_token_ids(prompt_token_ids)

    def set_history_tool_call_count(self, count: int) -> None:
        """The calls the conversation made before this request's output.

        vLLM 0.33's scale-out generate server parses a request that carries no
        messages and says the count here; 0.32 never calls it. Unset, the count is
        read from the request's history.
        """
        self._history_calls = count

    def _read_request(self, request: Any) -> RequestFacts:
        """The facts of the output's request: read once an output."""
        return read_request(
            request,
            eos_token_id=getattr(self.model_tokenizer, "eos_token_id", None),
            max_model_len=self._max_model_len,
            history_calls=self._history_calls,
        )

    def _start(self, prompt_ids: Sequence[int] | None) -> Channel:
        return start_channel(prompt_ids, self.k3_reasoning.decode, self._thinking)

    def _atoms(self, ids: Sequence[int] | None) -> marked.TextAtoms | marked.IdAtoms:
        """Structure from the output's ids; from text alone where a caller has none
        (``None``: a stream, whose steps always carry their ids, even an empty list)."""
        known = ids is None or bool(ids)
        return marked.atoms_for(known, self.k3_reasoning.atom_tokens)

    def _reader(
        self,
        facts: RequestFacts,
        prompt_ids: Sequence[int] | None,
        ids: Sequence[int] | None,
    ) -> OutputReader | ReasoningReader:
        start, atoms = self._start(prompt_ids), self._atoms(ids)
        grammar = facts.grammar
        if self._tool_parser is None or self._reads_tools:
            return OutputReader(
                start,
                self._policy,
                atoms,
                read_tools=self._tool_parser is not None,
                grammar=grammar,
            )
        return ReasoningReader(
            start=start, policy=self._policy, atoms=atoms, grammar=grammar
        )

    def count_reasoning_tokens(self, token_ids: Sequence[int]) -> int:
        starts_in_think = self._start(self._prompt_ids) is Channel.THINK
        return self._counted.update(
            token_ids, self.k3_reasoning.decode, starts_in_think=starts_in_think
        )

    # -- whole output -----------------------------------------------------------------

    def parse(
        self,
        model_output: str,
        request: Any,
        enable_auto_tools: bool = False,
        model_output_token_ids: Sequence[int] = (),
    ) -> tuple[str | None, str | None, list[FunctionCall] | None]:
        # ``enable_auto_tools`` is not consulted: a tool parser exists only when the
        # server enabled auto tool choice, and streaming never gets the flag.
        ids = model_output_token_ids
        facts = self._read_request(request)
        reader = self._reader(facts, self._prompt_ids, ids)
        stopped = model_stopped(
            facts,
            last_id=ids[-1] if len(ids) else None,
            output_len=len(ids),
            prompt_len=len(self._prompt_ids or ()),
        )
        events = reader.feed(model_output, ids) + reader.finish(stopped=stopped)
        self.calls_cut = False
        if isinstance(reader, OutputReader):
            reading = collect_output(events)
            reasoning, content = reading.reasoning, reading.content
            tool_calls = self._whole_calls(reading, facts)
        else:
            reading = collect(events)
            reasoning, content = reading.reasoning, reading.content
            tool_calls = self._other_tool_calls(reading.tool_markup, facts, request)
        record_output(calls_cut=self.calls_cut, stopped=stopped)
        counts = OutputCounts()
        if facts.tools_wanted:  # calls read but not returned are not counted
            counts.events(events)
        counts.undeclared = _undeclared(facts, tool_calls)
        gate = ContentGate()
        content = gate.pass_through(content) + gate.close(
            tool_calls_made=bool(tool_calls)
        )
        _count(reader, counts, facts, stopped, content=content, reasoning=reasoning)
        if not facts.reasoning_wanted:
            reasoning = ""
        return reasoning or None, content or None, tool_calls

    def _whole_calls(
        self, reading: Any, facts: RequestFacts
    ) -> list[FunctionCall] | None:
        if not reading.calls or not facts.tools_wanted:
            return None
        self.calls_cut = not all(call.complete for call in reading.calls)
        return function_calls(reading.calls, reading.dropped, facts)

    def _other_tool_calls(
        self, markup: str, facts: RequestFacts, request: Any
    ) -> list[FunctionCall] | None:
        """The tools channel read by another configured tool parser (handed the
        request: its API reads it)."""
        if not markup or not facts.tools_wanted:
            return None
        info = self.extract_tool_calls(marked.unmarked(markup), request)
        if not info.tools_called:
            return None
        return [
            FunctionCall(
                id=call.id, name=call.function.name, arguments=call.function.arguments
            )
            for call in info.tool_calls
        ]

    # -- streaming --------------------------------------------------------------------

    def parse_delta(
        self,
        delta_text: str,
        delta_token_ids: list[int],
        request: Any,
        prompt_token_ids: list[int] | None = None,
        *,
        finished: bool,
    ) -> DeltaMessage | None:
        stream = self._stream
        if stream is None:
            prompt_ids = prompt_token_ids or self._prompt_ids
            if prompt_token_ids is not None:
                self._prompt_ids = prompt_token_ids
            facts = self._read_request(request)
            reader = self._reader(facts, prompt_ids, None)
            stream = self._stream = _Stream(facts, reader, len(prompt_ids or ()))
            if facts.tally is not None:
                facts.tally.began += 1

        events = (
            stream.reader.feed(delta_text, delta_token_ids)
            if delta_text or delta_token_ids
            else []
        )
        if delta_token_ids:
            stream.output_len += len(delta_token_ids)
            stream.last_id = delta_token_ids[-1]
        if finished:
            stopped = model_stopped(
                stream.facts,
                last_id=stream.last_id,
                output_len=stream.output_len,
                prompt_len=stream.prompt_len,
            )
            events += stream.reader.finish(stopped=stopped)
        if isinstance(stream.reader, OutputReader):
            reasoning, content, tool_calls = self._read_events(stream, events)
        else:
            reading = collect(events)
            reasoning, content = reading.reasoning, reading.content
            tool_calls = self._other_tool_deltas(stream, reading.tool_markup, request)
        calls_made = stream.calls is not None and stream.calls.calls_made
        content = stream.content_gate.pass_through(content)
        if finished:
            record_output(calls_cut=self.calls_cut, stopped=stopped)
            content += stream.content_gate.close(
                tool_calls_made=calls_made or stream.other_tools
            )
            if stream.calls is not None:
                stream.counts.undeclared = stream.calls.undeclared
            _count(
                stream.reader,
                stream.counts,
                stream.facts,
                stopped,
                content=stream.content_seen or content,
                reasoning=stream.reasoning_seen or reasoning,
            )
            if stream.facts.tally is not None:
                stream.facts.tally.ended += 1
        if content:
            stream.content_seen = True
        if reasoning:
            stream.reasoning_seen = True
        if not stream.facts.reasoning_wanted:
            reasoning = ""
        return delta_message(reasoning, content, tool_calls)

    def _read_events(
        self, stream: _Stream, events: list[Any]
    ) -> tuple[str, str, list[Any]]:
        if len(events) == 1:
            # The usual streaming step: one piece of one kind.
            (event,) = events
            kind = type(event)
            if kind is Reasoning:
                return event.text, "", []
            if kind is Content:
                return "", event.text, []
        reasoning, content, calls = split_events(events)
        tool_calls: list[Any] = []
        if calls and stream.facts.tools_wanted:
            stream.counts.events(calls)
            if stream.calls is None:
                stream.calls = ToolCallDeltas(stream.facts)
            tool_calls = stream.calls.deltas(calls)
            if any(type(event) is CallCut for event in calls):
                self.calls_cut = True
        return reasoning, content, tool_calls

    def _other_tool_deltas(
        self, stream: _Stream, markup: str, request: Any
    ) -> list[Any]:
        """The tools channel so far, to another configured tool parser (handed the
        request: its API reads it)."""
        if not markup or not stream.facts.tools_wanted:
            return []
        previous = stream.tool_text
        stream.tool_text = current = previous + marked.unmarked(markup)
        delta = self.extract_tool_calls_streaming(
            previous_text=previous,
            current_text=current,
            delta_text=current[len(previous) :],
            previous_token_ids=(),
            current_token_ids=(),
            delta_token_ids=(),
            request=request,
        )
        if delta is None or not delta.tool_calls:
            return []
        stream.other_tools = True
        return list(delta.tool_calls)
