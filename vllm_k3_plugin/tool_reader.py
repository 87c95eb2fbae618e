"""ToolCallReader: the calls of a K3 tools channel, streamed as they arrive (rule 8).

Sans-I/O: feed the tools channel's raw text (what ``ReasoningReader`` hands over as
``ToolMarkup``) in any chunking, get ``CallOpened`` / ``ArgumentsDelta`` /
``CallClosed`` / ``Dropped`` events. The non-streaming read is this reader fed the
whole channel, so a call's joined ``ArgumentsDelta`` texts are byte-identical to its
non-streaming ``arguments`` by construction.

Reading rules:

- A call opens at ``<|open|>call tool="NAME" ...<|sep|>``: ``CallOpened`` goes out at
  once. A call without a name is dropped (one ``Dropped`` event), its body skipped.
  The ``index`` attribute is not trusted: calls are numbered by arrival, from 0.
- Arguments are one JSON object written as the elements arrive, in the layout of
  ``json.dumps(obj, ensure_ascii=False)``. A ``string`` value (also an argument with no
  ``type``) is raw text and streams JSON-escaped while it arrives; any other type is
  JSON, sent re-serialized when its element closes, or as a JSON string of the raw
  text when it is not valid JSON. A repeated key is written again (a JSON reader
  keeps the last). A ``json`` block is the arguments text itself, streamed verbatim.
  An argument with no ``key``, or an element mixing the two forms, is dropped.
- A value ends only at its own closer; the call closer, ``<|close|>tools<|sep|>`` and
  ``<|close|>message<|sep|>`` also end it (the model forgot the closer). Every other
  marker inside a value is text of the value.
- A call closes at ``<|close|>call<|sep|>``, at ``<|close|>call`` without the
  separator, at the next call's opener, or at the end of the channel or message.
- A call still open when the output ends is cut off: no ``CallClosed``; ``finish``
  reports it ``Dropped``. Streamed, its name and arguments so far were already sent.
- Text between elements, unknown elements and stray closers are framing: dropped.

Memory: only a typed value is held (until its closer), and an opener's attribute
text (at most ``MAX_TAG_CHARS``).
"""

from __future__ import annotations

import enum
import json
from typing import NamedTuple

from vllm_k3_plugin import vocab
from vllm_k3_plugin.scanner import MarkerScanner
from vllm_k3_plugin.xtml import parse_tag

MAX_TAG_CHARS = 16_384


class CallOpened(NamedTuple):
    index: int
    """Position of the call in the output, from 0."""
    name: str


class ArgumentsDelta(NamedTuple):
    index: int
    text: str


class CallClosed(NamedTuple):
    index: int


class Dropped(NamedTuple):
    """Markup read as no call, or a call cut off; for the adapter to log."""

    index: int | None
    """The call it belonged to; ``None`` when no call was opened."""
    reason: str


ToolEvent = CallOpened | ArgumentsDelta | CallClosed | Dropped


class ToolCall(NamedTuple):
    index: int
    name: str
    arguments: str


class _State(enum.Enum):
    OUTSIDE = "outside"
    CALL = "call"
    SKIP_CALL = "skip-call"
    VALUE = "value"
    SKIP_VALUE = "skip-value"
    DONE = "done"


class _Value(enum.Enum):
    STRING = "string"
    TYPED = "typed"
    RAW = "raw"


class _Args(enum.Enum):
    NONE = "none"
    ELEMENTS = "elements"
    JSON_BLOCK = "json"


# Closers of enclosing elements: they end an open value and call.
_BOUNDARIES = frozenset({vocab.TOOLS_END, vocab.MESSAGE_END, vocab.END_OF_MSG})
# The stop token never reaches the text as a token (vLLM drops it), so inside a value
# its spelling is the value's own text.
_VALUE_BREAKS = frozenset({vocab.TOOLS_END, vocab.MESSAGE_END, vocab.CALL_END})
_ELEMENT_ENDS = {vocab.ARGUMENT: vocab.ARGUMENT_END, vocab.JSON_BLOCK: vocab.JSON_END}


def _json_text(value: object) -> str:
    return json.dumps(value, ensure_ascii=False)


def _reject_constant(name: str) -> object:
    raise ValueError(f"{name} is not JSON")


def typed_value_json(raw: str) -> str:
    """A non-string argument's JSON text: the value re-serialized, or the raw text as
    a JSON string when it is not valid JSON (including numbers that overflow to
    infinity). Escaped lone surrogates stay escaped, so the text encodes as UTF-8."""
    try:
        value = json.loads(raw, parse_constant=_reject_constant)
        text = json.dumps(value, ensure_ascii=False, allow_nan=False)
    except (ValueError, RecursionError):
        return _json_text(raw)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return json.dumps(value, allow_nan=False)
    return text


class ToolCallReader:
    """One request's tool-call reader."""

    __slots__ = (
        "_args",
        "_args_started",
        "_call",
        "_close_pending",
        "_count",
        "_events",
        "_run",
        "_scanner",
        "_skip_return",
        "_state",
        "_tag",
        "_tag_chars",
        "_typed",
        "_value",
        "_value_end",
    )

    def __init__(self) -> None:
        self._scanner = MarkerScanner(vocab.TOOL_MARKERS)
        self._state = _State.OUTSIDE
        self._count = 0
        self._call: int | None = None
        # ``<|close|>call`` without its separator: a call closer unless a name goes
        # on (``<|close|>call_meta<|sep|>`` closes an unknown element).
        self._close_pending = False
        self._args = _Args.NONE
        self._args_started = False
        self._value = _Value.STRING
        self._value_end = vocab.ARGUMENT_END
        self._skip_return = _State.CALL
        self._typed: list[str] = []
        self._tag: list[str] | None = None
        self._tag_chars = 0
        self._events: list[ToolEvent] = []
        self._run: list[str] = []

    def feed(self, text: str) -> list[ToolEvent]:
        if self._state is _State.DONE:
            raise RuntimeError("feed() after finish()")
        self._events = events = []
        parts = self._scanner.feed_parts(text)
        if len(parts) == 1:
            self._on_text(parts[0])
        else:
            for index, piece in enumerate(parts):
                if index & 1:
                    self._on_marker(piece)
                elif piece:
                    self._on_text(piece)
        self._flush()
        self._events = []  # the caller's now: hold no reference to its text
        return events

    def finish(self) -> list[ToolEvent]:
        """End of the output: a call still open is cut off."""
        if self._state is _State.DONE:
            return []
        self._events = events = []
        self._scanner.finish()
        if self._close_pending:
            self._close_pending = False
            self._end_call()
        self._flush()
        if self._call is not None:
            events.append(Dropped(self._call, "cut off before its closer"))
        self._call = None
        self._events = []
        self._state = _State.DONE
        return events

    # -- events -------------------------------------------------------------------

    def _emit(self, text: str) -> None:
        self._run.append(text)

    def _flush(self) -> None:
        if self._run:
            self._events.append(ArgumentsDelta(self._call, "".join(self._run)))
            self._run = []

    def _event(self, event: ToolEvent) -> None:
        self._flush()
        self._events.append(event)

    def _drop(self, reason: str) -> None:
        self._event(Dropped(self._call, reason))

    # -- dispatch -----------------------------------------------------------------

    def _on_text(self, text: str) -> None:
        if not text:
            return
        if self._close_pending:
            self._close_pending = False
            if text[0].isalnum() or text[0] in "_-.":
                return  # the closer of an unknown element: framing
            self._end_call()
        if self._tag is not None:
            if self._tag_chars <= MAX_TAG_CHARS:
                self._tag.append(text)
            self._tag_chars += len(text)
        elif self._state is _State.VALUE:
            self._value_text(text)
        # Text anywhere else is framing between elements, or a skipped value.

    def _on_marker(self, marker: str) -> None:
        if self._close_pending:
            self._close_pending = False
            self._end_call()
        if self._tag is not None:
            tag, self._tag = self._tag, None
            if marker == vocab.SEP:
                self._on_opener("".join(tag))
                return
            self._drop("an opener without its separator")
        state = self._state
        if state is _State.VALUE or state is _State.SKIP_VALUE:
            if marker == self._value_end:
                self._end_value()
                return
            if marker not in _VALUE_BREAKS:
                if state is _State.VALUE:
                    self._value_text(marker)
                return
            self._end_value()
            state = self._state
        if marker == vocab.OPEN:
            self._tag = []
            self._tag_chars = 0
        elif marker == vocab.CALL_END_UNSEPARATED:
            self._close_pending = True
        elif marker == vocab.CALL_END or marker in _BOUNDARIES:
            self._end_call()
        # Other closers, separators and the channel opener are framing here.

    def _on_opener(self, tag: str) -> None:
        if self._tag_chars > MAX_TAG_CHARS:
            self._drop(f"an opener longer than {MAX_TAG_CHARS} characters")
            if tag.split(None, 1)[:1] == [vocab.CALL]:
                # A new call all the same: the open one ends; this one is skipped.
                self._end_call()
                self._state = _State.SKIP_CALL
            return
        name, attributes = parse_tag(tag)
        state = self._state
        if name == vocab.CALL:
            self._end_call()
            self._open_call(attributes.get("tool", ""))
        elif name in _ELEMENT_ENDS and state is _State.CALL:
            if name == vocab.ARGUMENT:
                self._open_argument(attributes)
            else:
                self._open_json_block()
        elif name in _ELEMENT_ENDS and state is _State.SKIP_CALL:
            self._skip_value(_ELEMENT_ENDS[name])
        else:
            self._drop(f"an unknown element {name[:64]!r}")

    # -- calls --------------------------------------------------------------------

    def _open_call(self, name: str) -> None:
        if not name:
            self._drop("a call without a name")
            self._state = _State.SKIP_CALL
            return
        self._call = index = self._count
        self._count += 1
        self._args = _Args.NONE
        self._args_started = False
        self._state = _State.CALL
        self._event(CallOpened(index, name))

    def _end_call(self) -> None:
        if self._call is None:
            self._state = _State.OUTSIDE
            return
        if not self._args_started:
            self._emit("{}")
        elif self._args is _Args.ELEMENTS:
            self._emit("}")
        self._event(CallClosed(self._call))
        self._call = None
        self._state = _State.OUTSIDE

    # -- values -------------------------------------------------------------------

    def _open_argument(self, attributes: dict[str, str]) -> None:
        key = attributes.get("key")
        if key is None:
            self._drop("an argument without a key")
            self._skip_value(vocab.ARGUMENT_END)
            return
        if self._args is _Args.JSON_BLOCK:
            self._drop("an argument after a json block")
            self._skip_value(vocab.ARGUMENT_END)
            return
        prefix = ", " if self._args_started else "{"
        self._args = _Args.ELEMENTS
        self._args_started = True
        prefix += _json_text(key) + ": "
        if attributes.get("type", vocab.STRING_TYPE) == vocab.STRING_TYPE:
            self._value = _Value.STRING
            prefix += '"'
        else:
            self._value = _Value.TYPED
            self._typed = []
        self._emit(prefix)
        self._value_end = vocab.ARGUMENT_END
        self._state = _State.VALUE

    def _open_json_block(self) -> None:
        if self._args is not _Args.NONE:
            self._drop("a json block after other arguments")
            self._skip_value(vocab.JSON_END)
            return
        self._args = _Args.JSON_BLOCK
        self._value = _Value.RAW
        self._value_end = vocab.JSON_END
        self._state = _State.VALUE

    def _skip_value(self, end: str) -> None:
        self._skip_return = self._state
        self._value_end = end
        self._state = _State.SKIP_VALUE

    def _value_text(self, text: str) -> None:
        kind = self._value
        if kind is _Value.STRING:
            self._emit(_json_text(text)[1:-1])
        elif kind is _Value.TYPED:
            self._typed.append(text)
        else:
            self._args_started = True
            self._emit(text)

    def _end_value(self) -> None:
        if self._state is _State.SKIP_VALUE:
            self._state = self._skip_return
            return
        kind = self._value
        if kind is _Value.STRING:
            self._emit('"')
        elif kind is _Value.TYPED:
            raw, self._typed = "".join(self._typed), []
            self._emit(typed_value_json(raw))
        self._state = _State.CALL


def collect_calls(events: list[ToolEvent]) -> list[ToolCall]:
    """The closed calls, in order, with their arguments joined."""
    names: dict[int, str] = {}
    pieces: dict[int, list[str]] = {}
    calls: list[ToolCall] = []
    for event in events:
        kind = type(event)
        if kind is ArgumentsDelta:
            pieces[event.index].append(event.text)
        elif kind is CallOpened:
            names[event.index] = event.name
            pieces[event.index] = []
        elif kind is CallClosed:
            index = event.index
            calls.append(ToolCall(index, names[index], "".join(pieces.pop(index))))
    return calls


def read_calls(markup: str) -> tuple[list[ToolCall], list[Dropped]]:
    """The non-streaming read of a tools channel: the reader fed it whole."""
    reader = ToolCallReader()
    events = reader.feed(markup)
    events += reader.finish()
    dropped = [event for event in events if type(event) is Dropped]
    return collect_calls(events), dropped
