"""Channel boundaries on token ids: the engine's "has reasoning ended?" and the start
state from the prompt. Sans-I/O: the caller supplies ``decode(ids) -> str``.

On ids a K3 element is ``OPEN_ID`` or ``CLOSE_ID``, a few name tokens, then ``SEP_ID``.
Only the structural ids count here: a marker spelled in BPE pieces is found by the text
reader but not by this module, so for such outputs the engine may start a grammar later
than the reader ends reasoning (never earlier).

The think channel ends, as in the reader, at ``<|close|>think<|sep|>`` (or
``<|close|>think`` followed directly by another element), at
``<|open|>response<|sep|>``, and at a tools channel: ``<|open|>tools<|sep|>`` followed,
whitespace aside, by a call opener (``<|open|>call`` and a space or ``<|sep|>``). The
channel then ends after the tools opener, decided at the id that completes
``call ``. A streaming step looks only at the delta and at most ``_LOOKBACK_DECISION``
ids before it: O(delta) per step.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence

from vllm_k3_plugin.format import vocab
from vllm_k3_plugin.format.vocab import CLOSE_ID, OPEN_ID, SEP_ID

Decode = Callable[[Sequence[int]], str]

# Element names are one or two BPE tokens; anything longer is not a channel marker.
MAX_NAME_IDS = 4
_LOOKBACK = MAX_NAME_IDS + 1

# Ids a streaming step looks back to find a tools opener its delta decides (a
# whitespace id is at least one character of the gap).
_LOOKBACK_DECISION = vocab.TOOLS_OPENER_MAX_GAP + 2 * _LOOKBACK


class Boundary(enum.Enum):
    THINK_OPENED = "think opened"
    THINK_ENDED = "think ended"
    RESPONSE_OPENED = "response opened"
    TOOLS_OPENED = "tools opened"
    OTHER = "other element"


def _classify(opener: int, name: str, terminator: int) -> Boundary:
    if terminator == SEP_ID:
        if opener == OPEN_ID:
            if name == vocab.THINK:
                return Boundary.THINK_OPENED
            if name == vocab.RESPONSE:
                return Boundary.RESPONSE_OPENED
            if name == vocab.TOOLS:
                return Boundary.TOOLS_OPENED
        elif name == vocab.THINK:
            return Boundary.THINK_ENDED
        return Boundary.OTHER
    # ``<|close|>think`` directly followed by another element: the lenient exit.
    if opener == CLOSE_ID and name == vocab.THINK:
        return Boundary.THINK_ENDED
    return Boundary.OTHER


def _element_ending_at(ids: Sequence[int], end: int, decode: Decode) -> Boundary | None:
    """The element whose terminator is ``ids[end]``, if ``ids[end]`` ends one."""
    terminator = ids[end]
    if terminator not in (SEP_ID, OPEN_ID, CLOSE_ID):
        return None
    for start in range(end - 1, max(-1, end - 1 - _LOOKBACK), -1):
        token = ids[start]
        if token == SEP_ID:
            return None
        if token in (OPEN_ID, CLOSE_ID):
            if start + 1 == end:
                return None
            name = decode(ids[start + 1 : end]).strip()
            return _classify(token, name, terminator)
    return None


def _ends_reasoning(boundary: Boundary | None) -> bool:
    return boundary in (Boundary.THINK_ENDED, Boundary.RESPONSE_OPENED)


def newest_boundary(ids: Sequence[int], decode: Decode) -> Boundary | None:
    """The last channel element in ``ids``, scanning back from the end (a tools
    opener counts as the end of the think channel: this reads prompts)."""
    for end in range(len(ids) - 1, 0, -1):
        boundary = _element_ending_at(ids, end, decode)
        if boundary is Boundary.TOOLS_OPENED:
            return Boundary.THINK_ENDED
        if boundary is not None and boundary is not Boundary.OTHER:
            return boundary
    return None


def reasoning_open_after(ids: Sequence[int], decode: Decode) -> bool | None:
    """Whether the think channel is open at the end of ``ids``; None if no channel
    element occurs at all."""
    boundary = newest_boundary(ids, decode)
    if boundary is None:
        return None
    return boundary is Boundary.THINK_OPENED


def _tools_decided_at(ids: Sequence[int], start: int, decode: Decode) -> int | None:
    """After a tools opener ending before ``start``: the index of the id that shows
    a call opener follows (whitespace aside), ``-1`` if something else follows, or
    ``None`` while the ids so far leave it open."""
    at, gap = start, 0
    while at < len(ids) and ids[at] < vocab.BPE_RANK_COUNT:
        space = decode(ids[at : at + 1])
        gap += len(space)
        if gap > vocab.TOOLS_OPENER_MAX_GAP or not space.isspace():
            return -1
        at += 1
    if at == len(ids):
        return None
    if ids[at] != OPEN_ID:
        return -1
    for end in range(at + 1, min(len(ids), at + 2 + _LOOKBACK)):
        if ids[end] == SEP_ID:
            return end if decode(ids[at + 1 : end]) == vocab.CALL else -1
        if ids[end] >= vocab.BPE_RANK_COUNT:
            return -1
        name = decode(ids[at + 1 : end + 1])
        if name.startswith(vocab.CALL + " "):
            return end
        if not vocab.CALL.startswith(name) and name != vocab.CALL:
            return -1
    return None if len(ids) < at + 2 + _LOOKBACK else -1


def _exits(ids: Sequence[int], decode: Decode, first_end: int):
    """``(exit, decided_at)`` for each element ending the think channel whose last id
    is at ``first_end`` or later, in order; ``decided_at`` is ``None`` for a tools
    opener the ids so far leave undecided (it is the last one yielded)."""
    for end in range(max(1, first_end), len(ids)):
        boundary = _element_ending_at(ids, end, decode)
        if _ends_reasoning(boundary):
            # The lenient exit (no separator): the next element starts at ``end``.
            yield (end + 1 if ids[end] == SEP_ID else end), end
        elif boundary is Boundary.TOOLS_OPENED:
            decided = _tools_decided_at(ids, end + 1, decode)
            if decided is None:
                yield end + 1, None
                return
            if decided >= 0:
                yield end + 1, decided


def reasoning_end(ids: Sequence[int], decode: Decode) -> tuple[int, int] | None:
    """``(exit, decided_at)`` of the element that ends the think channel: the index
    just past it, and the index of the id that decided it; None if undecided."""
    for exit_at, decided in _exits(ids, decode, 1):
        return None if decided is None else (exit_at, decided)
    return None


def reasoning_ends_in_delta(ids: Sequence[int], delta_len: int, decode: Decode) -> bool:
    """Whether the think channel's end is decided by one of the last ``delta_len``
    ids of ``ids``."""
    first = len(ids) - delta_len
    return any(
        decided is not None and decided >= first
        for _, decided in _exits(ids, decode, max(1, first - _LOOKBACK_DECISION))
    )


def reasoning_exit_at_or_after(
    ids: Sequence[int], decode: Decode, first_end: int = 1
) -> int | None:
    """Index just past the first element ending the think channel whose last id is
    at ``first_end`` or later; None if there is none yet, or it is undecided."""
    for exit_at, decided in _exits(ids, decode, first_end):
        return None if decided is None else exit_at
    return None


def reasoning_span_end(
    output_ids: Sequence[int], decode: Decode, *, starts_in_think: bool
) -> int:
    """Index just past the element that ends the think channel in ``output_ids``
    (0 if the output does not start in it; ``len`` if it never ends)."""
    if not starts_in_think:
        return 0
    end = reasoning_exit_at_or_after(output_ids, decode)
    return len(output_ids) if end is None else end


def count_reasoning_ids(
    output_ids: Sequence[int], decode: Decode, *, starts_in_think: bool
) -> int:
    """Output ids inside the think channel, its exit included."""
    return reasoning_span_end(output_ids, decode, starts_in_think=starts_in_think)


class ReasoningCount:
    """``count_reasoning_ids`` over one growing id list, O(new ids) per call.

    vLLM's chat streaming with continuous usage asks once per step with every id so
    far; a list that is not an extension of the last one is counted afresh.
    """

    __slots__ = ("_end", "_seen")

    def __init__(self) -> None:
        self._seen = 0
        self._end: int | None = None

    def update(
        self, output_ids: Sequence[int], decode: Decode, *, starts_in_think: bool
    ) -> int:
        if not starts_in_think:
            return 0
        if len(output_ids) < self._seen:
            self._seen, self._end = 0, None
        if self._end is None:
            found = next(_exits(output_ids, decode, self._seen), None)
            if found is None:
                self._seen = len(output_ids)
            elif found[1] is None:
                # A tools opener not yet decided: look at it again next time.
                self._seen = found[0] - 1
            else:
                self._end = found[0]
                self._seen = len(output_ids)
        return len(output_ids) if self._end is None else self._end
