"""MarkerScanner: text in, ``Text`` / ``Marker`` / ``Cut`` events out; only strings.

One compiled alternation of the markers, longest first, so at any position the
leftmost marker and, there, the longest one is found (the same answer as a ``find``
per marker, in one pass). A chunk is cut at its markers by one ``re.split`` over the
capturing alternation, which runs in C; Python touches each marker once. Constraints
that keep it linear:

- each feed scans only the chunk and the held tail, once; nothing fed before is
  rescanned or copied;
- at a chunk end, only a suffix that is a proper prefix of some marker is held back
  (at most ``len(longest marker) - 1`` characters), and it is the only text carried
  into the next feed;
- text events may be split differently at different chunkings; their concatenation,
  and every marker, is the same whatever the chunking.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import NamedTuple


@dataclass(frozen=True, slots=True)
class Text:
    """Text between markers. Adjacent ``Text`` events are one text."""

    text: str


@dataclass(frozen=True, slots=True)
class Marker:
    """A complete marker; ``marker`` is the marker string itself."""

    marker: str


@dataclass(frozen=True, slots=True)
class Cut:
    """The start of a marker cut off by the end of the output. Not a marker."""

    text: str


Event = Text | Marker | Cut


class MarkerSetError(ValueError):
    """The markers cannot be scanned chunk-invariantly."""


class MarkerScanner:
    """Scans text fed in any chunking into the same marker events."""

    __slots__ = (
        "_find_start",
        "_finished",
        "_held",
        "_max_hold",
        "_prefixes",
        "_split",
    )

    def __init__(self, markers: Iterable[str]) -> None:
        compiled = _compile(frozenset(markers))
        self._split = compiled.split
        self._prefixes = compiled.prefixes
        self._max_hold = compiled.max_hold
        self._find_start = compiled.find_start
        self._held = ""
        self._finished = False

    @property
    def held(self) -> str:
        """The undecided tail: a proper prefix of some marker, or empty."""
        return self._held

    def feed(self, chunk: str) -> list[Event]:
        """Scan ``chunk`` after everything fed before; return the decided events."""
        parts = self.feed_parts(chunk)
        events: list[Event] = []
        append = events.append
        for index in range(0, len(parts) - 1, 2):
            if parts[index]:
                append(Text(parts[index]))
            append(Marker(parts[index + 1]))
        if parts and parts[-1]:
            append(Text(parts[-1]))
        return events

    def feed_parts(self, chunk: str) -> list[str]:
        """``feed`` without event objects, for readers on the hot path.

        Returns ``[text, marker, text, ..., marker, text]``: markers at odd indices,
        text (possibly empty) at even ones; ``[]`` only for an empty feed with
        nothing held.
        """
        if self._finished:
            raise RuntimeError("feed() after finish()")
        buf = self._held + chunk if self._held else chunk
        if not buf:
            return []
        self._held = ""
        if self._find_start(buf) is None:
            return [buf]
        parts = self._split(buf)
        if len(parts) > 1:
            # The last marker may be the start of a longer one still arriving (only
            # the last: a marker holds another only as its prefix or its suffix).
            tail = parts[-2] + parts[-1]
            if len(tail) <= self._max_hold and tail in self._prefixes:
                self._held = tail
                del parts[-2:]
                return parts
        last = parts[-1]
        hold_from = self._undecided_tail(last)
        if hold_from < len(last):
            self._held = last[hold_from:]
            parts[-1] = last[:hold_from]
        return parts

    def finish(self) -> list[Event]:
        """End of the output: a held partial marker is reported as ``Cut``."""
        self._finished = True
        held, self._held = self._held, ""
        return [Cut(held)] if held else []

    def _undecided_tail(self, text: str) -> int:
        """Start of the longest suffix of ``text`` that could begin a marker."""
        end = len(text)
        found = self._find_start(text, max(0, end - self._max_hold))
        while found is not None:
            index = found.start()
            if text[index:] in self._prefixes:
                return index
            found = self._find_start(text, index + 1)
        return end


class _Compiled(NamedTuple):
    split: Callable[[str], list[str]]
    prefixes: frozenset[str]
    max_hold: int
    find_start: Callable[..., re.Match[str] | None]
    """The first character that begins some marker, from a position (in C)."""


@functools.lru_cache(maxsize=32)
def _compile(markers: frozenset[str]) -> _Compiled:
    """The alternation (longest first) and the prefix tables, once per marker set."""
    ordered = sorted(markers, key=lambda m: (-len(m), m))
    if not ordered or not all(ordered):
        raise MarkerSetError("the scanner needs at least one non-empty marker")
    _check_nesting(ordered)
    return _Compiled(
        split=re.compile("(" + "|".join(map(re.escape, ordered)) + ")").split,
        prefixes=frozenset(m[:i] for m in ordered for i in range(1, len(m))),
        max_hold=len(ordered[0]) - 1,
        find_start=re.compile(
            "[" + "".join(re.escape(c) for c in sorted({m[0] for m in ordered})) + "]"
        ).search,
    )


def _check_nesting(markers: list[str]) -> None:
    """A marker may contain another only as its prefix or suffix.

    Otherwise a held partial marker could hide a complete inner one and the events
    would depend on the chunking.
    """
    for outer in markers:
        for inner in markers:
            if inner is outer or len(inner) >= len(outer):
                continue
            at = outer.find(inner, 1)
            while at != -1:
                if at + len(inner) != len(outer):
                    raise MarkerSetError(
                        f"marker {inner!r} occurs inside {outer!r} at offset {at}"
                    )
                at = outer.find(inner, at + 1)
