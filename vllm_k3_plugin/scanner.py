"""MarkerScanner: text in, ``Text`` / ``Marker`` / ``Cut`` events out; only strings.

One buffer and a cursor, one compiled alternation of the markers, longest first, so a
search at any position finds the leftmost marker and, there, the longest one (the same
answer as a ``find`` per marker, in one pass). Constraints that keep it linear:

- a search starts at the cursor and stops at the next marker, so a whole output with m
  markers costs one pass plus m matches; the text after a hit is never copied;
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
from typing import NamedTuple


class Text(NamedTuple):
    """Text between markers. Adjacent ``Text`` events are one text."""

    text: str


class Marker(NamedTuple):
    """A complete marker; ``marker`` is the marker string itself."""

    marker: str


class Cut(NamedTuple):
    """The start of a marker cut off by the end of the output. Not a marker."""

    text: str


Event = Text | Marker | Cut


class MarkerSetError(ValueError):
    """The markers cannot be scanned chunk-invariantly."""


class MarkerScanner:
    """Scans text fed in any chunking into the same marker events."""

    __slots__ = (
        "_finished",
        "_held",
        "_max_hold",
        "_prefixes",
        "_search",
        "_starts",
    )

    def __init__(self, markers: Iterable[str]) -> None:
        compiled = _compile(frozenset(markers))
        self._search = compiled.search
        self._prefixes = compiled.prefixes
        self._max_hold = compiled.max_hold
        self._starts = compiled.starts
        self._held = ""
        self._finished = False

    @property
    def held(self) -> str:
        """The undecided tail: a proper prefix of some marker, or empty."""
        return self._held

    def feed(self, chunk: str) -> list[Event]:
        """Scan ``chunk`` after everything fed before; return the decided events."""
        if self._finished:
            raise RuntimeError("feed() after finish()")
        buf = self._held + chunk if self._held else chunk
        if not buf:
            return []
        self._held = ""
        if len(self._starts) == 1:
            (start_char,) = self._starts
            if start_char not in buf:
                return [Text(buf)]
        events: list[Event] = []
        append = events.append
        search = self._search
        prefixes = self._prefixes
        end_of_buf = len(buf)
        pos = 0
        while (match := search(buf, pos)) is not None:
            start, end = match.span()
            if end_of_buf - start <= self._max_hold and buf[start:] in prefixes:
                # A longer marker may still complete here: the next chunk decides.
                if start > pos:
                    append(Text(buf[pos:start]))
                self._held = buf[start:]
                return events
            if start > pos:
                append(Text(buf[pos:start]))
            append(Marker(match.group()))
            pos = end
        hold_from = self._undecided_tail(buf, pos)
        if hold_from > pos:
            append(Text(buf[pos:hold_from]))
        self._held = buf[hold_from:]
        return events

    def finish(self) -> list[Event]:
        """End of the output: a held partial marker is reported as ``Cut``."""
        self._finished = True
        held, self._held = self._held, ""
        return [Cut(held)] if held else []

    def _undecided_tail(self, buf: str, pos: int) -> int:
        """Start of the longest suffix of ``buf[pos:]`` that could begin a marker."""
        end_of_buf = len(buf)
        first = max(pos, end_of_buf - self._max_hold)
        for index in range(first, end_of_buf):
            if buf[index] in self._starts and buf[index:] in self._prefixes:
                return index
        return end_of_buf


class _Compiled(NamedTuple):
    search: Callable[..., re.Match[str] | None]
    prefixes: frozenset[str]
    max_hold: int
    starts: frozenset[str]


@functools.lru_cache(maxsize=32)
def _compile(markers: frozenset[str]) -> _Compiled:
    """The alternation (longest first) and the prefix tables, once per marker set."""
    ordered = sorted(markers, key=lambda m: (-len(m), m))
    if not ordered or not all(ordered):
        raise MarkerSetError("the scanner needs at least one non-empty marker")
    _check_nesting(ordered)
    return _Compiled(
        search=re.compile("|".join(map(re.escape, ordered))).search,
        prefixes=frozenset(m[:i] for m in ordered for i in range(1, len(m))),
        max_hold=len(ordered[0]) - 1,
        starts=frozenset(m[0] for m in ordered),
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
