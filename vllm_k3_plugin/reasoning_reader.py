"""ReasoningReader: the think/response/tools state machine of K3_FORMAT.md, rules 1-7.

Sans-I/O: feed model text in any chunking, get ``Reasoning`` / ``Content`` /
``ToolMarkup`` events; ``finish(stopped=...)`` ends the output. The non-streaming read
is this reader fed the whole output (``read_whole``), so the two agree by construction.

Invariants:

- Work per feed is proportional to the chunk (plus one replay of the channel when a
  skipped channel is decided); nothing rescans earlier text.
- Framing never reaches content; inside the think channel it is dropped, and only a
  quoted answer closer (one the channel goes on past) reaches reasoning.
- The think channel is kept once (``_KeptText``) while it is open, only because the
  replay or the hold-back policy needs it, and dropped when the channel is decided.
"""

from __future__ import annotations

import enum
from typing import NamedTuple

from vllm_k3_plugin import vocab
from vllm_k3_plugin.scanner import MarkerScanner


class Reasoning(NamedTuple):
    text: str


class Content(NamedTuple):
    text: str


class ToolMarkup(NamedTuple):
    """Raw text of the tools channel, markers included, for the tool-call reader."""

    text: str


ReaderEvent = Reasoning | Content | ToolMarkup


class Channel(enum.Enum):
    THINK = "think"
    RESPONSE = "response"
    TOOLS = "tools"
    DONE = "done"


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


_THINK_EXITS = frozenset(vocab.THINK_EXITS)
# Markers that change the think channel's state; all other framing there is dropped.
# In the reply, a call opener without its tools channel opens one (the think channel
# ends only at the markers of rule 3, which the engine's id-level answer also knows).
_TOOLS_OPENERS = frozenset({vocab.TOOLS_START, vocab.CALL_START_UNWRAPPED})
_THINK_STATE_MARKERS = _THINK_EXITS | {vocab.TOOLS_START, vocab.RESPONSE_END}
_RESPONSE_STATE_MARKERS = _TOOLS_OPENERS
_ATOMS = tuple(vocab.ADDED_TOKENS)
# Content kept to find an atom that the next piece completes.
_ATOM_TAIL = max(len(atom) for atom in vocab.CONTROL_ATOMS) - 1
# Every control atom ends with this character.
_ATOM_LAST = ">"
assert all(atom.endswith(_ATOM_LAST) for atom in vocab.CONTROL_ATOMS)


class ReasoningReader:
    """One request's reader. ``start`` is the channel the prompt leaves open."""

    __slots__ = (
        "_after_closer",
        "_at_offset_zero",
        "_channel",
        "_closer_pending",
        "_content_tail",
        "_events",
        "_kept",
        "_kept_quoted",
        "_policy",
        "_replayed",
        "_run",
        "_run_kind",
        "_scanner",
    )

    def __init__(
        self,
        start: Channel = Channel.THINK,
        policy: ReplayPolicy = ReplayPolicy.REPLAY,
    ) -> None:
        if start not in (Channel.THINK, Channel.RESPONSE):
            raise ValueError(f"an output starts in think or response, not {start}")
        self._scanner = MarkerScanner(vocab.REASONING_MARKERS)
        self._channel = start
        self._policy = policy
        self._replayed = False
        self._at_offset_zero = True
        self._kept: _KeptText | None = _KeptText() if start is Channel.THINK else None
        # After an answer closer in the think channel: the closer, whitespace and
        # framing that followed it, undecided until words, an exit or the end come.
        self._closer_pending = False
        self._after_closer: list[str] = []
        # Spans of ``_kept`` holding quoted closers: reasoning text, never content.
        self._kept_quoted: list[tuple[int, int]] = []
        self._events: list[ReaderEvent] = []
        # Adjacent pieces of one kind, joined into one event when the kind changes or
        # the feed ends: a thought full of dropped framing is still one event a feed.
        self._run: list[str] = []
        self._run_kind: type[ReaderEvent] | None = None
        # The end of the content sent so far (see ``_break_joined_atoms``).
        self._content_tail = ""

    @property
    def channel(self) -> Channel:
        return self._channel

    @property
    def replayed(self) -> bool:
        """Whether a skipped think channel was read as the reply (rule 4)."""
        return self._replayed

    @property
    def in_reasoning(self) -> bool:
        """Whether the think channel is still open (the engine's question)."""
        return self._channel is Channel.THINK

    def feed(self, text: str) -> list[ReaderEvent]:
        """Read the next chunk of the output; return the events it decides."""
        if self._channel is Channel.DONE:
            raise RuntimeError("feed() after finish()")
        self._events = events = []
        parts = self._scanner.feed_parts(text)
        if len(parts) == 1:
            # The usual streaming step: text and no marker.
            if parts[0]:
                self._on_text(parts[0])
        else:
            self._read(parts)
        self._flush()
        self._events = []  # the caller's now: hold no reference to its text
        return events

    def finish(self, *, stopped: bool) -> list[ReaderEvent]:
        """End of the output. ``stopped``: the model stopped itself (EOS, a stop
        token or a stop string), as opposed to a ``max_tokens`` cut or an abort."""
        if self._channel is Channel.DONE:
            return []
        self._events = events = []
        cut = "".join(event.text for event in self._scanner.finish())
        # A marker cut off at the end is not a marker: never content, and not words
        # after a closer. Reasoning keeps it as text; the tool reader sees it raw.
        # The model writes each atom as one token, so a cut marker starts with a whole
        # atom; a bare prefix of one (a reply ending in "<") is the model's text.
        if self._channel is Channel.THINK:
            self._end_think(replay=self._closer_pending and stopped)
            if cut:
                self._push(Reasoning, cut)
        elif self._channel is Channel.TOOLS and cut:
            self._push(ToolMarkup, cut)
        elif cut and not cut.startswith(_ATOMS):
            self._push(Content, cut)
        self._flush()
        self._events = []
        self._channel = Channel.DONE
        return events

    def _push(self, kind: type[ReaderEvent], text: str) -> None:
        if kind is Content:
            text = self._break_joined_atoms(text)
        if kind is not self._run_kind:
            self._flush()
            self._run_kind = kind
        self._run.append(text)

    def _break_joined_atoms(self, text: str) -> str:
        """``text`` as content, with ``ATOM_BREAK`` before the last character of any
        control atom it completes. The scanner reads every whole atom in the output
        as a marker, so an atom in content can only be joined from text on the two
        sides of dropped framing (``<|close|`` + a dropped marker + ``>``). The break
        goes before the atom's last character, which is always in the newest piece:
        where it lands depends on the content alone, not on how it was chunked."""
        tail = self._content_tail
        if _ATOM_LAST in text:
            ends = []
            for atom in vocab.CONTROL_ATOMS:
                last = len(atom) - 1
                # Inside the piece (its text joined across dropped framing), and
                # across the seam with the content before it: no copy of the piece.
                ends += (found + last for found in _occurrences(text, atom))
                edge = tail + text[:last]
                ends += (
                    found + last - len(tail)
                    for found in _occurrences(edge, atom)
                    if found < len(tail)
                )
            if ends:
                pieces, at = [], 0
                for end in sorted(ends):
                    pieces += (text[at:end], vocab.ATOM_BREAK)
                    at = end
                pieces.append(text[at:])
                text = "".join(pieces)
        if len(text) >= _ATOM_TAIL:
            self._content_tail = text[-_ATOM_TAIL:]
        else:
            self._content_tail = (tail + text)[-_ATOM_TAIL:]
        return text

    def _flush(self) -> None:
        if self._run:
            self._events.append(self._run_kind("".join(self._run)))
            self._run = []
        self._run_kind = None

    # -- dispatch -----------------------------------------------------------------

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
        if self._channel is Channel.THINK and not self._closer_pending:
            return _THINK_STATE_MARKERS
        if self._channel is Channel.RESPONSE and not self._at_offset_zero:
            return _RESPONSE_STATE_MARKERS
        return None

    def _on_text(self, text: str) -> None:
        channel = self._channel
        if channel is Channel.THINK:
            self._think_text(text)
        elif channel is Channel.RESPONSE:
            self._at_offset_zero = False
            self._push(Content, text)
        else:
            self._push(ToolMarkup, text)

    def _on_marker(self, marker: str) -> None:
        channel = self._channel
        if channel is Channel.THINK:
            self._think_marker(marker)
        elif channel is Channel.RESPONSE:
            self._response_marker(marker)
        else:
            self._push(ToolMarkup, marker)
            if marker == vocab.TOOLS_END:
                self._channel = Channel.RESPONSE
                self._at_offset_zero = False

    # -- think channel ------------------------------------------------------------

    def _think_text(self, text: str) -> None:
        self._at_offset_zero = False
        if self._closer_pending:
            if text.isspace():
                self._after_closer.append(text)
                return
            # Words after the closer: it was quoted, and goes on as reasoning.
            self._closer_pending = False
            quoted, self._after_closer = self._after_closer, []
            for piece in quoted:
                self._emit_reasoning(piece, quoted_marker=not piece.isspace())
        self._emit_reasoning(text)

    def _think_marker(self, marker: str) -> None:
        if marker in _THINK_EXITS:
            self._end_think(replay=False)
            self._channel = Channel.RESPONSE
            self._at_offset_zero = False
        elif marker == vocab.TOOLS_START:
            self._end_think(replay=self._closer_pending)
            self._enter_tools(marker)
        elif marker == vocab.RESPONSE_END:
            self._at_offset_zero = False
            self._closer_pending = True
            self._after_closer.append(marker)
        # Other framing inside the think channel is dropped.

    def _emit_reasoning(self, text: str, *, quoted_marker: bool = False) -> None:
        if not text:
            return
        if self._kept is not None:
            start = self._kept.write(text)
            if quoted_marker:
                self._kept_quoted.append((start, start + len(text)))
        if self._policy is ReplayPolicy.REPLAY:
            self._push(Reasoning, text)

    def _end_think(self, *, replay: bool) -> None:
        """Decide the think channel: it was the reply (``replay``) or a thought."""
        pending_space = "".join(
            piece for piece in self._after_closer if piece.isspace()
        )
        self._after_closer = []
        self._closer_pending = False
        self._emit_reasoning(pending_space)
        kept = self._kept.getvalue() if self._kept is not None else ""
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
        if marker in _TOOLS_OPENERS:
            self._enter_tools(marker)
        elif self._at_offset_zero and marker == vocab.THINK_START:
            # A thinking-off output that opens its own think channel.
            self._channel = Channel.THINK
            self._kept = _KeptText()
        # The think exit at offset 0 means "declined to think"; it and all other
        # framing are dropped from content.

    def _enter_tools(self, marker: str) -> None:
        self._channel = Channel.TOOLS
        self._at_offset_zero = False
        self._push(ToolMarkup, marker)


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


def _occurrences(text: str, atom: str):
    """Where ``atom`` starts in ``text`` (atoms cannot overlap themselves)."""
    found = text.find(atom)
    while found != -1:
        yield found
        found = text.find(atom, found + len(atom))


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
) -> Reading:
    """The non-streaming read: the streaming reader fed the whole output once."""
    reader = ReasoningReader(start=start, policy=policy)
    events = reader.feed(text)
    events += reader.finish(stopped=stopped)
    return collect(events, tools_as_content=tools_as_content)


def collect(events: list[ReaderEvent], *, tools_as_content: bool = False) -> Reading:
    """Join events into the three fields.

    With ``tools_as_content`` (no tool parser to hand the channel to), the tools
    channel is text of the reply, kept in place among the content.
    """
    reasoning: list[str] = []
    content: list[str] = []
    tools = content if tools_as_content else []
    for event in events:
        kind = type(event)
        if kind is Reasoning:
            reasoning.append(event.text)
        elif kind is Content:
            content.append(event.text)
        else:
            tools.append(event.text)
    tool_markup = "" if tools_as_content else "".join(tools)
    return Reading("".join(reasoning), "".join(content), tool_markup)
