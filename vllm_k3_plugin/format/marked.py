"""Marked text: the output as the readers see it, structure told from text by token ids.

A control atom (``<|open|>``, ``<|close|>``, ``<|sep|>``, ``<|end_of_msg|>``) is one
token id; the same characters written in BPE pieces are the model's text (K3_FORMAT,
"Structure is read from token ids"). The readers never compare atom strings: they
read *marked text*, where each control atom is one reserved character (a lone high
surrogate, which no decoded text can hold: Python's UTF-8 decoder never produces
one) and BPE-spelled atom characters stay as they were. Every marker the readers
know is spelled here, from ``vocab``, with ``marked()``.

Two markers of the text, one per source:

- ``IdAtoms`` reads the output's token ids beside its text (what vLLM hands the
  parsers): an atom in the text is marked only where a control id stands for it.
- ``TextAtoms`` reads text alone, for a saved output replayed offline: every atom
  string is read as a control atom (the reading before ids; a quoted marker spelled
  in BPE is then read as structure).

Both are chunk-invariant and hold back at most an atom's length minus one character
(a suffix that may be the start of an atom), and a stop token's text at the end
(``<|end_of_msg|>``, kept with ``include_stop_str_in_output``): it reaches the
readers only if more of the output follows it, so an output reads the same with and
without that text.
"""

from __future__ import annotations

import collections
import re
from collections.abc import Callable, Iterable, Sequence

from vllm_k3_plugin.format import vocab

Decode = Callable[[Sequence[int]], str]

# The marks: one character per control atom.
OPEN = "\ud800"
CLOSE = "\ud801"
SEP = "\ud802"
END_OF_MSG = "\ud803"

_MARK_OF = {
    vocab.OPEN: OPEN,
    vocab.CLOSE: CLOSE,
    vocab.SEP: SEP,
    vocab.END_OF_MSG: END_OF_MSG,
}
_ATOM_OF = {mark: atom for atom, mark in _MARK_OF.items()}
_MARK_OF_ID = {
    vocab.OPEN_ID: OPEN,
    vocab.CLOSE_ID: CLOSE,
    vocab.SEP_ID: SEP,
    vocab.END_OF_MSG_ID: END_OF_MSG,
}
MARKS = frozenset(_ATOM_OF)
_ATOMS = tuple(_MARK_OF)
_ATOM_RE = re.compile("|".join(map(re.escape, _ATOMS)))
_MARK_RE = re.compile("[" + "".join(sorted(MARKS)) + "]")
# A suffix that may begin an atom is at most this long.
_MAX_HOLD = max(map(len, _ATOMS)) - 1
_ATOM_PREFIXES = frozenset(atom[:i] for atom in _ATOMS for i in range(1, len(atom)))
_ATOM_START = "<"
assert all(atom.startswith(_ATOM_START) for atom in _ATOMS)


def marked(text: str) -> str:
    """``text`` with every atom string marked: how the readers spell a marker."""
    return _ATOM_RE.sub(lambda match: _MARK_OF[match[0]], text)


def unmarked(text: str) -> str:
    """Marked text as the client reads it: each mark back as its atom string."""
    if not _MARK_RE.search(text):
        return text
    return _MARK_RE.sub(lambda match: _ATOM_OF[match[0]], text)


def _undecided_start(text: str) -> int:
    """Start of the suffix of ``text`` that may still become an atom."""
    end = len(text)
    at = text.find(_ATOM_START, max(0, end - _MAX_HOLD))
    while at != -1:
        if text[at:] in _ATOM_PREFIXES:
            return at
        at = text.find(_ATOM_START, at + 1)
    return end


class _HeldTail:
    """Holds back a suffix that may still become an atom string, and a stop token's
    mark until more of the output follows it."""

    __slots__ = ("_held", "_stop")

    def __init__(self) -> None:
        self._held = ""
        self._stop = ""

    def _stop_held(self, out: str) -> str:
        """``out`` after the stop mark held before it, holding a new one at its end."""
        if self._stop and out:
            out, self._stop = self._stop + out, ""
        if out.endswith(END_OF_MSG):
            out, self._stop = out[:-1], END_OF_MSG
        return out

    def _decided(self, text: str) -> tuple[str, bool]:
        """The text now decided, and whether it may hold an atom string."""
        buf = self._held + text if self._held else text
        if _ATOM_START not in buf:
            self._held = ""
            return buf, False
        cut = _undecided_start(buf)
        self._held = buf[cut:]
        return buf[:cut], True

    @property
    def held_chars(self) -> int:
        """Characters held that may still be text (the start of an atom string)."""
        return len(self._held)

    def finish(self) -> str:
        """The held suffix: the start of an atom that never came, so text (after a
        held stop mark, which is dropped when nothing follows it)."""
        held, self._held = self._held, ""
        stop, self._stop = self._stop, ""
        return stop + held if held else ""


class TextAtoms(_HeldTail):
    """Text alone: every atom string is a control atom (the offline fallback)."""

    __slots__ = ()

    def mark(self, text: str, ids: Sequence[int] | None = None) -> str:
        if not self._held and not self._stop and _ATOM_START not in text:
            return text  # the usual step: nothing held, no atom can start
        body, may_hold = self._decided(text)
        return self._stop_held(marked(body) if may_hold else body)


class AtomTokens:
    """Which BPE tokens can end an atom spelled in pieces; one per tokenizer.

    A BPE-spelled atom ends in a token holding ``>`` and holds ``|`` in that token or
    one of the few before it. Each id is decoded once, on first sight, for those two
    characters; only a token with both in reach is decoded with its neighbours.
    """

    __slots__ = ("_decode", "_flags")

    _UNSEEN, _PLAIN, _BAR, _GT = 0, 1, 2, 4

    def __init__(self, decode: Decode) -> None:
        self._decode = decode
        # Per id, once seen: ``_PLAIN`` plus ``_BAR`` / ``_GT``. Control ids stay
        # unseen (``IdAtoms`` reads them before asking).
        self._flags = bytearray(vocab.VOCAB_SIZE)

    @property
    def table(self) -> bytearray:
        """The flags by id; ``_PLAIN`` alone means a token that ends no atom."""
        return self._flags

    def flags(self, token: int) -> int:
        found = self._flags[token]
        if found == self._UNSEEN:
            text = self._decode([token])
            found = (
                self._PLAIN
                | (self._BAR if "|" in text else 0)
                | (self._GT if ">" in text else 0)
            )
            self._flags[token] = found
        return found

    def atoms_ending_in(self, before: Sequence[int], token: int) -> list[str]:
        """The atoms whose last character is in ``token``, in order; ``before`` is
        the output's ids just before it (enough to hold the longest atom)."""
        flags = self.flags(token)
        if not flags & self._GT:
            return []
        if not flags & self._BAR and not any(
            self.flags(previous) & self._BAR
            for previous in before
            if previous < vocab.BPE_RANK_COUNT
        ):
            return []
        prefix = self._decode(list(before))
        whole = self._decode([*before, token])
        # Atoms do not overlap themselves, and ``prefix`` is ``whole`` up to this
        # token (a character split at the seam is never part of an atom): the atoms
        # counted in ``whole`` and not in ``prefix`` are this token's, the last ones.
        found = []
        for atom in _ATOMS:
            new = whole.count(atom) - prefix.count(atom)
            if new > 0:
                at = len(whole)
                for _ in range(new):
                    at = whole.rfind(atom, 0, at)
                    found.append((at, atom))
        return [atom for _, atom in sorted(found)]


# Ids before a token that an atom ending in it can reach back into.
_WINDOW = _MAX_HOLD + 1
# A position whose flags are not plain's alone (unseen, a control id, ``|``, ``>``).
_NOT_PLAIN = re.compile(b"[^\x01]").finditer


class IdAtoms(_HeldTail):
    """Text with its token ids: an atom is marked where a control id stands for it.

    The ids are read first; they name, in order, every atom the text will hold
    (control ids, and BPE pieces that end one). Each atom string then found in the
    text takes the next name: a control one is marked, a BPE one stays text. vLLM's
    text may lag its ids (stop strings hold text back), never lead them, so the
    queue of names is never short of the text; a stop token's text, which vLLM
    drops, is passed over.
    """

    __slots__ = ("_pending", "_plain", "_recent", "_tokens", "quoted_atoms")

    def __init__(self, tokens: AtomTokens) -> None:
        super().__init__()
        self._tokens = tokens
        self._plain = tokens.table
        self.quoted_atoms = 0
        """Atom strings the model wrote in BPE pieces: text, not structure."""
        # (atom, marked) for each atom the ids announced and the text has not shown.
        self._pending: collections.deque[tuple[str, bool]] = collections.deque()
        self._recent: collections.deque[int] = collections.deque(maxlen=_WINDOW)

    def mark(self, text: str, ids: Sequence[int] | None = None) -> str:
        if ids:
            try:
                # The usual streaming step: one token seen before, ending no atom.
                plain = len(ids) == 1 and self._plain[ids[0]] == AtomTokens._PLAIN
            except IndexError:  # an id past the table
                plain = False
            if plain:
                self._recent.append(ids[0])
            elif len(ids) == 1 and ids[0] in _MARK_OF_ID:
                self._pending.append((_ATOM_OF[_MARK_OF_ID[ids[0]]], True))
                self._recent.append(ids[0])
            else:
                self._read_ids(ids)
        if not self._held and not self._stop and _ATOM_START not in text:
            return text
        body, may_hold = self._decided(text)
        if not may_hold or not self._pending:
            return self._stop_held(body)
        return self._stop_held(_ATOM_RE.sub(self._name, body))

    def _read_ids(self, ids: Sequence[int]) -> None:
        """Queue the atoms ``ids`` spell. Plain tokens (the bulk) are skipped in C:
        the table maps each id to its flags, and only the others are looked at."""
        try:
            flags = bytes(map(self._plain.__getitem__, ids))
        except IndexError:  # an id past the table: look at each
            flags = bytes(len(ids))
        recent = list(self._recent)
        for found in _NOT_PLAIN(flags):
            at = found.start()
            token = ids[at]
            if token >= vocab.BPE_RANK_COUNT:
                mark = _MARK_OF_ID.get(token)
                if mark is not None:
                    self._pending.append((_ATOM_OF[mark], True))
            elif self._tokens.flags(token) & AtomTokens._GT:
                before = ids[max(0, at - _WINDOW) : at]
                if len(before) < _WINDOW:
                    before = (recent + list(before))[-_WINDOW:]
                for atom in self._tokens.atoms_ending_in(before, token):
                    self._pending.append((atom, False))
        self._recent.extend(ids[-_WINDOW:])

    def _name(self, match: re.Match[str]) -> str:
        atom = match[0]
        pending = self._pending
        while pending:
            expected, is_control = pending[0]
            if expected == atom:
                pending.popleft()
                if is_control:
                    return _MARK_OF[atom]
                self.quoted_atoms += 1
                return atom
            if expected != vocab.END_OF_MSG:
                break
            pending.popleft()  # a stop token whose text vLLM dropped
        # An atom the ids do not account for: the model's text.
        return atom


class AlreadyMarked:
    """Text that is marked already (the reasoning reader's ``ToolMarkup``)."""

    __slots__ = ()

    def mark(self, text: str, ids: Sequence[int] | None = None) -> str:
        return text

    held_chars = 0

    def finish(self) -> str:
        return ""


ALREADY_MARKED = AlreadyMarked()


def atoms_for(ids_known: bool, tokens: AtomTokens | None) -> TextAtoms | IdAtoms:
    """The marker for one output: by ids when the caller has them."""
    if ids_known and tokens is not None:
        return IdAtoms(tokens)
    return TextAtoms()


def marked_all(markers: Iterable[str]) -> tuple[str, ...]:
    return tuple(marked(marker) for marker in markers)
