"""Channel boundaries on token ids: the engine's "has reasoning ended?" and the start
state from the prompt. Sans-I/O: the caller supplies ``decode(ids) -> str``.

On ids a K3 element is ``OPEN_ID`` or ``CLOSE_ID``, a few name tokens, then ``SEP_ID``.
Only the structural ids count here: a marker spelled in BPE pieces is found by the text
reader but not by this module, so for such outputs the engine may start a grammar later
than the reader ends reasoning (never earlier).

The think channel ends, as in the reader, at ``<|close|>think<|sep|>`` (or
``<|close|>think`` followed directly by another element), at
``<|open|>response<|sep|>`` and at ``<|open|>tools<|sep|>``. A streaming step looks
only at elements whose last id is in the delta, plus at most ``MAX_NAME_IDS + 1`` ids
before it: O(delta) per step.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence

from vllm_k3_plugin.vocab import CLOSE_ID, OPEN_ID, SEP_ID

Decode = Callable[[Sequence[int]], str]

# Element names are one or two BPE tokens; anything longer is not a channel marker.
MAX_NAME_IDS = 4
_LOOKBACK = MAX_NAME_IDS + 1


class Boundary(enum.Enum):
    THINK_OPENED = "think opened"
    THINK_ENDED = "think ended"
    RESPONSE_OPENED = "response opened"
    OTHER = "other element"


def _classify(opener: int, name: str, terminator: int) -> Boundary:
    if terminator == SEP_ID:
        if opener == OPEN_ID:
            if name == "think":
                return Boundary.THINK_OPENED
            if name == "response":
                return Boundary.RESPONSE_OPENED
            if name == "tools":
                return Boundary.THINK_ENDED
        elif name == "think":
            return Boundary.THINK_ENDED
        return Boundary.OTHER
    # ``<|close|>think`` directly followed by another element: the lenient exit.
    if opener == CLOSE_ID and name == "think":
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
    """The last channel element in ``ids``, scanning back from the end."""
    for end in range(len(ids) - 1, 0, -1):
        boundary = _element_ending_at(ids, end, decode)
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


def reasoning_ends_in_delta(ids: Sequence[int], delta_len: int, decode: Decode) -> bool:
    """Whether an element that ends the think channel completes in the last
    ``delta_len`` ids of ``ids``."""
    first = max(1, len(ids) - delta_len)
    return any(
        _ends_reasoning(_element_ending_at(ids, end, decode))
        for end in range(first, len(ids))
    )


def reasoning_exit_at_or_after(
    ids: Sequence[int], decode: Decode, first_end: int = 1
) -> int | None:
    """Index just past the first element ending the think channel whose last id is
    at ``first_end`` or later; None if there is none yet."""
    for end in range(max(1, first_end), len(ids)):
        if _ends_reasoning(_element_ending_at(ids, end, decode)):
            if ids[end] == SEP_ID:
                return end + 1
            return end  # the lenient exit: the next element starts here
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
            self._end = reasoning_exit_at_or_after(output_ids, decode, self._seen)
            self._seen = len(output_ids)
        return len(output_ids) if self._end is None else self._end
