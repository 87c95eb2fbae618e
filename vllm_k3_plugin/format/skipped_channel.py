"""The replay of a skipped think channel (K3_FORMAT.md, rules 4 and 5): an
output's think channel may turn out to be the reply, the model having answered where
its thought goes. ``ReplayPolicy`` says what the client gets while the channel is
undecided; ``KeptThought`` keeps the channel's text until it is decided, for the
reader (``reasoning.ReasoningReader``) to send it then: again as content, or once.

The think channel is kept once while it is open, only because the replay or the
hold-back policy needs it, and dropped when the channel is decided.
"""

from __future__ import annotations

import enum


class ReplayPolicy(enum.Enum):
    """What happens to a think channel that turns out to be the reply (rule 5)."""

    REPLAY = "replay"
    """Reasoning streams live; a skipped channel is sent again as content."""
    HOLD_BACK = "hold-back"
    """Think text is held until the channel is decided, then sent once."""


class KeptThought:
    """The think channel's text, kept once: small pieces are joined into blocks, so
    the copy costs about its own size (``io.StringIO`` and a list of per-token
    strings both cost two or more times that). Quoted closers (their atom strings)
    are kept with it as reasoning, and left out of it as the reply."""

    __slots__ = ("_blocks", "_length", "_pieces", "_quoted")

    _BLOCK_PIECES = 512

    def __init__(self) -> None:
        self._blocks: list[str] = []
        self._pieces: list[str] = []
        self._length = 0
        # Spans of quoted closers: reasoning text, never content.
        self._quoted: list[tuple[int, int]] = []

    def write(self, text: str, quoted: bool = False) -> None:
        """Append ``text`` (``quoted``: a quoted closer)."""
        start = self._length
        self._length += len(text)
        pieces = self._pieces
        pieces.append(text)
        if len(pieces) >= self._BLOCK_PIECES:
            self._blocks.append("".join(pieces))
            pieces.clear()
        if quoted:
            self._quoted.append((start, self._length))

    @property
    def length(self) -> int:
        """Characters kept."""
        return self._length

    def thought(self) -> str:
        """The channel as a thought: all of it."""
        return "".join(self._blocks) + "".join(self._pieces)

    def reply(self) -> str:
        """The channel as the reply: without its quoted closers."""
        return _without_spans(self.thought(), self._quoted)


def _without_spans(text: str, spans: list[tuple[int, int]]) -> str:
    if not spans:
        return text
    pieces, at = [], 0
    for start, end in spans:
        pieces.append(text[at:start])
        at = end
    pieces.append(text[at:])
    return "".join(pieces)
