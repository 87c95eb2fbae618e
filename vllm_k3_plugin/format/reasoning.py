"""ReasoningReader: the channels of a K3 output (K3_FORMAT.md, rules 1-7).

Sans-I/O: feed the output (its text, and its token ids where the caller has them) in
any chunking, get ``Reasoning`` / ``Content`` / ``ToolMarkup`` events;
``finish(stopped=...)`` ends the output. The non-streaming read is this reader fed
the whole output (``read_whole``), so the two agree by construction.

Structure is read from marked text (``marked``): with ids, only control atoms are
structure; without them (a saved text), every atom string is.

Channels and how they end:

- The think channel ends at its closer, at a model-opened response, or at a tools
  channel: a tools opener followed, whitespace aside, by a call opener. A tools
  opener followed by anything else (more than ``vocab.TOOLS_OPENER_MAX_GAP``
  whitespace characters included) is quoted and dropped. Bound: the opener and the
  whitespace after it wait for the next marker or word, or that many characters.
- A think channel a tools channel interrupted goes on after that channel closes; a
  think block opened later (in the reply, in the tools channel) is reasoning until
  its exit, joined to the rest in order.
- The tools channel is handed to the tool-call reader raw (``ToolMarkup``, marked),
  from its opener to its closer; the markup that opens it says whether it
  interrupted a thought.
- Outside it, tags are read as the tool-call reader reads them: a control opener or
  closer, a tag (``xtml.TagText``), a separator. A complete tag is the marker its
  element spells, or dropped whole (an ``argument`` or ``json`` element outside a
  call, an unknown element); a closer the next atom interrupts is complete without
  its separator (``<|close|>think`` then the next channel); text that stops reading
  as a tag (``xtml.TagGrammar``) is text where it stands, its atom dropped. Bound: a
  tag is held at most the grammar's ``max_tag_chars``.

Invariants:

- Work per feed is proportional to the chunk (plus one replay of the channel when a
  skipped channel is decided); nothing rescans earlier text.
- Control framing never reaches content; in the think channel it is dropped, and
  only a quoted answer closer (one the channel goes on past) reaches reasoning, as
  its atom strings. A marker cut off at the end of the output is dropped.
- The think channel is kept once (``_KeptText``) while it is open, only because the
  replay or the hold-back policy needs it, and dropped when the channel is decided.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Sequence
from typing import NamedTuple

from vllm_k3_plugin.format import marked as m
from vllm_k3_plugin.format import vocab
from vllm_k3_plugin.format.events import Content, ReaderEvent, Reasoning, ToolMarkup
from vllm_k3_plugin.format.scanner import MarkerScanner
from vllm_k3_plugin.format.xtml import GENERIC_GRAMMAR, TagGrammar, TagText


class Channel(enum.Enum):
    THINK = "think"
    RESPONSE = "response"
    TOOLS = "tools"
    DONE = "done"


class _State(enum.Enum):
    """Where the reader stands: the channel, and what in it is still undecided."""

    THINK = "a think channel or block"
    THINK_AFTER_CLOSER = (
        "the output's think channel after an answer closer: the reply, unless words "
        "follow"
    )
    REPLY_START = (
        "the reply, nothing read yet: a think opener here opens the output's own "
        "think channel"
    )
    REPLY = "the reply"
    TOOLS = "the tools channel"
    DONE = "finished"


# The states the per-token path compares against, as plain names: reading an Enum
# class's attribute costs a lookup through its metaclass on every access.
_THINK, _THINK_AFTER_CLOSER = _State.THINK, _State.THINK_AFTER_CLOSER
_REPLY_START, _REPLY = _State.REPLY_START, _State.REPLY

_CHANNEL_OF = {
    _State.THINK: Channel.THINK,
    _State.THINK_AFTER_CLOSER: Channel.THINK,
    _State.REPLY_START: Channel.RESPONSE,
    _State.REPLY: Channel.RESPONSE,
    _State.TOOLS: Channel.TOOLS,
    _State.DONE: Channel.DONE,
}


class ReplayPolicy(enum.Enum):
    """What happens to a think channel that turns out to be the reply (rule 5)."""

    REPLAY = "replay"
    """Reasoning streams live; a skipped channel is sent again as content."""
    HOLD_BACK = "hold-back"
    """Think text is held until the channel is decided, then sent once."""


class Reading(NamedTuple):
    """A whole output read: what each field receives."""

    reasoning: str
    content: str
    tool_markup: str


# Markers as the readers spell them (marked text).
THINK_START = m.marked(vocab.THINK_START)
THINK_END = m.marked(vocab.THINK_END)
RESPONSE_START = m.marked(vocab.RESPONSE_START)
RESPONSE_END = m.marked(vocab.RESPONSE_END)
TOOLS_START = m.marked(vocab.TOOLS_START)
TOOLS_END = m.marked(vocab.TOOLS_END)
CALL_START = m.marked(vocab.CALL_START_UNWRAPPED)
CALL_START_BARE = m.marked(vocab.opener(vocab.CALL))
_THINK_EXITS = frozenset(m.marked_all(vocab.THINK_EXITS))
_CALL_STARTS = frozenset({CALL_START, CALL_START_BARE})
MARKERS = (
    *m.marked_all(vocab.REASONING_MARKERS),
    CALL_START_BARE,
)
# Markers that change the state (an opener or closer atom starts a tag); all other
# framing there is dropped.
_TAG_ATOMS = frozenset({m.OPEN, m.CLOSE})
_THINK_STATE_MARKERS = (
    _THINK_EXITS | _TAG_ATOMS | {TOOLS_START, RESPONSE_END, CALL_START}
)
_RESPONSE_STATE_MARKERS = _CALL_STARTS | _TAG_ATOMS | {TOOLS_START, THINK_START}
# The states where only these markers matter (in the others each part is read).
_STATE_MARKERS = {
    _State.THINK: _THINK_STATE_MARKERS,
    _State.REPLY: _RESPONSE_STATE_MARKERS,
}
# The thought's exit as a tag inside a tools channel: at its separator, and (the
# closer only) at any other atom; at most this long.
_EXIT_TAG = re.compile(
    rf"(?:{re.escape(m.CLOSE)}{vocab.THINK}|{re.escape(m.OPEN)}{vocab.RESPONSE})\s*"
)
_EXIT_CLOSER = re.compile(rf"{re.escape(m.CLOSE)}{vocab.THINK}\s*")
_EXIT_TAG_CHARS = 1 + len(vocab.RESPONSE) + vocab.TOOLS_OPENER_MAX_GAP
# Complete tags read as the channel markers they spell: (is an opener, name).
_TAG_MARKERS = {
    (True, vocab.THINK): THINK_START,
    (False, vocab.THINK): THINK_END,
    (True, vocab.RESPONSE): RESPONSE_START,
    (False, vocab.RESPONSE): RESPONSE_END,
    (True, vocab.TOOLS): TOOLS_START,
    (False, vocab.TOOLS): TOOLS_END,
}


class ReasoningReader:
    """One request's reader. ``start`` is the channel the prompt leaves open;
    ``atoms`` tells structure from text (``marked.TextAtoms`` if not given)."""

    __slots__ = (
        "_after_closer",
        "_after_tools",
        "_atoms",
        "_block_origin",
        "_events",
        "_exit_tag",
        "_grammar",
        "_kept",
        "_kept_quoted",
        "_policy",
        "_replayed",
        "_run",
        "_run_kind",
        "_scanner",
        "_state",
        "_tag",
        "_tools_held",
        "decided_after",
        "markup_dropped",
        "think_blocks",
    )

    def __init__(
        self,
        start: Channel = Channel.THINK,
        policy: ReplayPolicy = ReplayPolicy.REPLAY,
        atoms: m.TextAtoms | m.IdAtoms | None = None,
        grammar: TagGrammar = GENERIC_GRAMMAR,
    ) -> None:
        if start not in (Channel.THINK, Channel.RESPONSE):
            raise ValueError(f"an output starts in think or response, not {start}")
        self._atoms = atoms if atoms is not None else m.TextAtoms()
        self._grammar = grammar
        self._scanner = MarkerScanner(MARKERS)
        self._state = _State.THINK if start is Channel.THINK else _State.REPLY_START
        self._policy = policy
        self._replayed = False
        self._kept: _KeptText | None = _KeptText() if start is Channel.THINK else None
        # A think block (not the output's own think channel) returns here at its
        # exit; ``None`` in the output's think channel and outside think.
        self._block_origin: _State | None = None
        # Where the output goes on when the tools channel closes: the reply, or
        # the think channel it interrupted.
        self._after_tools = _State.REPLY
        # A tools opener and the whitespace after it, undecided until the next
        # marker (a call opener: a tools channel) or word (quoted).
        self._tools_held: list[str] | None = None
        # A tag after an opener or closer atom, outside the tools channel.
        self._tag: TagText | None = None
        # In a tools channel that interrupted a thought: an atom and the text after
        # it, read for the thought's exit spelled otherwise than the marker (the
        # think closer without its separator, or with whitespace).
        self._exit_tag: list[str] | None = None
        # In THINK_AFTER_CLOSER: the closer, whitespace and framing that followed
        # it, undecided until words, an exit or the end come.
        self._after_closer: list[str] = []
        # Spans of ``_kept`` holding quoted closers: reasoning text, never content.
        self._kept_quoted: list[tuple[int, int]] = []
        self._events: list[ReaderEvent] = []
        # Adjacent pieces of one kind, joined into one event when the kind changes or
        # the feed ends: a thought full of dropped framing is still one event a feed.
        self._run: list[str] = []
        self._run_kind: type[ReaderEvent] | None = None
        self.think_blocks = 0
        """Think blocks after the output's own think channel: resumed after a tools
        channel, or opened in the reply or between calls."""
        self.markup_dropped: dict[str, int] = {}
        """Markup outside the tools channel read as nothing, by kind (for metrics;
        counted only where it happens, never per token)."""
        self.decided_after: int | None = None
        """Characters of the output's think channel read before it was decided
        (held back under ``HOLD_BACK``); ``None`` until then."""

    @property
    def channel(self) -> Channel:
        return _CHANNEL_OF[self._state]

    @property
    def replayed(self) -> bool:
        """Whether a skipped think channel was read as the reply (rule 4)."""
        return self._replayed

    @property
    def held_chars(self) -> int:
        """Characters read that are neither sent nor decided framing yet: what may
        still reach the client (the streaming lag). Not counted: think text kept
        under ``HOLD_BACK`` (the documented decision) and framing atoms."""
        held = self._atoms.held_chars + len(self._scanner.held)
        if self._tag is not None:
            held += len(self._tag.text)
        for pieces in (
            self._tools_held[1:] if self._tools_held else (),
            self._after_closer,
        ):
            held += sum(len(piece) for piece in pieces if piece.isspace())
        return held

    @property
    def in_reasoning(self) -> bool:
        """Whether a think channel is open (the engine's question)."""
        return self.channel is Channel.THINK

    def feed(self, text: str, ids: Sequence[int] | None = None) -> list[ReaderEvent]:
        """Read the next chunk of the output (its text, and the ids it came from
        when reading ids); return the events it decides."""
        if self._state is _State.DONE:
            raise RuntimeError("feed() after finish()")
        self._events = events = []
        self._scan(self._atoms.mark(text, ids))
        self._flush()
        self._events = []  # the caller's now: hold no reference to its text
        return events

    def finish(self, *, stopped: bool) -> list[ReaderEvent]:
        """End of the output. ``stopped``: the model stopped itself (EOS, a stop
        token or a stop string), as opposed to a ``max_tokens`` cut or an abort."""
        if self._state is _State.DONE:
            return []
        self._events = events = []
        # The start of an atom string that never completed is text.
        self._scan(self._atoms.finish())
        # A marker cut off at the end is not a marker: it starts with a control
        # atom, and is dropped wherever it stands.
        self._scanner.finish()
        self._tag = None  # a tag cut off: a cut marker too
        self._exit_tag = None
        if self._tools_held is not None:
            self._quote_tools_opener()
        if self.channel is Channel.THINK and self._block_origin is None:
            self._end_think(replay=self._state is _State.THINK_AFTER_CLOSER and stopped)
        self._flush()
        self._events = []
        self._state = _State.DONE
        return events

    def _push(self, kind: type[ReaderEvent], text: str) -> None:
        if kind is not self._run_kind:
            self._flush()
            self._run_kind = kind
        self._run.append(text)

    def _flush(self) -> None:
        if self._run:
            self._events.append(self._run_kind("".join(self._run)))
            self._run = []
        self._run_kind = None

    # -- dispatch -----------------------------------------------------------------

    def _scan(self, text: str) -> None:
        if not text:
            return
        parts = self._scanner.feed_parts(text)
        if len(parts) == 1:
            # The usual streaming step: text and no marker.
            if parts[0]:
                self._on_text(parts[0])
        else:
            self._read(parts)
        if self._tag is not None and self._scanner.held[:1] in _TAG_ATOMS:
            # The next atom arrived, held as the start of a longer marker: the tag
            # ends before it whatever that marker turns out to be.
            self._end_tag(at_separator=False)

    def _read(self, parts: list[str]) -> None:
        """Dispatch the scanner's parts: text at even indices, markers at odd."""
        index, count = 0, len(parts)
        while index < count:
            piece = parts[index]
            if index & 1:
                self._on_marker(piece)
                index += 1
                continue
            state_markers = self._state_markers()
            if state_markers is None:
                if piece:
                    self._on_text(piece)
                index += 1
                continue
            # Framing here is dropped: join the text up to the next marker that can
            # change the state, and read it as one piece.
            end = index + 1
            while end < count and parts[end] not in state_markers:
                end += 2
            joined = "".join(parts[index:end:2]) if end > index + 1 else piece
            if joined:
                self._on_text(joined)
            index = end

    def _state_markers(self) -> frozenset[str] | None:
        """The markers that matter now, if all others are dropped; else ``None``."""
        if self._tools_held is not None or self._tag is not None:
            return None
        return _STATE_MARKERS.get(self._state)

    def _on_text(self, text: str) -> None:
        if self._tag is not None:
            if not self._tag.add(text):
                self._end_tag(at_separator=False)
            return
        if self._tools_held is not None:
            if text.isspace():
                self._tools_held.append(text)
                gap = sum(map(len, self._tools_held[1:]))
                if gap <= vocab.TOOLS_OPENER_MAX_GAP:
                    return
            self._quote_tools_opener()
            if text.isspace():
                return
        state = self._state
        if state is _THINK or state is _THINK_AFTER_CLOSER:
            self._think_text(text)
        elif state is _REPLY or state is _REPLY_START:
            self._state = _REPLY
            self._push(Content, text)
        else:
            exit_tag = self._exit_tag
            if exit_tag is not None:
                exit_tag.append(text)
                if sum(map(len, exit_tag)) > _EXIT_TAG_CHARS:
                    self._exit_tag = None
            self._push(ToolMarkup, text)

    def _on_marker(self, marker: str) -> None:
        if self._tag is not None:
            self._end_tag(at_separator=marker == m.SEP)
            if marker == m.SEP:
                return
        if self._tools_held is not None:
            if marker in _CALL_STARTS:
                held, self._tools_held = self._tools_held, None
                self._enter_tools("".join(held) + marker)
                return
            self._quote_tools_opener()
        channel = self.channel
        if channel is Channel.THINK:
            self._think_marker(marker)
        elif channel is Channel.RESPONSE:
            self._response_marker(marker)
        else:
            self._tools_marker(marker)

    # -- tags outside the tools channel ------------------------------------------

    def _start_tag(self, marker: str) -> None:
        if marker == CALL_START:
            self._tag = TagText(opener=True, grammar=self._grammar)
            self._tag.add(marker[1:])
        else:
            self._tag = TagText(opener=marker == m.OPEN, grammar=self._grammar)

    def _end_tag(self, *, at_separator: bool) -> None:
        """The next atom came, or the text stopped reading as a tag: the marker its
        element spells, an element dropped whole, or text where it stands (its atom
        dropped)."""
        tag, self._tag = self._tag, None
        if not tag.ends_whole(at_separator=at_separator):
            self._dropped("incomplete_tag")
            self._leave_reply_start()
            if tag.text:
                self._on_text(tag.text)
            return
        text = tag.text
        name = text.split(None, 1)[0]
        marker = _TAG_MARKERS.get((tag.opener, name))
        if marker is not None:
            # A channel marker, spelled with whitespace or attributes: read as the
            # marker itself (a think opener at the start of the output included).
            self._on_marker(marker)
        elif tag.opener and name == vocab.CALL and self.channel is Channel.RESPONSE:
            self._enter_tools(m.OPEN + text + m.SEP)
        else:
            # Any other element opens nothing outside a tools channel: dropped whole.
            self._dropped("element_outside_tools")
            self._leave_reply_start()

    def _dropped(self, kind: str) -> None:
        self.markup_dropped[kind] = self.markup_dropped.get(kind, 0) + 1

    # -- tools openers (rule 3) ---------------------------------------------------

    def _hold_tools_opener(self, marker: str) -> None:
        self._leave_reply_start()
        self._tools_held = [marker]

    def _quote_tools_opener(self) -> None:
        """A tools opener not followed by a call: dropped; the whitespace after it
        is text of the channel it was written in."""
        held, self._tools_held = self._tools_held, None
        self._dropped("quoted_tools_opener")
        space = "".join(held[1:])
        if space:
            self._on_text(space)

    def _enter_tools(self, markup: str) -> None:
        channel = self.channel
        if channel is Channel.THINK:
            if self._block_origin is None:
                replay = self._state is _State.THINK_AFTER_CLOSER
                self._end_think(replay=replay)
                # Interrupted without an exit, the think channel goes on after.
                self._after_tools = _State.REPLY if replay else _State.THINK
            elif self._block_origin is _State.REPLY:
                self._after_tools = _State.THINK
            self._block_origin = None
        elif channel is Channel.RESPONSE:
            self._after_tools = _State.REPLY
        self._state = _State.TOOLS
        self._flush()
        thought = channel is Channel.THINK and self._after_tools is _State.THINK
        self._events.append(ToolMarkup(markup, thought=thought))

    def _tools_marker(self, marker: str) -> None:
        if self._exit_tag is not None and self._tag_exits_thought(marker):
            if marker == m.SEP:
                self._push(ToolMarkup, marker)
                self._end_thought_in_tools("")
                return
            self._end_thought_in_tools("")
        if marker == THINK_START:
            # A think block between calls: reasoning; it ends any call open.
            self._push(ToolMarkup, marker)
            self._open_block(_State.TOOLS)
            return
        if marker in _THINK_EXITS and self._after_tools is _State.THINK:
            self._end_thought_in_tools(marker)
            return
        self._push(ToolMarkup, marker)
        if marker in _TAG_ATOMS and self._after_tools is _State.THINK:
            self._exit_tag = [marker]
        if marker == TOOLS_END:
            if self._after_tools is _State.THINK:
                self._open_block(_State.REPLY)
            else:
                self._state = _State.REPLY

    def _tag_exits_thought(self, marker: str) -> bool:
        """Whether the atom and tag read before ``marker`` (an atom) spell the
        thought's exit: a ``think`` closer (its separator optional) or a
        ``response`` opener, whitespace after the name allowed."""
        tag, self._exit_tag = "".join(self._exit_tag), None
        if marker == m.SEP:
            return _EXIT_TAG.fullmatch(tag) is not None
        return _EXIT_CLOSER.fullmatch(tag) is not None

    def _end_thought_in_tools(self, markup: str) -> None:
        """The thought the tools channel interrupted ends here (after ``markup``):
        the reply follows the channel, and its text outside calls is content."""
        self._after_tools = _State.REPLY
        self._flush()
        self._events.append(ToolMarkup(markup, thought=False))

    def _open_block(self, origin: _State) -> None:
        self.think_blocks += 1
        self._state = _State.THINK
        self._block_origin = origin

    def _leave_reply_start(self) -> None:
        """Something was read: a think opener no longer opens the output's own think
        channel."""
        if self._state is _State.REPLY_START:
            self._state = _State.REPLY

    # -- think channel ------------------------------------------------------------

    def _think_text(self, text: str) -> None:
        if self._state is _THINK_AFTER_CLOSER:
            if text.isspace():
                self._after_closer.append(text)
                return
            # Words after the closer: it was quoted, and goes on as reasoning.
            self._state = _State.THINK
            quoted, self._after_closer = self._after_closer, []
            for piece in quoted:
                if piece.isspace():
                    self._emit_reasoning(piece)
                else:
                    self._emit_reasoning(m.unmarked(piece), quoted_marker=True)
        self._emit_reasoning(text)

    def _think_marker(self, marker: str) -> None:
        origin = self._block_origin
        if marker in _THINK_EXITS:
            if origin is None:
                self._end_think(replay=False)
                self._state = _State.REPLY
            else:
                self._block_origin = None
                self._state = _State.REPLY if marker == RESPONSE_START else origin
        elif marker == TOOLS_START:
            self._hold_tools_opener(marker)
        elif marker == RESPONSE_END and origin is None:
            self._state = _State.THINK_AFTER_CLOSER
            self._after_closer.append(marker)
        elif marker in _TAG_ATOMS or marker == CALL_START:
            self._start_tag(marker)
        # Other framing inside a think channel is dropped.

    def _emit_reasoning(self, text: str, *, quoted_marker: bool = False) -> None:
        if not text:
            return
        if self._kept is not None:
            start = self._kept.write(text)
            if quoted_marker:
                self._kept_quoted.append((start, start + len(text)))
            if self._policy is ReplayPolicy.HOLD_BACK:
                return
        self._push(Reasoning, text)

    def _end_think(self, *, replay: bool) -> None:
        """Decide the think channel: it was the reply (``replay``) or a thought. The
        caller moves the reader on."""
        pending_space = "".join(
            piece for piece in self._after_closer if piece.isspace()
        )
        self._after_closer = []
        self._emit_reasoning(pending_space)
        kept = self._kept.getvalue() if self._kept is not None else ""
        if self.decided_after is None:
            self.decided_after = len(kept)
        quoted, self._kept, self._kept_quoted = self._kept_quoted, None, []
        if replay:
            kept = _without_spans(kept, quoted)
            self._replayed = bool(kept)
        if self._policy is ReplayPolicy.HOLD_BACK:
            if kept:
                self._push(Content if replay else Reasoning, kept)
        elif replay and kept:
            self._push(Content, kept)

    # -- response channel ---------------------------------------------------------

    def _response_marker(self, marker: str) -> None:
        if marker == TOOLS_START:
            self._hold_tools_opener(marker)
        elif marker in _CALL_STARTS:
            # A call opener without its tools channel opens one.
            self._enter_tools(marker)
        elif marker == THINK_START:
            if self._state is _State.REPLY_START:
                # A thinking-off output that opens its own think channel.
                self._state = _State.THINK
                self._kept = _KeptText()
            else:
                self._open_block(_State.REPLY)
        elif marker in _TAG_ATOMS:
            self._start_tag(marker)
        # The think exit at offset 0 means "declined to think"; it and all other
        # framing are dropped from content.


class _KeptText:
    """The think channel's text, kept once: small pieces are joined into blocks, so
    the copy costs about its own size (``io.StringIO`` and a list of per-token
    strings both cost two or more times that)."""

    __slots__ = ("_blocks", "_length", "_pieces")

    _BLOCK_PIECES = 512

    def __init__(self) -> None:
        self._blocks: list[str] = []
        self._pieces: list[str] = []
        self._length = 0

    def write(self, text: str) -> int:
        """Append ``text``; return the offset it starts at."""
        start = self._length
        self._length += len(text)
        pieces = self._pieces
        pieces.append(text)
        if len(pieces) >= self._BLOCK_PIECES:
            self._blocks.append("".join(pieces))
            pieces.clear()
        return start

    def getvalue(self) -> str:
        return "".join(self._blocks) + "".join(self._pieces)


def _without_spans(text: str, spans: list[tuple[int, int]]) -> str:
    if not spans:
        return text
    pieces, at = [], 0
    for start, end in spans:
        pieces.append(text[at:start])
        at = end
    pieces.append(text[at:])
    return "".join(pieces)


def read_whole(
    text: str,
    *,
    stopped: bool,
    start: Channel = Channel.THINK,
    policy: ReplayPolicy = ReplayPolicy.REPLAY,
    tools_as_content: bool = False,
    ids: Sequence[int] | None = None,
    atoms: m.TextAtoms | m.IdAtoms | None = None,
) -> Reading:
    """The non-streaming read: the streaming reader fed the whole output once."""
    reader = ReasoningReader(start=start, policy=policy, atoms=atoms)
    events = reader.feed(text, ids)
    events += reader.finish(stopped=stopped)
    return collect(events, tools_as_content=tools_as_content)


def split_events(events: list) -> tuple[str, str, list]:
    """Reasoning joined, content joined, and every other event in order."""
    reasoning: list[str] = []
    content: list[str] = []
    rest = []
    for event in events:
        kind = type(event)
        if kind is Reasoning:
            reasoning.append(event.text)
        elif kind is Content:
            content.append(event.text)
        else:
            rest.append(event)
    return "".join(reasoning), "".join(content), rest


def collect(events: list[ReaderEvent], *, tools_as_content: bool = False) -> Reading:
    """Join events into the three fields.

    With ``tools_as_content`` (no tool parser to hand the channel to), the tools
    channel is text of the reply, kept in place among the content.
    """
    if tools_as_content:
        events = [
            Content(m.unmarked(event.text)) if type(event) is ToolMarkup else event
            for event in events
        ]
    reasoning, content, tools = split_events(events)
    return Reading(reasoning, content, "".join(event.text for event in tools))
