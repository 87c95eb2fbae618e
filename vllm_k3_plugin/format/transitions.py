"""The reasoning reader at a marker (K3_FORMAT.md, rules 1-7): what each marker does
in the channel the reader is in, and how a tag outside the tools channel ends.
``ChannelTransitions`` is ``reasoning.ReasoningReader``'s base class, kept apart
from the text path: its methods read and move the state the reader declares
(``ReasoningReader.__slots__``). The text between markers (per token), the events
and the think channel's decision are ``reasoning.py``'s.

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
"""

from __future__ import annotations

from vllm_k3_plugin.format import marked as m
from vllm_k3_plugin.format import vocab
from vllm_k3_plugin.format.channels import (
    CALL_START,
    CALL_STARTS,
    EXIT_CLOSER,
    EXIT_TAG,
    RESPONSE_END,
    RESPONSE_START,
    TAG_ATOMS,
    TAG_MARKERS,
    THINK_EXITS,
    THINK_START,
    TOOLS_END,
    TOOLS_START,
    Channel,
    State,
)
from vllm_k3_plugin.format.events import ToolMarkup
from vllm_k3_plugin.format.skipped_channel import KeptThought
from vllm_k3_plugin.format.xtml import TagText


class ChannelTransitions:
    """The rules at a marker, as ``ReasoningReader``'s methods."""

    __slots__ = ()

    def _on_marker(self, marker: str) -> None:
        if self._tag is not None:
            self._end_tag(at_separator=marker == m.SEP)
            if marker == m.SEP:
                return
        if self._tools_held is not None:
            if marker in CALL_STARTS:
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
        marker = TAG_MARKERS.get((tag.opener, name))
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
                replay = self._state is State.THINK_AFTER_CLOSER
                self._end_think(replay=replay)
                # Interrupted without an exit, the think channel goes on after.
                self._after_tools = State.REPLY if replay else State.THINK
            elif self._block_origin is State.REPLY:
                self._after_tools = State.THINK
            self._block_origin = None
        elif channel is Channel.RESPONSE:
            self._after_tools = State.REPLY
        self._state = State.TOOLS
        self._flush()
        thought = channel is Channel.THINK and self._after_tools is State.THINK
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
            self._open_block(State.TOOLS)
            return
        if marker in THINK_EXITS and self._after_tools is State.THINK:
            self._end_thought_in_tools(marker)
            return
        self._push(ToolMarkup, marker)
        if marker in TAG_ATOMS and self._after_tools is State.THINK:
            self._exit_tag = [marker]
        if marker == TOOLS_END:
            if self._after_tools is State.THINK:
                self._open_block(State.REPLY)
            else:
                self._state = State.REPLY

    def _tag_exits_thought(self, marker: str) -> bool:
        """Whether the atom and tag read before ``marker`` (an atom) spell the
        thought's exit: a ``think`` closer (its separator optional) or a
        ``response`` opener, whitespace after the name allowed."""
        tag, self._exit_tag = "".join(self._exit_tag), None
        if marker == m.SEP:
            return EXIT_TAG.fullmatch(tag) is not None
        return EXIT_CLOSER.fullmatch(tag) is not None

    def _end_thought_in_tools(self, markup: str) -> None:
        """The thought the tools channel interrupted ends here (after ``markup``):
        the reply follows the channel, and its text outside calls is content."""
        self._after_tools = State.REPLY
        self._flush()
        self._events.append(ToolMarkup(markup, thought=False))

    def _open_block(self, origin: State) -> None:
        self.think_blocks += 1
        self._state = State.THINK
        self._block_origin = origin

    def _leave_reply_start(self) -> None:
        """Something was read: a think opener no longer opens the output's own think
        channel."""
        if self._state is State.REPLY_START:
            self._state = State.REPLY

    def _think_marker(self, marker: str) -> None:
        origin = self._block_origin
        if marker in THINK_EXITS:
            if origin is None:
                self._end_think(replay=False)
                self._state = State.REPLY
            else:
                self._block_origin = None
                self._state = State.REPLY if marker == RESPONSE_START else origin
        elif marker == TOOLS_START:
            self._hold_tools_opener(marker)
        elif marker == RESPONSE_END and origin is None:
            self._state = State.THINK_AFTER_CLOSER
            self._after_closer.append(marker)
        elif marker in TAG_ATOMS or marker == CALL_START:
            self._start_tag(marker)
        # Other framing inside a think channel is dropped.

    # -- response channel ---------------------------------------------------------

    def _response_marker(self, marker: str) -> None:
        if marker == TOOLS_START:
            self._hold_tools_opener(marker)
        elif marker in CALL_STARTS:
            # A call opener without its tools channel opens one.
            self._enter_tools(marker)
        elif marker == THINK_START:
            if self._state is State.REPLY_START:
                # A thinking-off output that opens its own think channel.
                self._state = State.THINK
                self._kept = KeptThought()
            else:
                self._open_block(State.REPLY)
        elif marker in TAG_ATOMS:
            self._start_tag(marker)
        # The think exit at offset 0 means "declined to think"; it and all other
        # framing are dropped from content.
