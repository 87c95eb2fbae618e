"""ToolCallReader: the calls of a K3 tools channel, streamed (rules 6, 8 and 9).

Sans-I/O: feed the tools channel (what ``ReasoningReader`` hands over as marked
``ToolMarkup``, or literal text read as ``marked.TextAtoms`` reads it) in any
chunking, get ``CallOpened`` / ``ArgumentsDelta`` / ``CallClosed`` / ``CallCut`` /
``Prose`` / ``Dropped`` events. The non-streaming read is this reader fed the whole
channel, so a call's joined ``ArgumentsDelta`` texts are byte-identical to its
non-streaming ``arguments`` by construction.

Elements are read generically: a control ``<|open|>`` or ``<|close|>``, a tag, and
``<|sep|>``. A tag is held until its separator; it is *not* a tag (its atom is
dropped, its text is text where it stands) when its text stops reading as a tag
(``NAME key="value" ...`` for an opener, ``NAME`` for a closer, by the request's
``xtml.TagGrammar``: bounded words, a tool name without whitespace), when another
atom interrupts an opener, or when its separator comes before its last attribute is
whole. A closer interrupted
by the next atom is complete without its separator (seen in the wild).

Reading rules:

- A call opens at ``<|open|>call tool="NAME" ...<|sep|>``; its name goes out
  (``CallOpened``) when the element after the opener has completed its own opener
  (an ``argument`` or a ``json`` block) or the call's closer arrives. Text first
  means the opener was quoted: it is dropped and the text is prose. A call without a
  name is dropped (one ``Dropped`` event), its body skipped. The ``index``
  attribute is not trusted: calls are numbered by arrival, from 0.
- Arguments are one JSON object written as the elements arrive, in the layout of
  ``json.dumps(obj, ensure_ascii=False)``. A ``string`` value (also an argument with no
  ``type``) is raw text and streams JSON-escaped while it arrives; any other type is
  JSON, sent re-serialized when its element closes, or as a JSON string of the raw
  text when it is not valid JSON. A repeated key is written again (a JSON reader
  keeps the last). A ``json`` block is the arguments text itself, streamed verbatim.
  The opener of an argument with no ``key``, or of an element mixing the two forms,
  is dropped; its text is prose.
- A value ends at its own closer, and at any other control closer or opener: a
  closer of an element outside the call (and any opener but an argument's or a json
  block's) ends the call too, its missing closer recovered. A stray separator is
  dropped. BPE-spelled marker characters are the value's text.
- A call closes at ``<|close|>call<|sep|>``, at the next call's opener, or at the end
  of the channel or message.
- A call still open when the output ends is cut off (``CallCut``): its arguments are
  what streamed, never closed into JSON (a typed value still held is added raw).
- Text outside calls (between calls, after the last) is ``Prose``, with its own
  whitespace; a run of whitespace alone between elements is framing.

Memory: a typed value (until its closer), a tag (at most the grammar's
``max_tag_chars``) and a run of whitespace between elements.

One job, kept in one module: every rule above is a transition of the one state
machine (the reader's state and the call, arguments and value it is in), and the
whole-channel read beside it is that reader fed once.
"""

from __future__ import annotations

import enum
import json
import re
from collections.abc import Sequence
from typing import NamedTuple

from vllm_k3_plugin.format import marked as m
from vllm_k3_plugin.format import vocab
from vllm_k3_plugin.format.events import (
    CALL_CUT_EARLY,
    CALL_QUOTED,
    CALL_UNNAMED,
    ArgumentsDelta,
    CallClosed,
    CallCut,
    CallOpened,
    Dropped,
    Prose,
    ToolEvent,
)
from vllm_k3_plugin.format.xtml import GENERIC_GRAMMAR, TagGrammar, TagText, parse_tag


class ToolCall(NamedTuple):
    index: int
    name: str
    arguments: str
    complete: bool = True
    """False for a call the end of the output cut off."""


class ToolsRead(NamedTuple):
    """A whole tools channel read."""

    calls: list[ToolCall]
    dropped: list[Dropped]
    prose: str


class _State(enum.Enum):
    OUTSIDE = "outside"
    NAMED = "named"  # a call opener read, its name not yet sent
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


_ELEMENT_ENDS = {vocab.ARGUMENT: vocab.ARGUMENT, vocab.JSON_BLOCK: vocab.JSON_BLOCK}
# Elements a call sits inside of, or beside: their openers and closers end a call.
_OUTSIDE_CALLS = frozenset(
    {vocab.CALL, vocab.TOOLS, vocab.THINK, vocab.RESPONSE, vocab.MESSAGE}
)
_SPLIT = re.compile("([" + "".join(sorted(m.MARKS)) + "])").split


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
    """One request's tool-call reader. ``atoms``: how structure is told from text in
    what it is fed (``marked.TextAtoms`` if not given; ``marked.ALREADY_MARKED`` for
    the reasoning reader's ``ToolMarkup``); ``grammar``: what a tag may hold for the
    request (its declared tools)."""

    __slots__ = (
        "_args",
        "_args_started",
        "_atoms",
        "_call",
        "_count",
        "_events",
        "_grammar",
        "_name",
        "_prose_words",
        "_run",
        "_skip_return",
        "_space",
        "_state",
        "_tag",
        "_typed",
        "_value",
        "_value_end",
    )

    def __init__(
        self,
        atoms: m.TextAtoms | m.IdAtoms | m.AlreadyMarked | None = None,
        grammar: TagGrammar = GENERIC_GRAMMAR,
    ) -> None:
        self._atoms = atoms if atoms is not None else m.TextAtoms()
        self._grammar = grammar
        self._state = _State.OUTSIDE
        self._count = 0
        self._call: int | None = None
        self._name = ""
        self._args = _Args.NONE
        self._args_started = False
        self._value = _Value.STRING
        self._value_end = vocab.ARGUMENT
        self._skip_return = _State.CALL
        self._typed: list[str] = []
        # A tag being read, after its atom.
        self._tag: TagText | None = None
        # Between elements: whitespace held until words show it is prose, and
        # whether the current run between two elements has words.
        self._space: list[str] = []
        self._prose_words = False
        self._events: list[ToolEvent] = []
        self._run: list[str] = []

    def feed(self, text: str, ids: Sequence[int] | None = None) -> list[ToolEvent]:
        """Read the next chunk (with its token ids, for ``marked.IdAtoms``)."""
        if self._state is _State.DONE:
            raise RuntimeError("feed() after finish()")
        self._events = events = []
        self._read(self._atoms.mark(text, ids))
        self._flush()
        self._events = []  # the caller's now: hold no reference to its text
        return events

    @property
    def held_chars(self) -> int:
        """Characters read that are neither sent nor decided framing yet, but a
        typed value (``held_value_chars``): a tag, whitespace between elements, a
        call's name until the call is confirmed."""
        held = sum(map(len, self._space))
        if self._tag is not None:
            held += len(self._tag.text)
        if self._state is _State.NAMED:
            held += len(self._name)
        return held

    @property
    def held_value_chars(self) -> int:
        """A typed argument value's characters, held to its closer (rule 8: sent
        as JSON once whole)."""
        return sum(map(len, self._typed))

    def finish(self) -> list[ToolEvent]:
        """End of the output: a tag still open is a cut marker (dropped); a call
        still open is cut off."""
        if self._state is _State.DONE:
            return []
        self._events = events = []
        self._read(self._atoms.finish())
        self._tag = None  # a cut marker
        if self._state is _State.VALUE and self._value is _Value.TYPED:
            raw, self._typed = "".join(self._typed), []
            self._emit(raw)
        self._flush()
        if self._call is not None:
            events.append(CallCut(self._call))
        elif self._state is _State.NAMED:
            events.append(
                Dropped(
                    None, "a call cut off before its first argument", CALL_CUT_EARLY
                )
            )
        self._call = None
        self._space = []
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

    def _drop(self, kind: str, reason: str, index: int | None = None) -> None:
        self._event(Dropped(index, reason, kind))

    # -- dispatch -----------------------------------------------------------------

    def _read(self, text: str) -> None:
        if not text:
            return
        parts = _SPLIT(text)
        if len(parts) == 1:
            self._text(text)
            return
        for index, piece in enumerate(parts):
            if index & 1:
                self._atom(piece)
            elif piece:
                self._text(piece)

    def _atom(self, mark: str) -> None:
        if self._tag is not None:
            self._end_tag(at_separator=mark == m.SEP)
            if mark == m.SEP:
                return
        if mark == m.OPEN or mark == m.CLOSE:
            self._tag = TagText(opener=mark == m.OPEN, grammar=self._grammar)
        # A separator with no tag before it is framing: dropped. So is the stop
        # token's text (vLLM keeps it with ``include_stop_str_in_output``): the
        # output ends there, and a call still open is cut, never closed by it.

    def _text(self, text: str) -> None:
        if self._tag is not None:
            if not self._tag.add(text):
                self._end_tag(at_separator=False)
            return
        state = self._state
        if state is _State.VALUE:
            self._value_text(text)
        elif state is _State.OUTSIDE or state is _State.CALL:
            self._prose(text)
        elif state is _State.NAMED:
            if text.isspace():
                self._space.append(text)
                return
            # Words before any element: the call opener was quoted.
            self._drop(CALL_QUOTED, "a call opener not followed by an argument")
            self._state = _State.OUTSIDE
            self._prose(text)
        # In a skipped call or value, text is dropped with it.

    def _prose(self, text: str) -> None:
        if not self._prose_words:
            if text.isspace():
                self._space.append(text)
                return
            self._prose_words = True
            if self._space:
                text = "".join(self._space) + text
                self._space = []
        self._event(Prose(text))

    def _element_boundary(self) -> None:
        """An element starts or ends: whitespace alone since the last is framing."""
        self._space = []
        self._prose_words = False

    # -- tags ---------------------------------------------------------------------

    def _end_tag(self, *, at_separator: bool) -> None:
        """The next atom came, or the text stopped reading as a tag: an element's
        tag, or no tag (its atom dropped, its text where it stands)."""
        tag, self._tag = self._tag, None
        if tag.ends_whole(at_separator=at_separator):
            if tag.opener:
                self._on_opener(tag.text)
            else:
                self._on_closer(tag.text.strip())
            return
        if tag.opener:
            self._drop(
                "incomplete_opener", "an opener that never completed", self._call
            )
        if tag.text:
            self._text(tag.text)

    def _on_opener(self, tag: str) -> None:
        self._element_boundary()
        name, attributes = parse_tag(tag)
        self._end_value_if_open()
        state = self._state
        if name == vocab.CALL:
            self._end_call()
            self._open_call(attributes.get("tool", ""))
        elif name in _ELEMENT_ENDS:
            if state is _State.NAMED:
                self._confirm_call()
                state = _State.CALL
            if state is _State.CALL:
                if name == vocab.ARGUMENT:
                    self._open_argument(attributes)
                else:
                    self._open_json_block()
            elif state is _State.SKIP_CALL:
                self._skip_value(_ELEMENT_ENDS[name])
            else:
                self._drop("element_outside_call", f"an {name} element outside a call")
        elif name in _OUTSIDE_CALLS:
            self._end_call()
        else:
            self._drop(
                "unknown_element", f"an unknown element {name[:64]!r}", self._call
            )

    def _on_closer(self, name: str) -> None:
        self._element_boundary()
        state = self._state
        if state is _State.VALUE or state is _State.SKIP_VALUE:
            own = name == self._value_end
            self._end_value()
            if own:
                return
            state = self._state
        if name not in _OUTSIDE_CALLS:
            return  # a stray argument or json closer, an unknown one: framing
        if name == vocab.CALL and state is _State.NAMED:
            self._confirm_call()
        self._end_call()

    # -- calls --------------------------------------------------------------------

    def _open_call(self, name: str) -> None:
        if not name:
            self._drop(CALL_UNNAMED, "a call without a name")
            self._state = _State.SKIP_CALL
            return
        self._name = name
        self._state = _State.NAMED

    def _confirm_call(self) -> None:
        self._call = index = self._count
        self._count += 1
        self._args = _Args.NONE
        self._args_started = False
        self._state = _State.CALL
        self._event(CallOpened(index, self._name))

    def _end_call(self) -> None:
        state = self._state
        if state is _State.NAMED:
            self._drop(CALL_QUOTED, "a call opener not followed by an argument")
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
        # An opener that opens no value is dropped; the value's text is then text
        # of the call outside any value: prose.
        key = attributes.get("key")
        if key is None:
            self._drop("argument_without_key", "an argument without a key", self._call)
            return
        if self._args is _Args.JSON_BLOCK:
            self._drop("mixed_arguments", "an argument after a json block", self._call)
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
        self._value_end = vocab.ARGUMENT
        self._state = _State.VALUE

    def _open_json_block(self) -> None:
        if self._args is not _Args.NONE:
            self._drop(
                "mixed_arguments", "a json block after other arguments", self._call
            )
            return
        self._args = _Args.JSON_BLOCK
        self._value = _Value.RAW
        self._value_end = vocab.JSON_BLOCK
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

    def _end_value_if_open(self) -> None:
        if self._state is _State.VALUE or self._state is _State.SKIP_VALUE:
            self._end_value()

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
    """The calls, in order, with their arguments joined; a cut call last, as cut."""
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
        elif kind is CallClosed or kind is CallCut:
            index = event.index
            arguments = "".join(pieces.pop(index))
            calls.append(ToolCall(index, names[index], arguments, kind is CallClosed))
    return calls


def read_tools(markup: str, atoms: m.TextAtoms | None = None) -> ToolsRead:
    """The non-streaming read of a tools channel: the reader fed it whole."""
    reader = ToolCallReader(atoms)
    events = reader.feed(markup)
    events += reader.finish()
    return ToolsRead(
        collect_calls(events),
        [event for event in events if type(event) is Dropped],
        "".join(event.text for event in events if type(event) is Prose),
    )


def read_calls(markup: str) -> tuple[list[ToolCall], list[Dropped]]:
    """The calls and what was dropped of a literal tools channel (``read_tools``)."""
    read = read_tools(markup)
    return read.calls, read.dropped
