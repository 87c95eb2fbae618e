"""ReasoningReader: the channels of a K3 output (K3_FORMAT.md, rules 1-7).

Sans-I/O: feed the output (its text, and its token ids where the caller has them) in
any chunking, get ``Reasoning`` / ``Content`` / ``ToolMarkup`` events;
``finish(stopped=...)`` ends the output. The non-streaming read is this reader fed
the whole output (``read_whole``), so the two agree by construction.

Structure is read from marked text (``marked``): with ids, only control atoms are
structure; without them (a saved text), every atom string is.

How the channels end, marker by marker, is ``transitions.py``'s (the reader's base
class); what the reader moves through is ``channels.py``'s.

Invariants:

- Work per feed is proportional to the chunk (plus one replay of the channel when a
  skipped channel is decided); nothing rescans earlier text.
- Control framing never reaches content; in the think channel it is dropped, and
  only a quoted answer closer (one the channel goes on past) reaches reasoning, as
  its atom strings. A marker cut off at the end of the output is dropped.
- The think channel is kept once (``skipped_channel.KeptThought``) while it is
  open, only because the replay or the hold-back policy needs it, and dropped when
  the channel is decided.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from vllm_k3_plugin.format import marked as m
from vllm_k3_plugin.format import vocab
from vllm_k3_plugin.format.channels import (
    CHANNEL_OF,
    EXIT_TAG_CHARS,
    MARKERS,
    STATE_MARKERS,
    TAG_ATOMS,
    Channel,
    State,
)
from vllm_k3_plugin.format.events import Content, ReaderEvent, Reasoning, ToolMarkup
from vllm_k3_plugin.format.scanner import MarkerScanner
from vllm_k3_plugin.format.skipped_channel import KeptThought, ReplayPolicy
from vllm_k3_plugin.format.transitions import ChannelTransitions
from vllm_k3_plugin.format.xtml import GENERIC_GRAMMAR, TagGrammar, TagText

# The states the per-token path compares against, as plain names: reading an Enum
# class's attribute costs a lookup through its metaclass on every access.
_THINK, _THINK_AFTER_CLOSER = State.THINK, State.THINK_AFTER_CLOSER
_REPLY_START, _REPLY = State.REPLY_START, State.REPLY


class Reading(NamedTuple):
    """A whole output read: what each field receives."""

    reasoning: str
    content: str
    tool_markup: str


class ReasoningReader(ChannelTransitions):
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
        self._state = State.THINK if start is Channel.THINK else State.REPLY_START
        self._policy = policy
        self._replayed = False
        self._kept = KeptThought() if start is Channel.THINK else None
        # A think block (not the output's own think channel) returns here at its
        # exit; ``None`` in the output's think channel and outside think.
        self._block_origin: State | None = None
        # Where the output goes on when the tools channel closes: the reply, or
        # the think channel it interrupted.
        self._after_tools = State.REPLY
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
        return CHANNEL_OF[self._state]

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
        if self._state is State.DONE:
            raise RuntimeError("feed() after finish()")
        self._events = events = []
        self._scan(self._atoms.mark(text, ids))
        self._flush()
        self._events = []  # the caller's now: hold no reference to its text
        return events

    def finish(self, *, stopped: bool) -> list[ReaderEvent]:
        """End of the output. ``stopped``: the model stopped itself (EOS, a stop
        token or a stop string), as opposed to a ``max_tokens`` cut or an abort."""
        if self._state is State.DONE:
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
            self._end_think(replay=self._state is State.THINK_AFTER_CLOSER and stopped)
        self._flush()
        self._events = []
        self._state = State.DONE
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
        if self._tag is not None and self._scanner.held[:1] in TAG_ATOMS:
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
        return STATE_MARKERS.get(self._state)

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
                if sum(map(len, exit_tag)) > EXIT_TAG_CHARS:
                    self._exit_tag = None
            self._push(ToolMarkup, text)

    # -- think channel ------------------------------------------------------------

    def _think_text(self, text: str) -> None:
        if self._state is _THINK_AFTER_CLOSER:
            if text.isspace():
                self._after_closer.append(text)
                return
            # Words after the closer: it was quoted, and goes on as reasoning.
            self._state = State.THINK
            quoted, self._after_closer = self._after_closer, []
            for piece in quoted:
                if piece.isspace():
                    self._emit_reasoning(piece)
                else:
                    self._emit_reasoning(m.unmarked(piece), quoted_marker=True)
        self._emit_reasoning(text)

    def _emit_reasoning(self, text: str, *, quoted_marker: bool = False) -> None:
        if not text:
            return
        if self._kept is not None:
            self._kept.write(text, quoted_marker)
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
        channel, self._kept = self._kept, None
        if self.decided_after is None:
            self.decided_after = channel.length if channel is not None else 0
        kept = ""
        if channel is not None:
            kept = channel.reply() if replay else channel.thought()
        if replay:
            self._replayed = bool(kept)
        if self._policy is ReplayPolicy.HOLD_BACK:
            if kept:
                self._push(Content if replay else Reasoning, kept)
        elif replay and kept:
            self._push(Content, kept)


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
