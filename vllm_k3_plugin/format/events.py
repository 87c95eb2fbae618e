"""What the readers say: frozen, slotted event types, equal only to their own kind.

The reasoning reader says ``Reasoning``, ``Content`` and ``ToolMarkup``; the tool-call
reader ``CallOpened``, ``ArgumentsDelta``, ``CallClosed``, ``CallCut``, ``Prose`` and
``Dropped``; the output reader passes on all but ``ToolMarkup`` and ``Prose`` (read
as calls, and as content).
"""

from __future__ import annotations

from dataclasses import dataclass

_EVENT = dataclass(frozen=True, slots=True)


@_EVENT
class Reasoning:
    text: str


@_EVENT
class Content:
    text: str


@_EVENT
class ToolMarkup:
    """Marked text of the tools channel, markers included, for the tool-call reader."""

    text: str
    thought: bool | None = None
    """Whether text outside calls from here on, up to the channel's first call, is
    the thought's (rule 6): on the markup that opens a tools channel, whether the
    channel interrupted a thought; ``False`` on a think exit inside the channel;
    ``None`` on all other markup."""


@_EVENT
class CallOpened:
    index: int
    """Position of the call in the output, from 0."""
    name: str


@_EVENT
class ArgumentsDelta:
    index: int
    text: str


@_EVENT
class CallClosed:
    index: int


@_EVENT
class CallCut:
    """The output ended inside this call: its arguments are what streamed."""

    index: int


@_EVENT
class Prose:
    """Text of the tools channel outside any call: content."""

    text: str


@_EVENT
class Dropped:
    """Markup read as no call; for the adapter to log and count."""

    index: int | None
    """The call it belonged to; ``None`` when no call was opened."""
    reason: str
    """What was dropped, for a person (may name the element)."""
    kind: str = ""
    """What was dropped, from a fixed set of labels (metrics); ``CALL_DROPS`` are
    calls the model began and no call came of."""


# The kinds of ``Dropped`` that are a call dropped whole.
CALL_QUOTED = "call_opener_quoted"
CALL_UNNAMED = "unnamed_call"
CALL_CUT_EARLY = "call_cut_before_arguments"
CALL_DROPS = frozenset({CALL_QUOTED, CALL_UNNAMED, CALL_CUT_EARLY})


ReaderEvent = Reasoning | Content | ToolMarkup
ToolEvent = CallOpened | ArgumentsDelta | CallClosed | CallCut | Prose | Dropped
OutputEvent = (
    Reasoning | Content | CallOpened | ArgumentsDelta | CallClosed | CallCut | Dropped
)
